#!/usr/bin/env bash
# The last H200 call of a draft-training session (device tool), after benchmarks/device_drafts.sh:
#   1. side by side, not timed: the freshly trained draft's accept lengths on the GPU (bf16; /tmp/e3 from
#      device_drafts.sh) and the multi-step GPU tests             -> spec_accept_smollm2_h200.json, gpu_tests.log
#   2. alone: the Llama-8B-shape decode benchmark, multi-step N = $STEPS (default 32) -> gpu_decode_llama8b.json
# TERCEL_COMMIT names the commit in the result files.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TERCEL_RESULTS_DIR=$OUT TERCEL_SMOL_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/e3/model.safetensors ] && [ -f $M ]; then
  timeout ${ACCEPT_S:-150} python3 benchmarks/spec_accept.py --model $M --draft /tmp/e3 --device cuda --max-tokens 128 \
    --out $OUT/spec_accept_smollm2_h200.json > $OUT/accept.log 2>&1 &
fi
timeout ${TESTS_S:-150} python3 -m pytest -q tests/test_gpu_multistep.py > $OUT/gpu_tests.log 2>&1
wait; el "accept and tests done"; grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -3; tail -3 $OUT/accept.log
timeout ${BENCH_S:-200} python3 benchmarks/gpu_decode.py --models llama8b --repeats 3 --tput-tokens 64 \
  --num-scheduler-steps ${STEPS:-32} --out-dir $OUT > $OUT/bench.log 2>&1
el "bench rc=$?"; tail -12 $OUT/bench.log | cut -c1-240
