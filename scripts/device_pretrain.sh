#!/usr/bin/env bash
# One call on the GPU host: Megatron's own training loop with mHC (examples/pretrain_gpt_mhc.py)
# on every visible GPU over NCCL. Records the GPU golden losses into $OUT and checks that a
# second run reproduces them; trains a ~113M-parameter GPT on the stdlib corpus, baseline and
# mHC n=4, the mHC run interrupted at STEPS/2 and resumed from its checkpoint. Logs to $OUT.
#   needs: .whl/megatron_core-0.19.2-*.whl; carry [".whl"] (plus TE's, see README)
#   STEPS (300), NGPU (all visible), EXTRA (more Megatron flags, e.g. "--tensor-model-parallel-size 2")
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
STEPS="${STEPS:-300}"; NGPU="${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
MHC_UPDATE_GOLDEN=1 MHC_GOLDEN_DIR="$OUT" python3 -m pytest tests/test_pretrain_example.py -q \
  -p no:cacheprovider -k golden_losses_gpu 2>&1 | tail -3 | tee "$OUT/golden_gpu.log"
MHC_GOLDEN_DIR="$OUT" python3 -m pytest tests/test_pretrain_example.py -q -p no:cacheprovider \
  -k golden_losses_gpu 2>&1 | tail -3 | tee -a "$OUT/golden_gpu.log"
python3 examples/prepare_stdlib_corpus.py /tmp/data/stdlib --max-mb 8
LOCAL=""; python3 -c "import transformer_engine" 2>/dev/null || LOCAL="--transformer-impl local \
  --no-gradient-accumulation-fusion --no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion"
FLAGS="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
  --max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu \
  --disable-bias-linear --micro-batch-size 8 --global-batch-size $((8 * NGPU)) --train-iters $STEPS \
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 30 --clip-grad 1.0 \
  --weight-decay 0.1 --bf16 --data-path /tmp/data/stdlib --split 98,1,1 \
  --tokenizer-type NullTokenizer --vocab-size 257 --log-interval 10 --eval-interval 100 \
  --eval-iters 10 --log-throughput --seed 1234 $LOCAL ${EXTRA:-}"
run() { torchrun --standalone --nproc-per-node="$NGPU" examples/pretrain_gpt_mhc.py $FLAGS "$@"; }
run 2>&1 | tee "$OUT/pretrain_baseline.log" | grep -E "iteration +[0-9]+/|validation loss|memory" | tail -4
run --enable-hyper-connections --save /tmp/ckpt --save-interval $((STEPS / 2)) \
  --exit-interval $((STEPS / 2)) 2>&1 | tee "$OUT/pretrain_mhc_part1.log" | tail -3
run --enable-hyper-connections --load /tmp/ckpt --save /tmp/ckpt --save-interval $((STEPS / 2)) \
  2>&1 | tee "$OUT/pretrain_mhc_part2.log" | grep -E "loaded checkpoint|iteration +[0-9]+/|validation loss" | tail -4
