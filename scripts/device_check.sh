#!/usr/bin/env bash
# One call on a CUDA host without network (the lent GPU machine): install the carried
# megatron-core wheel, run the test-suite on the GPU, the kernel benchmark (when TE 2.20.2's
# two triton/mhc.py files are carried in .te/, see benchmarks/te_peer.py) and the GPU demo.
# Logs, the benchmark table and the demo's plot go to $OUT (default ./out/device).
#   needs: .whl/megatron_core-0.19.2-*.whl (see README, "GPU"); carry [".whl", ".te"]
#   BENCH_ARGS / DEMO_ARGS: extra arguments, e.g. BENCH_ARGS="--sizes 16384x4096 --no-compile"
set -uo pipefail
OUT="${OUT:-out/device}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
record_env
python3 -m pytest tests -q -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/pytest_gpu.log"
rc_tests=${PIPESTATUS[0]}
rc_bench=0
if [ -d .te ]; then
  python3 benchmarks/bench_mhc.py --out "$OUT/bench.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  rc_bench=${PIPESTATUS[0]}
else
  python3 benchmarks/bench_mhc.py --no-te --out "$OUT/bench.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  rc_bench=${PIPESTATUS[0]}
fi
python3 examples/train_gpt_mhc.py --out "$OUT" ${DEMO_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'it/s' | tee "$OUT/demo_gpu.log"
rc_demo=${PIPESTATUS[0]}
echo "device_check: tests rc=$rc_tests bench rc=$rc_bench demo rc=$rc_demo"
exit $(( rc_tests != 0 || rc_bench != 0 || rc_demo != 0 ))
