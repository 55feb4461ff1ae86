#!/usr/bin/env bash
# mHC's GPU checks and benchmarks on a CUDA host, phase by phase (see usage below and
# benchmarks/README.md). Run from anywhere; it works in the repository root.
set -uo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/gpu.sh PHASE [PHASE ...]

Runs the phases in the order given on this CUDA host. Each phase writes $OUT/<phase>.log
(tables beside it as $OUT/<phase>*.md) and prints one summary line; the exit status is
non-zero if any phase (or the optional TE build) failed.

phases (variables that shape them on the right)
  env        GPUs, driver, torch, triton, megatron-core, Transformer Engine;
             measured device-to-device copy bandwidth
  tests      the pytest suite on the GPU           TESTS (default: tests), WORKERS (pytest-xdist
                                                   workers), PER_TEST (s, pytest-timeout),
                                                   PYTEST_ARGS
  kernels    benchmarks/bench_mhc.py (ours, the PyTorch reference, torch.compile, and
             TransformerEngine's Triton mHC when its files are found), then
             benchmarks/profile_kernels.py         SIZES ("16384x4096 ..."; default: the six
                                                   sizes of bench_mhc.py), KERNEL_ARGS,
                                                   PROFILE_SIZE (16384x4096), TUNE=1 (run
                                                   tune_tiles.py first and use its tiles),
                                                   TUNE_ARGS
  e2e        benchmarks/bench_e2e.py: mHC's cost in a whole training step
                                                   E2E_ARGS, INTERLEAVE=ROUNDS, PROFILE=1
  graphs     bench_e2e.py --graphs, one process per config; CUDA-graph and
             offloading tests                      CONFIGS ("dense moe"), GRAPH_ARGS
  host       benchmarks/bench_host.py: host (CPU) time of the ops and per sublayer
                                                   HOST_ARGS
  recompute  benchmarks/bench_recompute.py: mhc_recompute's activation memory and step time
                                                   RECOMPUTE_ARGS (e.g. "--spec te")
  multigpu   (2+ GPUs) tests/test_distributed.py, tests/test_ddp_param_gather.py and
             tests/test_hybrid_distributed.py over NCCL, benchmarks/bench_pp_p2p.py,
             benchmarks/bench_ep_overlap.py
                                                   K (a pytest -k filter), PER_TEST,
                                                   EP_OVERLAP_ARGS
  example    the GPU cases of tests/test_pretrain_example.py and tests/test_pretrain_hybrid.py
             (Megatron's pretrain loop, GPT and HybridModel)
                                                   K, RECORD_GOLDEN=1 (record the GPU golden
                                                   losses into $OUT/golden first)
  pretrain   (2+ GPUs) examples/pretrain_gpt_mhc.py on the Python stdlib corpus: per
             layout a baseline run, an mHC n=4 run that saves a checkpoint at STEPS/2,
             and a second mHC process that resumes from that checkpoint (the resume
             check); then the bad-flag check and benchmarks/pretrain_report.py over
             every layout in $OUT/pretrain
                                                   LAYOUT ("tp2sp dp2 pp2"; with 4 GPUs also
                                                   tp2pp2, pp2dp2), STEPS (300), NGPU,
                                                   LOG_INTERVAL (1: every step's loss),
                                                   BAD_FLAG (1; 0: skip the bad-flag check)
  demo       examples/train_gpt_mhc.py, its GPU preset   DEMO_ARGS
  study      examples/mhc_study.py, the quality study (resumes from $OUT/study)
                                                   SEEDS (3), BUDGET (s, 0: none), STUDY_ARGS

environment
  OUT=dir        logs and tables (default: out/gpu)
  PYTHON=cmd     the interpreter (default: python3)
  WHEELS=dir     install every dir/*.whl first with `pip install --no-index --no-deps
                 --target $SITE` (a host without network: e.g. the megatron-core wheel);
                 SITE defaults to $OUT/site and goes on PYTHONPATH
  TE_BUILD=cmd   a command run first that builds or installs Transformer Engine (log:
                 $OUT/te_build.log); if it installs outside site-packages, put that
                 location on PYTHONPATH before calling this script
  TE_ROOT=dir    where TransformerEngine's transformer_engine/{common,pytorch}/triton/mhc.py
                 are for the kernel tables' TE rows (default: .te if present, else the
                 installed transformer_engine; see benchmarks/te_peer.py)

examples
  bash scripts/gpu.sh env tests kernels
  WHEELS=~/wheels bash scripts/gpu.sh env e2e
  INTERLEAVE=5 E2E_ARGS="--configs dense --specs te" bash scripts/gpu.sh e2e
  LAYOUT="tp2sp dp2 pp2" bash scripts/gpu.sh multigpu pretrain
EOF
}

PHASES=(env tests kernels e2e graphs host recompute multigpu example pretrain demo study)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
if [ $# -eq 0 ]; then usage >&2; exit 2; fi
case "$1" in -h|--help|help) usage; exit 0 ;; esac
for phase in "$@"; do
  if [[ " ${PHASES[*]} " != *" $phase "* ]]; then
    echo "gpu.sh: unknown phase '$phase' (phases: ${PHASES[*]})" >&2; exit 2
  fi
done

OUT="${OUT:-out/gpu}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || exit 1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1

# ------------------------------------------------------------------------------ helpers
has() { "$PY" -c "import $1" 2>/dev/null; }
ngpu() { "$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0; }
have_te() { "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; }
# The last pytest summary line of a log ("12 passed, 1 skipped in 30.1s").
pytest_line() {
  grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$1" | tail -1 | tr -d '='
}
# "config spec run: step ms (vs baseline)" for every row of a bench_e2e.py table.
e2e_line() {
  awk -F'|' '/^\| [a-z_]+ \| (te|local) \|/ {
      for (i = 2; i <= 8; i++) gsub(/^ +| +$/, "", $i)
      printf "%s%s/%s %s %s ms (%s)", sep, $2, $3, $4, $5, $8; sep = "; " }' "$@"
}
# Where TransformerEngine's two triton/mhc.py files are (for bench_mhc.py --te-root).
te_root() {
  local root="${TE_ROOT:-}"
  if [ -z "$root" ]; then
    if [ -f .te/transformer_engine/pytorch/triton/mhc.py ]; then
      root=.te
    else
      root="$("$PY" -c 'import importlib.util as u, os
spec = u.find_spec("transformer_engine")
print(os.path.dirname(list(spec.submodule_search_locations)[0]))' 2>/dev/null)" || return 1
    fi
  fi
  [ -f "$root/transformer_engine/pytorch/triton/mhc.py" ] \
    && [ -f "$root/transformer_engine/common/triton/mhc.py" ] && echo "$root"
}
torchrun() { "$PY" -m torch.distributed.run "$@"; }

# ------------------------------------------------------------------------------- phases
# Each runs in a subshell with its output in $OUT/<phase>.log; its last "SUMMARY: " line is
# the phase's summary; its exit status decides ok / FAILED.

phase_env() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" - <<'PY'
import sys

import torch
import triton

import megatron.core as mcore

try:
    import transformer_engine as te
    te_version = te.__version__
except Exception:  # noqa: BLE001 - absent or broken: reported, not fatal
    te_version = "not importable"
sys.path.insert(0, "benchmarks")
from bench_mhc import copy_bandwidth  # noqa: E402

gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
versions = (f"torch {torch.__version__}, triton {triton.__version__}, megatron-core "
            f"{mcore.__version__}, Transformer Engine {te_version}")
bw = copy_bandwidth()
print(f"{gpus}\n{versions}\ncopy bandwidth {bw:.0f} GB/s (device to device, read + write)")
print(f"SUMMARY: {gpus}; {versions}; copy {bw:.0f} GB/s")
PY
  } 2>&1 | tee "$OUT/env.txt"
  return "${PIPESTATUS[0]}"
}

phase_tests() {
  local opts=(-v -p no:cacheprovider -rfEs --durations=15) rc
  [ -n "${WORKERS:-}" ] && has xdist && opts+=(-n "$WORKERS")
  [ -n "${PER_TEST:-}" ] && has pytest_timeout && opts+=(--timeout "$PER_TEST")
  # shellcheck disable=SC2086  # TESTS and PYTEST_ARGS are word lists
  "$PY" -m pytest ${TESTS:-tests} "${opts[@]}" ${PYTEST_ARGS:-}
  rc=$?
  echo "SUMMARY: $(pytest_line "$OUT/tests.log")"
  return $rc
}

phase_kernels() {
  local rc=0 tiles=() te=(--no-te) root
  if root="$(te_root)"; then te=(--te-root "$root"); fi
  if [ "${TUNE:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    "$PY" benchmarks/tune_tiles.py --out "$OUT/kernels_tiles.json" ${TUNE_ARGS:-} || rc=1
    [ -f "$OUT/kernels_tiles.json" ] && tiles=(--tiles "$OUT/kernels_tiles.json")
  fi
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_mhc.py ${SIZES:+--sizes $SIZES} ${tiles[@]+"${tiles[@]}"} "${te[@]}" \
    --out "$OUT/kernels.md" ${KERNEL_ARGS:-} || rc=1
  "$PY" benchmarks/profile_kernels.py --size "${PROFILE_SIZE:-16384x4096}" \
    ${tiles[@]+"${tiles[@]}"} "${te[@]}" || rc=1
  echo "SUMMARY: $([ "${te[0]}" = --no-te ] && echo "no TE rows (TE's mhc.py not found); ")$(
    awk -F'|' '$4 ~ /^ TE / { gsub(/ /, ""); printf "%sx%s TE/ours fwd+bwd %s; ", $2, $3, $8 }' \
    "$OUT/kernels.md" 2>/dev/null)tables in kernels.md, per kernel in kernels.log"
  return $rc
}

phase_e2e() {
  local mode=() rc
  [ -n "${INTERLEAVE:-}" ] && mode+=(--interleave "$INTERLEAVE")
  [ "${PROFILE:-0}" = 1 ] && mode+=(--profile)
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_e2e.py ${mode[@]+"${mode[@]}"} --out "$OUT/e2e.md" ${E2E_ARGS:-}
  rc=$?
  echo "SUMMARY: $(e2e_line "$OUT/e2e.md" 2>/dev/null)"
  return $rc
}

phase_graphs() {
  local rc=0 cfg
  for cfg in ${CONFIGS:-dense moe}; do  # a process tree, table and log per config
    # shellcheck disable=SC2086
    "$PY" benchmarks/bench_e2e.py --graphs --configs "$cfg" --out "$OUT/graphs_$cfg.md" \
      ${GRAPH_ARGS:-} || rc=1
  done
  "$PY" -m pytest tests/test_cuda_graphs.py tests/test_offloading.py -v -s -p no:cacheprovider \
    -rfEs --durations=10 || rc=1
  echo "SUMMARY: $(for cfg in ${CONFIGS:-dense moe}; do e2e_line "$OUT/graphs_$cfg.md" \
    2>/dev/null; echo -n "; "; done)tests: $(pytest_line "$OUT/graphs.log")"
  return $rc
}

phase_host() {
  local rc
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_host.py --out "$OUT/host.md" ${HOST_ARGS:-}
  rc=$?
  echo "SUMMARY: $(awk -F'|' '/^\| (dense|moe) \|/ { gsub(/^ +| +$/, "", $2); gsub(/ /, "", $6)
    printf "%s +%s us a sublayer; ", $2, $6 }' "$OUT/host.md" 2>/dev/null)table in host.md"
  return $rc
}

phase_recompute() {
  local rc
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_recompute.py --out "$OUT/recompute.md" ${RECOMPUTE_ARGS:-}
  rc=$?
  echo "SUMMARY: table in recompute.md"
  return $rc
}

phase_multigpu() {
  local n rc=0 opts
  n="$(ngpu)"
  if [ "$n" -lt 2 ]; then echo "SUMMARY: needs 2 or more GPUs, found $n"; return 1; fi
  # the CUDA cases only (cuda-local, cuda-te where TE is installed; 3-D layouts with 4 GPUs);
  # every rank prints its comparisons before any assertion
  opts=(-v -s -p no:cacheprovider -rfE -k "not cpu${K:+ and ($K)}")
  [ -n "${PER_TEST:-}" ] && has pytest_timeout && opts+=(--timeout "$PER_TEST")
  "$PY" -m pytest tests/test_distributed.py tests/test_ddp_param_gather.py \
    tests/test_hybrid_distributed.py "${opts[@]}" || rc=1
  local tests; tests="$(pytest_line "$OUT/multigpu.log")"
  torchrun --standalone --nproc-per-node=2 benchmarks/bench_pp_p2p.py \
    --out "$OUT/multigpu_p2p.md" || rc=1
  # shellcheck disable=SC2086
  torchrun --standalone --nproc-per-node=2 benchmarks/bench_ep_overlap.py \
    --spec "$(have_te && echo te || echo local)" ${EP_OVERLAP_ARGS:-} \
    --out "$OUT/multigpu_ep_overlap.md" || rc=1
  echo "SUMMARY: $n GPUs; tests: $tests; stage-boundary table in multigpu_p2p.md, EP-overlap" \
    "table in multigpu_ep_overlap.md"
  return $rc
}

phase_example() {
  local rc=0
  if [ "${RECORD_GOLDEN:-0}" = 1 ]; then  # copy into tests/golden/ after an intended change
    MHC_GOLDEN_DIR="$OUT/golden" MHC_UPDATE_GOLDEN=1 "$PY" -m pytest \
      tests/test_pretrain_example.py -q -p no:cacheprovider -k golden_losses_gpu || rc=1
    export MHC_GOLDEN_DIR="$OUT/golden"
  fi
  "$PY" -m pytest tests/test_pretrain_example.py tests/test_pretrain_hybrid.py -v \
    -p no:cacheprovider -rfEs \
    -k "(cuda or gpu)${K:+ and ($K)}" --durations=20 || rc=1
  echo "SUMMARY: $(pytest_line "$OUT/example.log")"
  return $rc
}

# The ~100M-parameter GPT of the pretrain phase: 14 x 768, SwiGLU, RoPE, RMSNorm, seq 1024,
# global batch 16, cosine LR, bf16; TE's modules (and TE's fused Adam) where TE is installed,
# Megatron's local modules otherwise.
pretrain_flags() {
  local flags="--num-layers 14 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
    --max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm
    --swiglu --disable-bias-linear --micro-batch-size 8 --global-batch-size 16
    --train-iters $STEPS --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 30
    --clip-grad 1.0 --weight-decay 0.1 --bf16 --data-path $DATA --split 98,1,1
    --tokenizer-type NullTokenizer --vocab-size 257 --log-interval ${LOG_INTERVAL:-1}
    --eval-interval 50 --eval-iters 10 --log-throughput --seed 1234
    --no-gradient-accumulation-fusion"
  have_te || flags="$flags --transformer-impl local --no-persist-layer-norm --no-rope-fusion
    --no-masked-softmax-fusion"
  echo $flags  # one line
}

phase_pretrain() {
  local n rc=0 dir="$OUT/pretrain" layout par base ck mhc half
  n="${NGPU:-$(ngpu)}"
  if [ "$n" -lt 2 ]; then echo "SUMMARY: needs 2 or more GPUs, found $n"; return 1; fi
  STEPS="${STEPS:-300}" DATA="$dir/data/stdlib"
  half=$((STEPS / 2))
  mkdir -p "$dir"
  [ -f "$DATA.bin" ] || "$PY" examples/prepare_stdlib_corpus.py "$DATA" --max-mb 8 || return 1
  base="$(pretrain_flags)"
  mhc="--enable-hyper-connections --num-residual-streams 4"
  # shellcheck disable=SC2086  # base is a flag list
  run() { torchrun --standalone --nproc-per-node="$n" examples/pretrain_gpt_mhc.py $base "$@"; }
  for layout in ${LAYOUT:-tp2sp dp2 pp2}; do
    case $layout in
      tp2sp) par="--tensor-model-parallel-size 2 --sequence-parallel" ;;
      dp2) par="--use-distributed-optimizer" ;;
      pp2) par="--pipeline-model-parallel-size 2" ;;
      tp2pp2) par="--tensor-model-parallel-size 2 --sequence-parallel
                   --pipeline-model-parallel-size 2" ;;
      pp2dp2) par="--pipeline-model-parallel-size 2 --use-distributed-optimizer" ;;
      *) echo "unknown layout $layout"; rc=1; continue ;;
    esac
    ck="$dir/ckpt_$layout"; rm -rf "$ck"
    # shellcheck disable=SC2086
    run $par > "$dir/${layout}_baseline.log" 2>&1 || rc=1
    # the mHC run, uninterrupted; it saves a checkpoint half-way
    # shellcheck disable=SC2086
    run $par $mhc --save "$ck" --save-interval "$half" > "$dir/${layout}_mhc.log" 2>&1 || rc=1
    # a new process resumes from the half-way checkpoint (model, optimizer, scheduler, RNG,
    # data position) and trains to the end: its losses must continue the uninterrupted run's
    # shellcheck disable=SC2086
    run $par $mhc --load "$ck" --ckpt-step "$half" > "$dir/${layout}_mhc_resumed.log" 2>&1 || rc=1
    rm -rf "$ck"
    for f in "$dir/${layout}"_*.log; do
      echo "== $f"
      grep -E "loaded checkpoint|saved checkpoint|validation loss at iteration $STEPS|max allocated" \
        "$f" | cut -c1-300 | tail -4
      grep -E "Error|error:" "$f" | tail -3
    done
  done
  if [ "${BAD_FLAG:-1}" = 1 ]; then  # a bad mHC flag stops every rank with the config's error
    # shellcheck disable=SC2086
    timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$n" \
      examples/pretrain_gpt_mhc.py $base --enable-hyper-connections --num-residual-streams 0 \
      > "$dir/bad_flag.log" 2>&1
    local bad=$? ranks; ranks="$(grep -c 'ValueError: mHC config: ' "$dir/bad_flag.log")"
    echo "bad flag --num-residual-streams 0: rc=$bad (124 = hang)," \
      "ranks with the config error: $ranks"
    [ "$bad" != 0 ] && [ "$bad" != 124 ] && [ "$ranks" -ge 1 ] || rc=1
  fi
  "$PY" benchmarks/pretrain_report.py "$dir" --out "$dir" || rc=1
  echo "SUMMARY: $(awk -F'|' '/^\| [a-z0-9]+ \| mHC/ { gsub(/^ +| +$/, "", $2); gsub(/ /, "", $7)
    gsub(/ /, "", $10); printf "%s mHC step %s of baseline, val %s; ", $2, $7, $10 }' \
    "$dir/summary.md" 2>/dev/null)table and curves in pretrain/"
  return $rc
}

phase_demo() {
  local rc
  # shellcheck disable=SC2086
  "$PY" examples/train_gpt_mhc.py --out "$OUT/demo" ${DEMO_ARGS:-} 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s'
  rc=${PIPESTATUS[0]}
  echo "SUMMARY: loss table in demo.log, curves in demo/"
  return "$rc"
}

phase_study() {
  local rc
  # shellcheck disable=SC2086
  "$PY" examples/mhc_study.py --preset study --precision bf16 --mhc-params fp32 \
    --attention sdpa --seeds "${SEEDS:-3}" --out "$OUT/study" --time-budget-s "${BUDGET:-0}" \
    ${STUDY_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'it/s'
  rc=${PIPESTATUS[0]}
  echo "SUMMARY: report in study/study.md (a rerun resumes from study/study.json)"
  return "$rc"
}

# -------------------------------------------------------------------------------- setup
FAILED=()
if [ -n "${WHEELS:-}" ]; then
  SITE="${SITE:-$OUT/site}"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1; then
    echo "gpu.sh: installing $WHEELS/*.whl failed (see $OUT/wheels.log)" >&2; exit 1
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT"
if [ -n "${TE_BUILD:-}" ]; then
  t0=$SECONDS
  if bash -c "$TE_BUILD" > "$OUT/te_build.log" 2>&1; then
    status=ok
  else
    status=FAILED; FAILED+=(te_build)
  fi
  printf '%-10s %-6s %6ds  %s\n' te_build "$status" $((SECONDS - t0)) \
    "TE: $("$PY" -c 'import transformer_engine as t; print(t.__version__)' 2>/dev/null \
    || echo 'not importable')  [te_build.log]"
fi
if ! "$PY" -c "import torch, triton, megatron.core; assert torch.cuda.is_available()" \
    2>/dev/null; then
  echo "gpu.sh: needs torch with CUDA, triton and megatron-core importable by $PY" \
    "(install them, or give WHEELS=dir)" >&2
  exit 1
fi

# ------------------------------------------------------------------------------- phases
for phase in "$@"; do
  log="$OUT/$phase.log"
  t0=$SECONDS
  ( "phase_$phase" ) > "$log" 2>&1
  rc=$?
  summary="$(grep '^SUMMARY: ' "$log" | tail -1 | cut -c10-)"
  if [ $rc = 0 ]; then status=ok; else status=FAILED; FAILED+=("$phase"); fi
  printf '%-10s %-6s %6ds  %s  [%s]\n' "$phase" "$status" $((SECONDS - t0)) "$summary" \
    "${log#"$ROOT"/}"
done
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed: ${FAILED[*]} (logs in ${OUT#"$ROOT"/})"; exit 1
fi
