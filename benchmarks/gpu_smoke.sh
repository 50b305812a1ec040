#!/usr/bin/env bash
# First device call: does it import and compile, do the GPU tests pass on a tiny model, is a small
# case memcheck-clean, how fast are batch-1 linears, and where does the 8B bs=1 decode stand.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 200 python3 -m pytest -x -q tests/test_gpu_graphs.py -k "not smollm2" > $OUT/smoke_tests.log 2>&1
echo "gpu tests rc=$? after $(( $(date +%s) - T0 )) s"; tail -25 $OUT/smoke_tests.log
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu_sanitize_case.py > $OUT/sanitizer.log 2>&1
echo "sanitizer rc=$? after $(( $(date +%s) - T0 )) s"; tail -6 $OUT/sanitizer.log
timeout 100 python3 benchmarks/gemv_probe.py $OUT/gemv_probe.json > $OUT/gemv.log 2>&1
echo "gemv rc=$? after $(( $(date +%s) - T0 )) s"; cat $OUT/gemv.log | cut -c1-220
timeout 120 python3 benchmarks/gpu_decode.py --models llama8b --new-tokens 64 --repeats 1 --batches 1,32 --out-dir $OUT > $OUT/bench8b.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - T0 )) s"; tail -12 $OUT/bench8b.log
