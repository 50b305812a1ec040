#!/usr/bin/env bash
# The H200 campaign, one device call per step (SmolLM2 travels in parts: ../shared/tools/split-smollm2):
#   STEP=part N=0|1     copy part N into /tmp/smol (carry .carry/smol-N)
#   STEP=tests N=2      the last part, reassemble, the GPU suite (carry .carry/smol-2 .carry/whl; HALF=spec|adaptive|graphs,
#                       or halves that fit a call: spec-bf16, spec-fp32, graphs-a, graphs-b)
#   STEP=bench          benchmarks/spec_rounds.py: every configuration in interleaved rounds (EXTRA: more flags)
#   STEP=bench SHAPE=llama8b SKIP=1 NAME=llama8b   the 8B shape alone (random weights, random EAGLE-3 head)
#   STEP=profile        benchmarks/step_profile.py: kernels and device µs per step and per phase, every algorithm
#   STEP=gaps           benchmarks/batch_gaps.py: GPU busy / idle per step of plain and adaptive engines at CONC requests
#   STEP=offline        `tercel bench offline`: plain and every algorithm (adaptive), interleaved rounds, HF peers at bs 1
#   STEP=memcheck       compute-sanitizer memcheck over benchmarks/spec_memcheck.py (all five algorithms; RUNS=DDTREE,..
#                       some of them)
#   STEP=probe          benchmarks/verify_probe.py: the small-M tuner's choice per role and row bucket (row-loop,
#                       tl.dot and broadcast kernels against cuBLAS + the unfused ops) and verify steps fused / unfused
#   STEP=serve          `tercel serve` (EAGLE-3, adaptive by default, then plain) under `tercel bench serve` at RATES
#                       (carry .carry/whl .carry/whlserve: fastapi, uvicorn, pydantic, xgrammar are not installed there)
# Logs and results land in $OUT as they are written, so a cut call still returns them.
# TERCEL_COMMIT names the results: set it to this checkout's HEAD as seen here (`git rev-parse --short HEAD`), not
# there: the device copy's git HEAD can be stale (a call at e8616cc read c218985 there).
set -uo pipefail
export PYTHONUNBUFFERED=1
# the card in the result names: h200, or h100 where a call was served by an H100
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o "H[0-9]\{3\}" | tr H h)
GPU=${GPU:-h200}
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/smol
if [ -n "${N:-}" ]; then cp .carry/smol-$N/* /tmp/smol/; fi
[ "${STEP}" = part ] && { nvidia-smi --query-gpu=name,memory.used --format=csv; exit 0; }
[ -n "${TERCEL_COMMIT:-}" ] || { echo "set TERCEL_COMMIT=<the commit this tree holds> (see the header)"; exit 2; }
if [ "${STEP}" = memcheck ]; then  # no model needed: random weights (carry .carry/whl for transformers' gguf)
  PYTHONPATH=. timeout ${TEST_S:-500} compute-sanitizer --tool memcheck --error-exitcode 9 python3 \
    benchmarks/spec_memcheck.py ${RUNS:+--runs $RUNS} 2>&1 | tee $OUT/spec_memcheck_${TERCEL_COMMIT}.log | grep -v "^Writing" \
    | tail -20
  exit 0
fi
if [ ! -f $M ]; then
  cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
fi
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl || exit 4
if [ -d .carry/whlserve ] && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whlserve/*.whl || exit 4
fi
export PYTHONPATH=.:/tmp/site TERCEL_SMOL_GGUF=$M TERCEL_RESULTS_DIR=$OUT
case "$STEP" in
tests)
  # the GPU suite in three parts (all of it runs past one call's limit; HALF=spec, adaptive, graphs); serially:
  # under pytest-xdist the adaptive tests' step costs and the lifecycle test's memory share the GPU and fail.
  # the interpreter tests of small_m and fold_norms are CI's (the CPU): under the interpreter on that host they take
  # minutes or fail
  SPEC_TESTS="tests/test_gpu_spec_graphs.py"
  ADAPTIVE_TESTS="tests/test_gpu_adaptive.py tests/test_lifecycle.py"
  GRAPH_TESTS="tests/test_gpu_graphs.py tests/test_gpu_multistep.py tests/test_gpu_fused_decode.py tests/test_kernel_switch.py
    tests/test_gpu_sampling.py tests/test_small_m_gemv.py tests/test_fold_norms.py
    --deselect tests/test_small_m_gemv.py::test_small_m_kernels_and_model_equal_unfused_in_interpreter
    --deselect tests/test_fold_norms.py::test_folded_norms_give_the_unfolded_forwards_in_interpreter"
  # spec and graphs each ran past a call's limit on an H100 (49 tests in ~520 s; 107 in ~540 s): halves that fit,
  # spec-bf16 + spec-fp32 = spec (by test function) and graphs-a + graphs-b = graphs (by file)
  S=tests/test_gpu_spec_graphs.py
  SPEC_BF16="$S::test_graph_mode_equals_eager_mode_bf16 $S::test_switched_kernels_graph_equals_eager_bf16
    $S::test_every_block_size_and_budget_runs $S::test_batch_shrinks_with_cancellations"
  SPEC_FP32="$S::test_fp32_speculative_equals_plain $S::test_switched_kernels_fp32_speculative_equals_plain
    $S::test_fp32_sampled_eagle_chains_run_chained_and_give_the_plain_tokens"
  case "${HALF:-all}" in
    spec) GPU_TESTS=$SPEC_TESTS ;; adaptive) GPU_TESTS=$ADAPTIVE_TESTS ;; graphs) GPU_TESTS=$GRAPH_TESTS ;;
    spec-bf16) GPU_TESTS=$SPEC_BF16 ;; spec-fp32) GPU_TESTS=$SPEC_FP32 ;;
    graphs-a) GPU_TESTS="tests/test_gpu_graphs.py tests/test_gpu_multistep.py" ;;
    graphs-b) GPU_TESTS="${GRAPH_TESTS#*tests/test_gpu_multistep.py}" ;;
    *) GPU_TESTS="$SPEC_TESTS $ADAPTIVE_TESTS $GRAPH_TESTS" ;;
  esac
  timeout ${TEST_S:-560} python3 -m pytest ${PYTEST_FLAGS:--q -rfE} -p no:cacheprovider --timeout 300 ${TESTS:-$GPU_TESTS} 2>&1 \
    | tee $OUT/gpu_tests_${TERCEL_COMMIT}.log | grep -v "^tests/.*SKIPPED" | tail -${TAIL:-40} ;;
bench)
  timeout ${BENCH_S:-570} python3 benchmarks/spec_rounds.py --model $M --rounds ${ROUNDS:-5} ${SHAPE:+--shape $SHAPE} ${SKIP:+--skip-smollm2} \
    ${CONFIGS:+--configs $CONFIGS} --concurrency ${CONC:-1,16,64} ${EXTRA:-} \
    --out $OUT/spec_rounds_${NAME:-smollm2}_${GPU}_${TERCEL_COMMIT}.json 2>&1 | tee $OUT/spec_rounds_${NAME:-smollm2}.log \
    | tail -60 ;;
profile)
  timeout ${BENCH_S:-400} python3 benchmarks/step_profile.py --model $M --tokens ${TOKENS:-128} ${CONFIGS:+--configs $CONFIGS} \
    --out $OUT/step_profile_smollm2_${GPU}_${TERCEL_COMMIT}.json 2>&1 | grep -v "^USDT\|profiler_st" | tee $OUT/step_profile.log | tail -30 ;;
probe)
  timeout ${BENCH_S:-300} python3 benchmarks/verify_probe.py --shapes ${SHAPES:-smol} --tokens ${TOKENS:-1,2,8,16} \
    --out $OUT/verify_probe_${GPU}_${TERCEL_COMMIT}.json 2>&1 | tee $OUT/verify_probe.log | tail -30 ;;
gaps)
  timeout ${BENCH_S:-400} python3 benchmarks/batch_gaps.py --model $M --concurrency ${CONC:-64} --tokens ${TOKENS:-128} \
    ${CONFIGS:+--configs $CONFIGS} ${EXTRA:-} --out $OUT/batch_gaps_smollm2_${GPU}_${TERCEL_COMMIT}.json 2>&1 | tee $OUT/batch_gaps.log \
    | tail -30 ;;
offline)
  timeout ${BENCH_S:-480} python3 -m tercel bench offline --model $M --rounds ${ROUNDS:-5} --concurrency ${CONC:-1,4,16,64,256} \
    --output-len ${LEN:-128} --eagle-draft tercel/drafts/smollm2-eagle3 --dflash-draft tercel/drafts/smollm2-dflash \
    ${ALGOS:+--algorithms $ALGOS} ${EXTRA:-} --output-dir $OUT --name bench_offline_smollm2_${GPU}_${TERCEL_COMMIT} 2>&1 | tr '\r' '\n' | grep -v "bench offline:" \
    | tee $OUT/bench_offline.log | tail -40 ;;
serve)
  for label in ${LABELS:-eagle3 plain}; do
    # this GGUF is not the installed default model, so AUTO would find no bundled draft: name it
    flags="--speculative-algorithm EAGLE3 --speculative-draft-model-path tercel/drafts/smollm2-eagle3"
    [ "$label" = plain ] && flags="--speculative-algorithm NONE"
    python3 -m tercel serve --model $M --port 30000 $flags > $OUT/serve_${label}.log 2>&1 &
    srv=$!
    for _ in $(seq 240); do  # ready, or the server died (its log says why)
      kill -0 $srv 2>/dev/null || { echo "tercel serve ($label) exited:"; tail -5 $OUT/serve_${label}.log; exit 5; }
      python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health', timeout=1)" 2>/dev/null && break
      sleep 1
    done
    timeout ${SERVE_S:-240} python3 -m tercel bench serve --ready-timeout 5 --request-rate ${RATES:-4,16,inf} \
      --num-prompts ${PROMPTS:-128} --max-tokens 256 --label ${label} --output-dir $OUT \
      --name bench_serve_smollm2_${GPU}_${label}_${TERCEL_COMMIT} 2>&1 | tail -30
    kill $srv; wait $srv 2>/dev/null
  done ;;
esac
