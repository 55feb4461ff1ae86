#!/usr/bin/env bash
# One GPU: CUDA graphs with mHC (issue 15). carry [".whl"] (+ TE's build for the TE cases:
# export PYTHONPATH=/tmp/tebuild/site first). Logs to $OUT.
#   PHASE=bench   benchmarks/bench_e2e.py --graphs, a process per config (CONFIGS; BENCH_ARGS: more)
#   PHASE=child   the equivalence child directly, a few cases (quick look, full output)
#   PHASE=tests   tests/test_cuda_graphs.py and tests/test_offloading.py (TESTS: other files,
#                 PYTEST_K: a -k selection)
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
record_env
if [ "${PHASE:-tests}" = bench ]; then
  for cfg in ${CONFIGS:-dense moe}; do  # a table and log per config
    python3 benchmarks/bench_e2e.py --graphs --configs $cfg --out "$OUT/bench_graphs_$cfg.md" \
      ${BENCH_ARGS:-} 2>&1 | grep -v "DEPRECATED" > "$OUT/bench_graphs_$cfg.log"
    grep "^|" "$OUT/bench_graphs_$cfg.log" | tail -6; tail -3 "$OUT/bench_graphs_$cfg.log"
  done
elif [ "${PHASE:-tests}" = child ]; then
  for case in ${CASES:-"1 dense" "0 dense" "1 moe"}; do
    set -- $case
    timeout 300 python3 tests/gpu_child/cuda_graph_equivalence.py --mhc "$1" --kind "$2" \
      > "$OUT/child_$1_$2.log" 2>&1; echo "mhc=$1 $2 rc=$?"
    grep -E "RESULT|Error|error" "$OUT/child_$1_$2.log" | tail -5 | cut -c1-1500
  done
else
  timeout ${TEST_TIMEOUT:-560} python3 -m pytest ${TESTS:-tests/test_cuda_graphs.py tests/test_offloading.py} \
    -q -p no:cacheprovider -rs -s \
    ${PYTEST_K:+-k "$PYTEST_K"} --durations=5 > "$OUT/graph_tests.log" 2>&1
  grep -E "^\[|passed|failed|Error|assert|peak GPU" "$OUT/graph_tests.log" | tail -40 | cut -c1-1500
fi
