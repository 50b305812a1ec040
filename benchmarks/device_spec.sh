#!/usr/bin/env bash
# One H200 call (device tool) after the SmolLM2 parts smol-0 and smol-1 were copied into /tmp/smol by
# earlier calls: reassemble the model (this call carries .carry/smol-2 and .carry/whl), install gguf, then
# run what $STEPS names (default: the speculative speed table). Everything worth keeping lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site
T0=$(date +%s)
mkdir -p /tmp/smol && cp .carry/smol-2/* /tmp/smol/ 2>/dev/null
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $M ] || { cat /tmp/smol/smolpart* > $M && echo "a1231443440b107ff29f02bdb38c9d0a  $M" | md5sum -c || exit 3; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl || exit 4
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
export TERCEL_SMOL_GGUF=$M
for step in ${STEPS:-speed}; do
  case $step in
    speed) python3 benchmarks/spec_speed.py --model $M --device cuda --new-tokens ${NEW:-128} \
             --batch-sizes ${BS:-1,16} --sampling-temperatures=${TEMPS:-} ${TCONFIGS:+--sampling-configs $TCONFIGS} --repeats ${REPEATS:-3} --configs ${CONFIGS:-plain,ngram,eagle3-chain-5,eagle3-tree-topk4-8,dflash-16,ddtree-16} \
             --out $OUT/spec_speed_smollm2_h200.json ${TRACE:+--trace $OUT/trace} 2>&1 | grep -v Warn ;;
    probe) TERCEL_SMALL_M=${SMALL_M:-0} python3 benchmarks/verify_probe.py --tokens ${TOKENS:-1,8,16} \
             --out $OUT/verify_probe_h200.json 2>&1 | grep -v Warn | tail -${PROBE_TAIL:-20} ;;
    staging) python3 benchmarks/staging_probe.py --out $OUT/staging_probe_h200.json 2>&1 | tail -3 ;;
    check) python3 benchmarks/chain_check.py --out $OUT/chain_check_h200.json 2>&1 | grep -v Warn | tail -20 ;;
    gputests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x ${TESTS:-tests/test_gpu_spec_graphs.py} 2>&1 \
             | tee $OUT/gpu_tests.log | tail -25 ;;
  esac
  echo "$step done after $(( $(date +%s) - T0 )) s"
done
