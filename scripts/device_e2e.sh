#!/usr/bin/env bash
# One GPU, one call per phase: the end-to-end cost of mHC (issue 16). carry [".whl"] (+ TE's
# build, see README: export PYTHONPATH=/tmp/tebuild/site first for the TE rows). Logs to $OUT.
#   PHASE=recompute  tests/test_recompute.py on the GPU (Triton kernels; TE cases with TE)
#   PHASE=bench      benchmarks/bench_e2e.py --profile (dense and MoE; TE and local+SDPA)
#                    BENCH_ARGS: more arguments, e.g. "--configs moe --steps 20"
#                    INTERLEAVE=ROUNDS: --interleave instead of --profile (every run's model
#                    built first, timed in alternating rounds)
#                    OLD=old_pkg: the --profile bench also from that copy of the package (an
#                    A/B in one call: `mkdir old_pkg && git archive REV mhc_megatron | tar -x
#                    -C old_pkg`), logs bench_e2e_new.* and bench_e2e_old.*; OLD_BENCH_ARGS:
#                    the old copy's arguments instead of BENCH_ARGS (e.g. "--runs mhc")
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
record_env
if [ "${PHASE:-bench}" = recompute ]; then
  python3 -m pytest tests/test_recompute.py -q -p no:cacheprovider -rs --durations=5 2>&1 \
    | tail -25 | tee "$OUT/recompute_tests.log"
elif [ -n "${INTERLEAVE:-}" ]; then  # host-bound configs: runs side by side, alternating rounds
  python3 benchmarks/bench_e2e.py --interleave "$INTERLEAVE" --out "$OUT/bench_e2e.md" \
    ${BENCH_ARGS:-} 2>&1 | grep -v "DEPRECATED" | tail -30 | tee "$OUT/bench_e2e.log"
elif [ -n "${OLD:-}" ]; then
  ROOT="$PWD"
  for version in new old; do
    dir="$ROOT" args="${BENCH_ARGS:-}"
    [ "$version" = old ] && dir="$ROOT/$OLD" args="${OLD_BENCH_ARGS:-${BENCH_ARGS:-}}"
    ( cd "$dir" && python3 "$ROOT/benchmarks/bench_e2e.py" --profile \
        --out "$OUT/bench_e2e_$version.md" $args ) 2>&1 \
      | grep -v "DEPRECATED" | tail -40 > "$OUT/bench_e2e_$version.log"
    echo "== $version"; grep "^|" "$OUT/bench_e2e_$version.md" | head -40
  done
else
  python3 benchmarks/bench_e2e.py --profile --out "$OUT/bench_e2e.md" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "DEPRECATED" | tail -60 | tee "$OUT/bench_e2e.log"
fi
