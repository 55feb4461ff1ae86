#!/usr/bin/env bash
# A/B of the mHC kernels on one GPU, in one call: benchmarks/bench_mhc.py (ours only, per op
# and per sublayer) for the working tree ("new") and for an older copy of the package ("old",
# e.g. `mkdir old_pkg && git archive REV mhc_megatron | tar -x -C old_pkg`), alternating
# new, old, new, old so that drift hits both; then the kernel tests of the working tree.
#   OLD=old_pkg (the directory holding the old mhc_megatron/); SIZES (default 4096x4096
#   16384x4096); TESTS=0 skips the tests; PROFILE=1 adds, per version and round, the CUDA
#   time of each kernel (benchmarks/profile_kernels.py, the sum excludes idle gaps, so it
#   resolves smaller changes than the op timings). carry [".whl"]. Logs to $OUT.
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
record_env
ROOT="$PWD"
for round in 1 2; do
  for version in new old; do
    dir="$ROOT"; [ "$version" = old ] && dir="$ROOT/${OLD:-old_pkg}"
    ( cd "$dir" && python3 "$ROOT/benchmarks/bench_mhc.py" --no-compile --no-te \
        --sizes ${SIZES:-4096x4096 16384x4096} --out "/tmp/ab_${version}_${round}.md" \
        > "$OUT/bench_${version}_${round}.log" 2>&1 )
    cat "/tmp/ab_${version}_${round}.md" >> "$OUT/bench_${version}_${round}.log"
    echo "== $version, round $round"; grep "^|" "/tmp/ab_${version}_${round}.md" | tail -12
    if [ "${PROFILE:-0}" = 1 ]; then
      for size in ${SIZES:-4096x4096 16384x4096}; do
        ( cd "$dir" && python3 "$ROOT/benchmarks/profile_kernels.py" --no-te --size "$size" ) \
          >> "$OUT/bench_${version}_${round}.log" 2>&1
      done
      grep -E "^ours|^  " "$OUT/bench_${version}_${round}.log" | grep -v "^  *0\.00[0-4]"
    fi
  done
done
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest tests/test_triton_kernels.py tests/test_launch.py tests/test_recompute.py \
    tests/test_layer.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "kernel tests rc=$?"; tail -3 "$OUT/tests.log"
fi
