#!/usr/bin/env bash
# On the H200: train the SmolLM2 DFlash draft (data + training, time-boxed); the draft lands in $OUT.
# Expects /tmp/smol/smolpart* (see ../shared/tools/split-smollm2) and .carry/whl. Accept lengths are
# measured separately (benchmarks/dflash_accept.py).
set -uo pipefail
T0=$(date +%s)
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
python3 -m tercel.cli train-draft --algorithm dflash --target $M --out /tmp/dfl --device cuda \
  --num-prompts ${PROMPTS:-6000} --max-new-tokens 256 --gen-batch ${GEN_BATCH:-1536} --gen-time-budget ${GEN_BUDGET:-45} \
  --max-len 512 --batch-size 32 --max-steps 100000 --lr 6e-4 --time-budget ${BUDGET:-100} > $OUT/dflash_train.log 2>&1
echo "train rc=$? after $(( $(date +%s) - T0 )) s"; tail -c 600 $OUT/dflash_train.log | tr '\r' '\n' | tail -3
mkdir -p $OUT/smollm2-dflash && cp /tmp/dfl/config.json /tmp/dfl/model.safetensors $OUT/smollm2-dflash/
python3 -c "import torch; print(len(torch.load('/tmp/dfl/data.pt', weights_only=True)['prompts']), 'samples')"
