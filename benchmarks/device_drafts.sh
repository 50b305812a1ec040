#!/usr/bin/env bash
# H200 draft training (device tool). One background job (setsid, so it outlives a call) builds the
# self-distillation dataset and trains the EAGLE-3 draft; calls made back to back (the machine keeps
# /tmp and such a job ~30 s after a call) watch it and bring the result back:
#   PHASE=start  : start the job, then watch it until WATCH_S (default 560 s) has passed.
#   PHASE=watch  : watch until the job ends or WATCH_S has passed.
#   PHASE=collect: copy the draft (eagle3.tar) and the logs into $OUT.
# The job: benchmarks/draft_data.py (offline prompts + prompts the target writes itself, all answered
# by the target at T=0) -> /tmp/data/data.pt, then `tercel train-draft --algorithm eagle3` on it.
# Accept lengths are measured afterwards on CPU here (benchmarks/spec_accept.py).
# Expects the SmolLM2 parts in /tmp/smol (../shared/tools/split-smollm2) and the gguf wheel in .carry/whl.
# Knobs: GEN_BUDGET (s), SYNTH, SYNTH_SHARE, TRAIN_S, VOCAB (0 = the target's head), INTER, BS, LR, INIT.
set -uo pipefail
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
R=/tmp/run
[ -f $M ] || { cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3; }
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

watch() {
  local until=$(( T0 + ${WATCH_S:-560} ))
  while [ ! -f $R/done ] && [ "$(date +%s)" -lt $until ]; do sleep 15; done
  el "job $( [ -f $R/done ] && echo "ended: $(cat $R/done)" || echo running)"
  grep -E "responses:|synthetic prompts:|dataset:|samples," $R/data.log 2>/dev/null | tail -4
  [ -f $R/train.log ] && tail -c 600 $R/train.log | tr '\r' '\n' | grep -v '^$' | tail -2
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
}

case "${PHASE:-start}" in
start)
  rm -rf $R && mkdir -p $R /tmp/data /tmp/e3
  INIT=${INIT-tercel/drafts/smollm2-eagle3}  # INIT= (empty): train from scratch
  cat > $R/job.sh <<EOF
cd $PWD
python3 benchmarks/draft_data.py --out /tmp/data --model $M --device cuda --num-prompts ${OFFLINE:-8000} \
  --synth-prompts ${SYNTH:-60000} --synth-share ${SYNTH_SHARE:-0.4} --max-new-tokens 256 --batch ${GEN_BS:-1024} \
  --time-budget ${GEN_BUDGET:-420} > $R/data.log 2>&1 || { echo "data failed" > $R/done; exit 1; }
cp /tmp/data/data.pt /tmp/e3/
python3 -m tercel.cli train-draft --algorithm eagle3 --target $M --out /tmp/e3 --device cuda --max-len 640 \
  --draft-vocab-size ${VOCAB:-0} --intermediate-size ${INTER:-1536} --batch-size ${BS:-48} --lr ${LR:-1e-3} \
  ${INIT:+--init-from $INIT} --max-steps 1000000 --time-budget ${TRAIN_S:-720} \
  --save-every 500 > $R/train.log 2>&1 && echo "trained" > $R/done || echo "train failed" > $R/done
EOF
  setsid nohup bash $R/job.sh > $R/job.out 2>&1 < /dev/null &
  el "job started"
  watch ;;
watch) watch ;;
collect)
  tar -C /tmp/e3 -cf $OUT/eagle3.tar config.json model.safetensors train_log.json
  cp $R/data.log $R/train.log $OUT/ 2>/dev/null
  tr '\r' '\n' < $R/train.log | grep -v '^$' | tail -3
  ls -la $OUT; el collected ;;
esac
