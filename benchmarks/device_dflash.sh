#!/usr/bin/env bash
# On the H200: train the SmolLM2 DFlash draft (data + training) and measure its accept lengths.
# Expects /tmp/smol/smolpart* (see ../shared/tools/split-smollm2) and .carry/whl.
set -euo pipefail
cat /tmp/smol/smolpart* > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:.:benchmarks PYTHONUNBUFFERED=1 TERCEL_DISABLE_TRITON=1
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -m tercel.cli train-draft --algorithm dflash --target $M --out /tmp/dfl --device cuda \
  --num-prompts ${PROMPTS:-2048} --max-new-tokens 256 --gen-batch 512 --max-len 512 --batch-size 32 \
  --max-steps ${STEPS:-4000} --lr 6e-4 --time-budget ${BUDGET:-270} 2>&1 | tr '\r' '\n' | grep -v "^\s*$" | awk 'NR%25==1'
mkdir -p $OUT/smollm2-dflash && cp /tmp/dfl/config.json /tmp/dfl/model.safetensors $OUT/smollm2-dflash/
python3 benchmarks/dflash_accept.py --model $M --draft /tmp/dfl --device cuda 2>&1 | grep -v Warning
cp benchmarks/results/dflash_accept_smollm2.json $OUT/
