#!/usr/bin/env bash
# One H200 call (device tool): reassemble SmolLM2 (parts carried in .carry/smol-*), install the
# carried gguf wheel, train the EAGLE-3 head (time-boxed), then measure accept lengths and speeds.
# Everything worth keeping lands in $OUT. Expects .carry/smol-0's part already in /tmp/smol.
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/smol && cp .carry/smol-1/* /tmp/smol/
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -m tercel.cli train-draft --target $M --out /tmp/draft --device cuda --num-prompts ${NUM_PROMPTS:-16000} \
  --gen-batch ${GEN_BATCH:-1536} --gen-time-budget ${GEN_BUDGET:-140} --max-new-tokens 320 --max-len 640 \
  --draft-vocab-size 4096 --intermediate-size 640 --batch-size ${BATCH:-48} --lr ${LR:-1e-3} --max-steps 100000 \
  --time-budget ${TRAIN_BUDGET:-240} --save-every 250 > $OUT/train.log 2>&1
echo "train rc=$? after $(( $(date +%s) - T0 )) s"; tail -c 1500 $OUT/train.log | tr '\r' '\n' | tail -4
cp /tmp/draft/config.json /tmp/draft/model.safetensors /tmp/draft/train_log.json $OUT/ 2>/dev/null
python3 benchmarks/spec_accept.py --model $M --draft /tmp/draft --device cuda --max-tokens 128 \
  --out $OUT/spec_accept_smollm2_h200.json 2>&1 | grep -v Warn
echo "accept done after $(( $(date +%s) - T0 )) s"
python3 benchmarks/spec_speed.py --model $M --draft /tmp/draft --device cuda --out $OUT/spec_speed_smollm2_h200.json 2>&1 | grep -v Warn
echo "all done after $(( $(date +%s) - T0 )) s"
