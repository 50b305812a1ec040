#!/usr/bin/env bash
# One H200 call (device tool): batch-1 GEMV probe, one shared self-distillation dataset, then the
# EAGLE-3 head and the DFlash draft trained side by side on the GPU (time-boxed), then both drafts'
# accept lengths on the held-out prompts (time-boxed). Drafts come back as tars in $OUT, results as
# JSON (spec_accept_smollm2_h200.json, dflash_accept_smollm2_h200.json). Expects the SmolLM2 parts
# in /tmp/smol (../shared/tools/split-smollm2) and the gguf wheel in .carry/whl.
set -uo pipefail
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TERCEL_RESULTS_DIR=$OUT
LOG=$OUT/log_misc.txt
[ "${GEMV_S:-0}" -gt 0 ] && { timeout $GEMV_S python3 benchmarks/gemv_probe.py $OUT/gemv_probe.json >> $LOG 2>&1; el "gemv rc=$?"; }
python3 benchmarks/draft_data.py --out /tmp/data --model $M --device cuda --num-prompts 8000 --max-new-tokens 320 \
  --batch 512 --time-budget ${GEN_BUDGET:-100} >> $LOG 2>&1; el "data rc=$?"; tail -1 $LOG
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
timeout ${ACCEPT_S:-180} python3 benchmarks/spec_accept.py --model $M --draft /tmp/e3 --device cuda --max-tokens 128 \
  --out $OUT/spec_accept_smollm2_h200.json >> $LOG 2>&1 &
timeout ${ACCEPT_S:-180} python3 benchmarks/dflash_accept.py --model $M --draft /tmp/dfl --device cuda --max-tokens 128 \
  --name dflash_accept_smollm2_h200 >> $LOG 2>&1 &
wait; el "accept done"
ls -la $OUT; el done
