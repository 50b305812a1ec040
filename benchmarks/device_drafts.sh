#!/usr/bin/env bash
# H200 draft training (device tool), in two back-to-back calls (the machine keeps /tmp ~30 s):
#   PHASE=data : the shared self-distillation dataset (benchmarks/draft_data.py: offline prompts plus
#                prompts the target writes itself, all answered by the target) -> /tmp/data/data.pt,
#                a gzip copy in $OUT as a backup.
#   PHASE=train: the EAGLE-3 head and the DFlash draft trained side by side on it (time-boxed);
#                drafts come back as tars in $OUT. Accept lengths are then measured on CPU here
#                (benchmarks/spec_accept.py, benchmarks/dflash_accept.py), or on the GPU with ACCEPT_S>0.
# Expects the SmolLM2 parts in /tmp/smol (../shared/tools/split-smollm2) and the gguf wheel in .carry/whl.
set -uo pipefail
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $M ] || { cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3; }
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TERCEL_RESULTS_DIR=$OUT
LOG=$OUT/log_${PHASE:-data}.txt
if [ "${PHASE:-data}" = data ]; then
  python3 benchmarks/draft_data.py --out /tmp/data --model $M --device cuda --num-prompts ${OFFLINE:-8000} \
    --synth-prompts ${SYNTH:-24000} --max-new-tokens 256 --batch ${GEN_BS:-1024} --time-budget ${GEN_BUDGET:-500} \
    >> $LOG 2>&1; el "data rc=$?"; tail -3 $LOG
  gzip -c /tmp/data/data.pt > /tmp/data.pt.gz && split -b 15M -d /tmp/data.pt.gz $OUT/data.pt.gz.part
  ls -la $OUT; el done; exit 0
fi
[ -f /tmp/data/data.pt ] || { echo "no /tmp/data/data.pt: run PHASE=data first (within 30 s)"; exit 5; }
mkdir -p /tmp/e3 /tmp/dfl && cp /tmp/data/data.pt /tmp/e3/ && cp /tmp/data/data.pt /tmp/dfl/
python3 -m tercel.cli train-draft --algorithm eagle3 --target $M --out /tmp/e3 --device cuda --max-len 640 \
  --draft-vocab-size 4096 --intermediate-size 640 --batch-size 48 --lr 1e-3 --max-steps 100000 \
  --time-budget ${TRAIN_S:-300} --save-every 500 > $OUT/log_train_eagle3.txt 2>&1 &
python3 -m tercel.cli train-draft --algorithm dflash --target $M --out /tmp/dfl --device cuda --max-len 640 \
  --batch-size 32 --lr 6e-4 --max-steps 100000 --time-budget ${TRAIN_S:-300} --save-every 500 \
  > $OUT/log_train_dflash.txt 2>&1 &
wait; el "training done"
tail -c 400 $OUT/log_train_eagle3.txt | tr '\r' '\n' | tail -2; tail -c 400 $OUT/log_train_dflash.txt | tr '\r' '\n' | tail -2
tar -C /tmp/e3 -cf $OUT/eagle3.tar config.json model.safetensors train_log.json
tar -C /tmp/dfl -cf $OUT/dflash.tar config.json model.safetensors train_log.json
if [ "${ACCEPT_S:-0}" -gt 0 ]; then
  timeout $ACCEPT_S python3 benchmarks/spec_accept.py --model $M --draft /tmp/e3 --device cuda --max-tokens 128 \
    --out $OUT/spec_accept_smollm2_h200.json >> $LOG 2>&1 &
  timeout $ACCEPT_S python3 benchmarks/dflash_accept.py --model $M --draft /tmp/dfl --device cuda --max-tokens 128 \
    --name dflash_accept_smollm2_h200 >> $LOG 2>&1 &
  wait; el "accept done"
fi
ls -la $OUT; el done
