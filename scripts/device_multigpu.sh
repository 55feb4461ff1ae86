#!/usr/bin/env bash
# The 2-GPU host (nvidia-h200-x2), or the 4-GPU one (nvidia-h200-x4: the 3-D layouts), in
# phases, one call each; logs and a summary go to $OUT.
#   carry [".whl"] (+ TE, built first with ../shared/tools/te-on-gpu: export
#   PYTHONPATH=/tmp/tebuild/site before calling this script, in the same command)
#   PHASE=pretrain  examples/pretrain_gpt_mhc.py, ~113M-parameter GPT on the stdlib corpus over
#                   NCCL, for each LAYOUT (default "tp2sp dp2"): baseline STEPS steps, and mHC
#                   n=4 interrupted at STEPS/2 and resumed from its checkpoint.
#                   tp2sp = TP=2 + sequence parallel (TE specs where TE is installed);
#                   dp2 = DP=2 with Megatron's distributed optimiser; pp2 = PP=2 (1F1B);
#                   on 4 GPUs: tp2pp2 = TP=2 + SP x PP=2, pp2dp2 = PP=2 x DP=2 (dist. opt.).
#   PHASE=dist      tests/test_distributed.py on the GPUs (TP/EP/checkpoint-resharding/CP
#                   equivalence; with TE's specs and with Megatron's local modules; with 4
#                   GPUs also TP=2 x PP=2); stops at the first failure, with its report;
#                   K: a -k filter.
#   PHASE=ddp       tests/test_ddp_param_gather.py over NCCL (DDP overlap_param_gather), and
#                   once more against a copy of the package with the bug it guards.
#   PHASE=example   the GPU cases of tests/test_pretrain_example.py (K: a -k filter; with 4
#                   GPUs also the 3-D layouts and the TP=2 x PP=2 checkpoint resharding).
#   PHASE=ppcompare mHC n=4 at PP=2 against PP=1 from one checkpoint: a PP=1 run saves after
#                   step 1; from it PP=1 trains to step 20 and PP=2 (1F1B, 4 micro-batches) to
#                   STEPS; their per-micro-batch losses of steps 2-20 are compared (GPU weights
#                   are seeded per pipeline rank, so a shared start needs the checkpoint).
#   PHASE=p2p       benchmarks/bench_pp_p2p.py: bytes and time of the stage boundary.
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
NGPU="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
python3 -c "import torch, triton, megatron.core as m; print(torch.cuda.get_device_name(), 'x', torch.cuda.device_count(), '| torch', torch.__version__, '| triton', triton.__version__, '| megatron-core', m.__version__)" | tee -a "$OUT/env.txt"
python3 -c "import transformer_engine as t; print('Transformer Engine', t.__version__)" 2>/dev/null | tee -a "$OUT/env.txt"
TE=0; python3 -c "import transformer_engine.pytorch" 2>/dev/null && TE=1
PHASE="${PHASE:-pretrain}"
STEPS="${STEPS:-300}"
# The ~85M GPT the pretraining phases train on the stdlib bytes, global batch $1 (no apex here:
# its fused weight-gradient kernel, Megatron's default for the output layer, is off).
gpt_flags() {
  local local_modules="--no-gradient-accumulation-fusion"
  [ "$TE" = 1 ] || local_modules="$local_modules --transformer-impl local \
    --no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion"
  echo "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu \
    --disable-bias-linear --micro-batch-size 8 --global-batch-size $1 --train-iters $STEPS \
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 30 --clip-grad 1.0 \
    --weight-decay 0.1 --bf16 --data-path /tmp/data/stdlib --split 98,1,1 \
    --tokenizer-type NullTokenizer --vocab-size 257 --log-interval 10 --eval-interval 50 \
    --eval-iters 10 --log-throughput --seed 1234 $local_modules"
}

if [ "$PHASE" = pretrain ]; then
  python3 examples/prepare_stdlib_corpus.py /tmp/data/stdlib --max-mb 8 > /dev/null
  BASE="$(gpt_flags 16)"
  for layout in ${LAYOUT:-tp2sp dp2}; do
    case $layout in
      tp2sp) PAR="--tensor-model-parallel-size 2 --sequence-parallel" ;;
      dp2) PAR="--use-distributed-optimizer" ;;
      pp2) PAR="--pipeline-model-parallel-size 2" ;;
      tp2pp2) PAR="--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2" ;;
      pp2dp2) PAR="--pipeline-model-parallel-size 2 --use-distributed-optimizer" ;;
      *) echo "unknown layout $layout"; exit 2 ;;
    esac
    run() { torchrun --standalone --nproc-per-node="$NGPU" examples/pretrain_gpt_mhc.py $BASE $PAR "$@"; }
    ck=/tmp/ckpt_$layout
    run > "$OUT/${layout}_baseline.log" 2>&1; echo "$layout baseline rc=$?"
    run --enable-hyper-connections --num-residual-streams 4 --save $ck --save-interval $((STEPS / 2)) \
      --exit-interval $((STEPS / 2)) > "$OUT/${layout}_mhc_part1.log" 2>&1; echo "$layout mhc part1 rc=$?"
    run --enable-hyper-connections --num-residual-streams 4 --load $ck --save $ck \
      --save-interval $((STEPS / 2)) > "$OUT/${layout}_mhc_part2.log" 2>&1; echo "$layout mhc part2 rc=$?"
    for f in "$OUT/${layout}"_*.log; do
      echo "== $f"; grep -E "loaded checkpoint|saved checkpoint|validation loss at iteration|max allocated|iteration +($((STEPS / 2))|$STEPS)/" "$f" | cut -c1-400 | tail -6
      grep -E "Error|error:" "$f" | tail -3
    done
  done 2>&1 | tee "$OUT/pretrain_summary.txt"
  for bad in "--num-residual-streams 0" "--mhc-sinkhorn-iterations 0"; do  # a clean stop
    timeout 300 torchrun --standalone --nproc-per-node="$NGPU" examples/pretrain_gpt_mhc.py $BASE \
      --enable-hyper-connections $bad > /tmp/bad.log 2>&1
    echo "bad flags '$bad': rc=$? (124 = hang), ranks with the config error:" \
      "$(grep -c 'ValueError: mHC config: ' /tmp/bad.log)"; grep -m1 'ValueError: mHC config: ' /tmp/bad.log
  done 2>&1 | tee -a "$OUT/pretrain_summary.txt"
