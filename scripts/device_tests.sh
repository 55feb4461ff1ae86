#!/usr/bin/env bash
# The GPU tests of the kernels and the layers in one call, in parallel pytest workers
# (pytest-xdist, on the GPU image): most of a serial run is Triton compiling one variant after
# another on one core. carry [".whl"] (+ TE's build: export PYTHONPATH=/tmp/tebuild/site first
# for the TE cases). Logs to $OUT: env.txt, tests.log (the summary and every failure), and
# probes.log when PROBES names probe scripts to run after the tests. TEST_TIMEOUT (s, default
# 420) bounds the whole pytest run; PER_TEST (s, default 240) each test.
#   TESTS: test files (default: kernels, launch, recompute, layer, TE, model, offloading,
#          CUDA graphs, precision); WORKERS (default 12); PROBES, e.g.
#          "benchmarks/probe_l2_order.py --sizes 4096x4096" (one command, run as given)
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
record_env
TESTS="${TESTS:-tests/test_triton_kernels.py tests/test_launch.py tests/test_recompute.py
  tests/test_layer.py tests/test_transformer_engine.py tests/test_model.py
  tests/test_offloading.py tests/test_cuda_graphs.py tests/test_precision_extremes.py}"
# One line per test (which worker ran it, and its outcome), so that a run cut off by
# TEST_TIMEOUT still shows what passed; a test over PER_TEST seconds fails with its stack
# (pytest-timeout) instead of holding the run.
opts=(-v -p no:cacheprovider -rfEs --durations=10)
python3 -c "import xdist" 2>/dev/null && opts+=(-n "${WORKERS:-12}")
python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout "${PER_TEST:-240}")
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest $TESTS "${opts[@]}" > "$OUT/tests.log" 2>&1
rc=$?
echo "tests rc=$rc ($( grep -c " PASSED " "$OUT/tests.log") passed," \
  "$(grep -c " FAILED \| ERROR " "$OUT/tests.log") failed or errors)"
grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -15
if [ -n "${PROBES:-}" ]; then
  # shellcheck disable=SC2086
  python3 $PROBES > "$OUT/probes.log" 2>&1; echo "probes rc=$?"; grep "^|" "$OUT/probes.log"
fi
exit $rc
