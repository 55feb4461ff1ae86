#!/usr/bin/env bash
# Kernel work on the lent GPU machine in one call: (optionally) the tile tuner, the benchmark
# with the tuned tiles, the per-kernel profile, then the Triton and recompute tests on the GPU.
# Results go to $OUT (default out/device).
#   carry [".whl", ".te"];  TUNE=1 runs benchmarks/tune_tiles.py first (TUNE_ARGS: its options);
#   SIZES="16384x4096 ..." (default 16384x4096); BENCH_ARGS: extra bench_mhc.py arguments.
set -uo pipefail
OUT="${OUT:-out/device}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
tiles=()
if [ "${TUNE:-0}" = 1 ]; then
  python3 benchmarks/tune_tiles.py --out "$OUT/tiles.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_tiles.log"
  [ -f "$OUT/tiles.json" ] && tiles=(--tiles "$OUT/tiles.json")
fi
python3 benchmarks/bench_mhc.py --sizes ${SIZES:-16384x4096} "${tiles[@]}" --out "$OUT/bench.md" \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
rc_bench=${PIPESTATUS[0]}
python3 benchmarks/profile_kernels.py "${tiles[@]}" 2>&1 | tee "$OUT/profile.log"
python3 -m pytest tests/test_triton_kernels.py tests/test_recompute.py -q -p no:cacheprovider \
  2>&1 | tail -15 | tee "$OUT/pytest_kernels_gpu.log"
rc_tests=${PIPESTATUS[0]}
echo "device_kernels: tests rc=$rc_tests bench rc=$rc_bench"
