#!/usr/bin/env bash
# One H200 call (device tool) after a change to sampling or the engine step: the GPU sampling,
# multi-step and graph tests (seeded sampling equal across devices and step kinds), then sampled vs
# greedy decode speed (benchmarks/gpu_sampling.py -> gpu_sampling_smollm2.json). Expects the SmolLM2
# parts in /tmp/smol (../shared/tools/split-smollm2) and the gguf wheel in .carry/whl.
set -uo pipefail
export PYTHONUNBUFFERED=1
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:. TERCEL_SMOL_GGUF=$M TERCEL_RESULTS_DIR=$OUT
timeout ${TEST_S:-200} python3 -m pytest -q tests/test_gpu_sampling.py tests/test_gpu_multistep.py tests/test_gpu_graphs.py \
  -k "not smollm2 or multistep or sampling" 2>&1 | tee $OUT/gpu_sampling_tests.log | tail -5
[ "${BENCH_S:-200}" -gt 0 ] && timeout ${BENCH_S:-200} python3 benchmarks/gpu_sampling.py --smol $M 2>&1 | tee $OUT/gpu_sampling.log | tail -6
