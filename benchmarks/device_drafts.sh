#!/usr/bin/env bash
# H200 draft training (device tool). One background job (setsid, so it outlives a call) builds the
# self-distillation dataset, trains EAGLE-3 and DFlash drafts side by side on it, and measures them on
# the GPU; calls made back to back (the machine keeps /tmp and such a job ~30 s after a call) watch it
# and bring the results back:
#   PHASE=start  : start the job, then watch it until WATCH_S (default 560 s) has passed.
#   PHASE=watch  : watch until the job ends or WATCH_S has passed.
#   PHASE=collect: copy the drafts (<run>.tar), the accept lengths and the logs into $OUT.
# Every watch ends with a collect of whatever exists by then (the trainers export every 500 steps):
# a machine can be given back between calls (a gap of over ~30 s, e.g. a stalled client), and with it
# /tmp and the job; one whole experiment was lost that way before this.
# The job:
#   1. data: SHARDS processes of benchmarks/draft_data.py side by side (one leaves the GPU idle during
#      its per-step host work), each writing and answering its own prompts at T=0, joined by --merge;
#   2. training, side by side: one EAGLE-3 run per entry of RUNS ("name:batch:lr[:hard[:aux[:inter]]]";
#      hard: the --hard-label-weight, default 0; aux: --aux-layer-ids such as 1,14,29, default the
#      config's; inter: the MLP width, default INTER; warm-started from INIT, the target's head) and,
#      with DFLASH=1, a DFlash run warm-started from DFLASH_INIT;
#   3. accept lengths on the GPU (bf16, held-out prompts): spec_accept.py per EAGLE-3 run, dflash_accept.py.
# The reported accept lengths are measured afterwards in fp32 on CPU (spec_accept.py, dflash_accept.py).
# Expects the SmolLM2 parts in /tmp/smol (../shared/tools/split-smollm2) and the gguf wheel in .carry/whl.
# Knobs: SHARDS, GEN_BS, GEN_KV_GB, GEN_BUDGET (s), SEED, OFFLINE, SYNTH, SYNTH_SHARE, OPENER (share of the
#        synthetic prompts started with a question opener), RUNS, INIT, INTER,
#        TRAIN_S, DFLASH, DFLASH_INIT, DFLASH_BS, DFLASH_LR, CKPT (set: --checkpoint-logits, so that more
#        full-vocabulary EAGLE-3 runs fit the GPU: ~55-73 GiB each without it).
set -uo pipefail
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
R=/tmp/run
[ -f $M ] || { cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3; }
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
RUNS=${RUNS:-a:48:1e-3 b:96:1e-3}

watch() {
  local until=$(( T0 + ${WATCH_S:-560} ))
  while [ ! -f $R/done ] && [ "$(date +%s)" -lt $until ]; do sleep 15; done
  el "job $( [ -f $R/done ] && echo "ended: $(cat $R/done)" || echo running)"
  tail -n 2 $R/stage.log 2>/dev/null
  for f in $R/data*.log; do [ -f "$f" ] && { echo "$(basename $f): $(grep -E "responses:|synthetic prompts:|samples," $f | tail -1 | cut -c1-160)"; }; done
  for f in $R/train_*.log; do [ -f "$f" ] && echo "$(basename $f): $(tail -c 400 $f | tr '\r' '\n' | grep -v '^$' | tail -1 | cut -c1-200)"; done
  for f in $R/accept_*.log; do [ -f "$f" ] && { echo "$(basename $f):"; grep -E "T=|DFLASH|DDTREE" $f | tail -8; }; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
}

collect() {
  [ -n "${OUT:-}" ] || return 0
  for d in /tmp/d_*; do
    [ -f $d/model.safetensors ] && tar -C $d -cf $OUT/$(basename $d).tar config.json model.safetensors train_log.json
  done
  [ -d $R ] && tar -C $R -czf $OUT/logs.tgz --exclude job.sh $(cd $R && ls *.log *.json 2>/dev/null)
  ls -la $OUT; el collected
}

