#!/usr/bin/env bash
# The GPU tests and benchmarks on the H200, in two back-to-back device calls (SmolLM2 travels in two
# parts, .carry/smol-0 and .carry/smol-1; the machine keeps /tmp between close calls):
#   call A (carry .carry/smol-0):             bash benchmarks/gpu_run.sh A
#       part 0 to /tmp/smol; tiny-model GPU tests; compute-sanitizer; batch-1 GEMV probe;
#       Llama-8B-shape benchmark
#   call B (carry .carry/smol-1, .carry/whl): bash benchmarks/gpu_run.sh B
#       part 1, reassemble + md5, gguf wheel; SmolLM2 GPU tests; SmolLM2 benchmark with HF peers
#   call C (carry .carry/whl): all of A and B in one call when /tmp/smol already holds the model
#       (a call just before reassembled it); otherwise it falls back to A.
# Logs and result JSON land in $OUT. TERCEL_COMMIT names the commit (the device copy has no .git).
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
SUM=a1231443440b107ff29f02bdb38c9d0a
mkdir -p /tmp/smol
if [ "$1" = C ]; then
  END=$(( T0 + ${2:-590} - 10 ))  # $2: seconds this call may use; every step is cut to fit
  left() { local l=$(( END - $(date +%s) )); [ $l -lt $1 ] && echo $l || echo $1; }
  if [ -f $M ] && echo "$SUM  $M" | md5sum -c; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl || exit 4
    export PYTHONPATH=.:/tmp/site TERCEL_SMOL_GGUF=$M
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    timeout $(left 110) python3 -m pytest -q tests/test_gpu_graphs.py -k "not smollm2" > $OUT/gpu_tests_tiny.log 2>&1
    echo "tiny gpu tests rc=$? after $(( $(date +%s) - T0 )) s"; tail -6 $OUT/gpu_tests_tiny.log | cut -c1-300
    timeout $(left 300) python3 benchmarks/gpu_decode.py --models smollm2,llama8b --smol $M --repeats 2 \
      --tput-tokens 64 --out-dir $OUT > $OUT/bench.log 2>&1
    echo "bench rc=$? after $(( $(date +%s) - T0 )) s"; tail -16 $OUT/bench.log | cut -c1-300
    timeout $(left 100) python3 -m pytest -q tests/test_gpu_graphs.py -k smollm2 > $OUT/gpu_tests_smollm2.log 2>&1
    echo "smollm2 gpu tests rc=$? after $(( $(date +%s) - T0 )) s"; tail -6 $OUT/gpu_tests_smollm2.log | cut -c1-300
    timeout $(left 60) compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu_sanitize_case.py > $OUT/sanitizer.log 2>&1
    echo "sanitizer rc=$? after $(( $(date +%s) - T0 )) s"; tail -4 $OUT/sanitizer.log | cut -c1-300
    exit 0
  fi
  echo "no reassembled model in /tmp/smol: running call A (needs .carry/smol-0)"
  set -- A
fi
if [ "$1" = A ]; then
  cp .carry/smol-0/* /tmp/smol/
  export PYTHONPATH=.
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  timeout 200 python3 -m pytest -x -q tests/test_gpu_graphs.py -k "not smollm2" > $OUT/gpu_tests_tiny.log 2>&1
  echo "tiny gpu tests rc=$? after $(( $(date +%s) - T0 )) s"; tail -15 $OUT/gpu_tests_tiny.log | cut -c1-300
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu_sanitize_case.py > $OUT/sanitizer.log 2>&1
  echo "sanitizer rc=$? after $(( $(date +%s) - T0 )) s"; tail -5 $OUT/sanitizer.log | cut -c1-300
  timeout 70 python3 benchmarks/gemv_probe.py $OUT/gemv_probe.json > $OUT/gemv.log 2>&1
  echo "gemv rc=$? after $(( $(date +%s) - T0 )) s"; cut -c1-200 $OUT/gemv.log
  timeout $(( 580 - $(date +%s) + T0 )) python3 benchmarks/gpu_decode.py --models llama8b --out-dir $OUT > $OUT/bench_llama8b.log 2>&1
  echo "bench rc=$? after $(( $(date +%s) - T0 )) s"; tail -14 $OUT/bench_llama8b.log | cut -c1-300
else
  cp .carry/smol-1/* /tmp/smol/
  cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl || exit 4
  export PYTHONPATH=.:/tmp/site TERCEL_SMOL_GGUF=$M
  timeout 270 python3 -m pytest -q tests/test_gpu_graphs.py -k smollm2 > $OUT/gpu_tests_smollm2.log 2>&1
  echo "smollm2 gpu tests rc=$? after $(( $(date +%s) - T0 )) s"; tail -8 $OUT/gpu_tests_smollm2.log | cut -c1-300
  timeout $(( 580 - $(date +%s) + T0 )) python3 benchmarks/gpu_decode.py --models smollm2 --smol $M --out-dir $OUT > $OUT/bench_smollm2.log 2>&1
  echo "bench rc=$? after $(( $(date +%s) - T0 )) s"; tail -14 $OUT/bench_smollm2.log | cut -c1-300
fi