elif [ "$PHASE" = ppcompare ]; then
  python3 examples/prepare_stdlib_corpus.py /tmp/data/stdlib --max-mb 8 > /dev/null
  PPF="$(gpt_flags 32) --log-micro-batch-loss --enable-hyper-connections --num-residual-streams 4"
  pp() { local np=$1; shift; torchrun --standalone --nproc-per-node=$np examples/pretrain_gpt_mhc.py $PPF "$@"; }
  pp 1 --save /tmp/ck_pp --save-interval 1 --exit-interval 1 > "$OUT/pp1_step1.log" 2>&1; echo "pp1 step 1 rc=$?"
  pp 1 --load /tmp/ck_pp --exit-interval 20 > "$OUT/pp1_to20.log" 2>&1; echo "pp1 to 20 rc=$?"
  pp 2 --pipeline-model-parallel-size 2 --load /tmp/ck_pp > "$OUT/pp2_mhc.log" 2>&1; echo "pp2 rc=$?"
  python3 - "$OUT/pp1_to20.log" "$OUT/pp2_mhc.log" <<'PY' | tee "$OUT/ppcompare.txt"
import re, sys
a, b = ([float(v) for v in re.findall(r"\[micro-batch loss\] train ([-0-9.eE+]+)", open(f).read())] for f in sys.argv[1:])
k = min(len(a), len(b)); assert k, (len(a), len(b))
rel = max(abs(x - y) / abs(y) for x, y in zip(a[:k], b[:k]))
print(f"PP=2 vs PP=1 from one checkpoint, steps 2-20: {k} micro-batch losses, max rel diff {rel:.2e}, bitwise {a[:k] == b[:k]}")
PY
  grep -E "validation loss at iteration|max allocated|iteration +$STEPS/" "$OUT/pp2_mhc.log" | cut -c1-300 | tail -4
elif [ "$PHASE" = p2p ]; then
  torchrun --standalone --nproc-per-node=2 benchmarks/bench_pp_p2p.py --out "$OUT/p2p.md" 2>&1 | tail -15
elif [ "$PHASE" = dist ]; then
  # every failure's report as it happens (-x: the first stops the run), each test bounded, so
  # a call cut short still shows why; K: a -k filter (e.g. "tensor_parallel and cuda-te")
  opts=(-v -s -p no:cacheprovider -x -rfE -k "not cpu ${K:+and ($K)}")
  python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout "${PER_TEST:-240}")
  python3 -m pytest tests/test_distributed.py "${opts[@]}" > "$OUT/dist_tests.log" 2>&1
  echo "dist rc=$?"; grep -E "PASSED|FAILED|SKIPPED|Error|passed|failed" "$OUT/dist_tests.log" \
    | cut -c1-600 | tail -40
elif [ "$PHASE" = ddp ]; then
  # DDP overlap_param_gather over NCCL (tests/test_ddp_param_gather.py, Triton kernels), then
  # the same test against the bug it guards (pre as a plain method: no forward pre-hook): it
  # must fail there
  python3 -m pytest tests/test_ddp_param_gather.py -v -s -p no:cacheprovider -rfE \
    > "$OUT/ddp.log" 2>&1; echo "ddp rc=$?"; grep -E "PARAM GATHER|passed|failed" "$OUT/ddp.log"
  rm -rf /tmp/mutant && mkdir -p /tmp/mutant && cp -r mhc_megatron tests pyproject.toml /tmp/mutant/
  sed -i 's/        return self(streams)$/        return self.forward(streams)/' \
    /tmp/mutant/mhc_megatron/layers/hyper_connection.py
  # the mutant first on the path, and the child names the package it ran (the project's own
  # copy must not stand in for it: an editable install, or the repo root on the path)
  ( cd /tmp/mutant && PYTHONPATH="/tmp/mutant:${PYTHONPATH/$PWD//tmp/mutant}" python3 -m pytest \
      tests/test_ddp_param_gather.py -k cuda -q -p no:cacheprovider -rfE > "$OUT/ddp_mutant.log" 2>&1
    echo "ddp against the bug rc=$? (1 expected)"; grep -o "AssertionError: .*\|package [^)]*" \
      "$OUT/ddp_mutant.log" | sort | uniq -c | head -5 )
elif [ "$PHASE" = example ]; then
  python3 -m pytest tests/test_pretrain_example.py -v -p no:cacheprovider -k "(cuda or gpu) ${K:+and ($K)}" \
    --durations=20 2>&1 | tail -120 | tee "$OUT/example_tests.log"
fi
