#!/usr/bin/env bash
# One H200 call (device tool) for the GPU acceptance runs, each step cut to fit $1 seconds (default 585):
#   1. batch-1 GEMV probe (cuBLAS vs Triton, in CUDA graphs)          -> gemv_probe.json
#   2. decode benchmark, SmolLM2 and the Llama-8B shape, HF peers      -> gpu_decode_*.json, bench.log
#   3. side by side (neither is timed): the GPU tests (tiny models, multi-step, SmolLM2 bf16 every bucket up to
#      $MAX_BUCKET, compute-sanitizer memcheck) and the accept lengths of the bundled drafts
#      -> gpu_tests.log, gpu_tests_smollm2.log, spec_accept_smollm2_h200.json, dflash_accept_smollm2_h200.json
# Expects the SmolLM2 parts in /tmp/smol (../shared/tools/split-smollm2: earlier calls copy parts
# 0..N-2, this one carries the last part and .carry/whl).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
END=$(( T0 + ${1:-585} ))
left() { local l=$(( END - $(date +%s) )); [ $l -lt $1 ] && echo $(( l > 1 ? l : 1 )) || echo $1; }
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:. TERCEL_SMOL_GGUF=$M TERCEL_RESULTS_DIR=$OUT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
# PROBE_S=0 skips the probe; MODELS=smollm2 benchmarks one model (an earlier call did the other)
[ "${PROBE_S:-60}" -gt 0 ] && timeout $(left ${PROBE_S:-60}) python3 benchmarks/gemv_probe.py $OUT/gemv_probe.json \
  > $OUT/bench.log 2>&1
el "gemv probe rc=$?"
timeout $(left ${BENCH_S:-260}) python3 benchmarks/gpu_decode.py --models ${MODELS:-smollm2,llama8b} --smol $M --repeats 3 \
  --tput-tokens 64 --out-dir $OUT >> $OUT/bench.log 2>&1
el "bench rc=$?"; tail -24 $OUT/bench.log | cut -c1-240
( timeout $(left 150) python3 -m pytest -q tests/test_gpu_fused_decode.py tests/test_gpu_graphs.py tests/test_kernel_switch.py \
    -k "not smollm2"
  timeout $(left 120) python3 -m pytest -q tests/test_gpu_multistep.py
  timeout $(left 150) compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu_sanitize_case.py 2>&1 | tail -20
  echo "sanitizer rc=$?" ) > $OUT/gpu_tests.log 2>&1 &
TERCEL_GPU_TEST_MAX_BUCKET=${MAX_BUCKET:-256} timeout $(left 300) python3 -m pytest -q tests/test_gpu_graphs.py -k smollm2 \
  > $OUT/gpu_tests_smollm2.log 2>&1 &
( timeout $(left 200) python3 benchmarks/spec_accept.py --model $M --device cuda --max-tokens 128 \
    --out $OUT/spec_accept_smollm2_h200.json
  timeout $(left 200) python3 benchmarks/dflash_accept.py --model $M --draft tercel/drafts/smollm2-dflash --device cuda \
    --max-tokens 128 --name dflash_accept_smollm2_h200 ) >> $OUT/bench.log 2>&1 &
wait; el "tests and accept done"
grep -E "passed|failed|error|rc=" $OUT/gpu_tests.log $OUT/gpu_tests_smollm2.log | tail -10
grep -E "chain|tree|ngram|DFLASH|DDTREE" $OUT/bench.log | tail -16 | cut -c1-200
ls $OUT