case "${PHASE:-start}" in
start)
  rm -rf $R /tmp/data /tmp/d_* && mkdir -p $R /tmp/data
  INIT=${INIT-tercel/drafts/smollm2-eagle3}  # INIT= (empty): EAGLE-3 from scratch
  DINIT=${DFLASH_INIT-tercel/drafts/smollm2-dflash}
  N=${SHARDS:-4}
  {
    echo "cd $PWD"
    echo "echo data > $R/stage.log"
    for k in $(seq 0 $((N - 1))); do
      echo "OMP_NUM_THREADS=2 python3 benchmarks/draft_data.py --out /tmp/data/p$k --model $M --device cuda \
--num-prompts ${OFFLINE:-16000} --synth-prompts ${SYNTH:-400000} --synth-share ${SYNTH_SHARE:-0.3} --max-new-tokens 256 \
--batch ${GEN_BS:-512} --kv-cache-memory ${GEN_KV_GB:-16} --shard $k/$N --seed ${SEED:-1000000} --opener-share ${OPENER:-0} \
--time-budget ${GEN_BUDGET:-330} > $R/data$k.log 2>&1 &"
    done
    echo "wait"
    echo "python3 benchmarks/draft_data.py --out /tmp/data --merge /tmp/data/p*/data.pt > $R/data_merged.log 2>&1 \
|| { echo 'data failed' > $R/done; exit 1; }"
    echo "echo train >> $R/stage.log"
    for run in $RUNS; do
      IFS=: read -r name bs lr hard aux inter <<< "$run"
      echo "mkdir -p /tmp/d_$name && ln /tmp/data/data.pt /tmp/d_$name/data.pt"
      echo "python3 -m tercel.cli train-draft --algorithm eagle3 --target $M --out /tmp/d_$name --device cuda \
--max-len 640 --draft-vocab-size 0 --intermediate-size ${inter:-${INTER:-1536}} ${aux:+--aux-layer-ids $aux} --batch-size $bs --lr $lr --hard-label-weight ${hard:-0} ${CKPT:+--checkpoint-logits} \
${INIT:+--init-from $INIT} --max-steps 1000000 --time-budget ${TRAIN_S:-700} --save-every 500 > $R/train_$name.log 2>&1 &"
    done
    if [ "${DFLASH:-1}" = 1 ]; then
      echo "mkdir -p /tmp/d_dflash && ln /tmp/data/data.pt /tmp/d_dflash/data.pt"
      echo "python3 -m tercel.cli train-draft --algorithm dflash --target $M --out /tmp/d_dflash --device cuda \
--max-len 640 --batch-size ${DFLASH_BS:-32} --lr ${DFLASH_LR:-6e-4} ${DINIT:+--init-from $DINIT} --max-steps 1000000 \
--time-budget ${TRAIN_S:-700} --save-every 500 > $R/train_dflash.log 2>&1 &"
    fi
    echo "wait"
    echo "echo accept >> $R/stage.log"
    for run in $RUNS; do
      name=${run%%:*}
      echo "[ -f /tmp/d_$name/model.safetensors ] && timeout ${ACCEPT_S:-240} python3 benchmarks/spec_accept.py --model $M \
--draft /tmp/d_$name --device cuda --max-tokens 128 --temps 0 --out $R/accept_$name.json > $R/accept_$name.log 2>&1 &"
    done
    echo "[ -f /tmp/d_dflash/model.safetensors ] && TERCEL_RESULTS_DIR=$R timeout ${ACCEPT_S:-240} python3 \
benchmarks/dflash_accept.py --model $M --draft /tmp/d_dflash --device cuda --name accept_dflash > $R/accept_dflash.log 2>&1 &"
    echo "wait"
    echo "echo finished > $R/done"
  } > $R/job.sh
  setsid nohup bash $R/job.sh > $R/job.out 2>&1 < /dev/null &
  el "job started"
  watch; collect ;;
watch) watch; collect ;;
collect) collect ;;
esac
