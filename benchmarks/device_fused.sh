#!/usr/bin/env bash
# One H200 call (device tool) for the fused batch-1 decode work; each stage named on the command line runs
# in order, logs under $OUT:
#   tests      GPU tests without SmolLM2 (fused decode vs unfused, kernels, graphs, kernel switch), and the
#              fused-decode test again without PDL; compute-sanitizer memcheck beside them  -> tests.log, sanitizer.log
#   variants   benchmarks/decode_variants.py on the Llama-8B shape: the switch sets in $VARIANTS (default: fused,
#              no PDL, early PDL, 4 and 1 KV splits, unfused), N in $VSTEPS, per-kernel profile of the bucket-1 graph
#                                                                                       -> decode_variants_llama8b.json
#   probe      benchmarks/gemv_probe.py                                                 -> gemv_probe.json
#   bench8b    benchmarks/gpu_decode.py on the Llama-8B shape (defaults; multi-step N = $STEPS, default 8)
#                                                                                       -> gpu_decode_llama8b.json
# A carried SmolLM2 part (.carry/smol-N, ../shared/tools/split-smollm2) is copied into /tmp/smol first, for the
# final call (benchmarks/device_gpu.sh) to reassemble. TERCEL_COMMIT names the commit in the result files.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. TERCEL_RESULTS_DIR=$OUT
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
mkdir -p /tmp/smol && for d in .carry/smol-*; do [ -d "$d" ] && cp "$d"/* /tmp/smol/; done; ls /tmp/smol
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
for stage in "$@"; do
  case $stage in
    tests)
      timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu_sanitize_case.py \
        > $OUT/sanitizer.log 2>&1; echo "sanitizer rc=$?" >> $OUT/sanitizer.log &
      timeout 240 python3 -m pytest -q tests/test_gpu_fused_decode.py tests/test_gpu_graphs.py tests/test_kernel_switch.py \
        -k "not smollm2" > $OUT/tests.log 2>&1; echo "pytest rc=$?" >> $OUT/tests.log
      TERCEL_PDL=0 timeout 120 python3 -m pytest -q tests/test_gpu_fused_decode.py >> $OUT/tests.log 2>&1
      echo "pytest (TERCEL_PDL=0) rc=$?" >> $OUT/tests.log
      wait
      el "tests"; grep -E "passed|failed|rc=|Error|error" $OUT/tests.log | tail -8
      grep -E "ERROR SUMMARY|rc=|sanitize case" $OUT/sanitizer.log | tail -4 ;;
    variants)
      timeout ${VARIANTS_S:-330} python3 benchmarks/decode_variants.py --models llama8b --steps ${VSTEPS:-1,32,64} \
        --variants ${VARIANTS:-fused,fused_no_pdl,fused_pdl_early,fused_splits4,fused_splits1,unfused} \
        --out $OUT/decode_variants_llama8b.json > $OUT/variants.log 2>&1
      el "variants rc=$?"; grep -vE "^\s*$" $OUT/variants.log | tail -45 | cut -c1-200 ;;
    probe)
      timeout 90 python3 benchmarks/gemv_probe.py $OUT/gemv_probe.json > $OUT/probe.log 2>&1
      el "probe rc=$?"; tail -12 $OUT/probe.log | cut -c1-200 ;;
    bench8b)
      timeout ${BENCH_S:-240} python3 benchmarks/gpu_decode.py --models llama8b --repeats 3 --tput-tokens 64 \
        --num-scheduler-steps ${STEPS:-8} --out-dir $OUT > $OUT/bench8b.log 2>&1
      el "bench8b rc=$?"; tail -12 $OUT/bench8b.log | cut -c1-220 ;;
  esac
done
ls $OUT
