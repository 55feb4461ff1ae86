"""Generate text from a checkpoint of ``examples/pretrain_gpt_mhc.py`` with Megatron-Core
0.19.2's own inference engines (one GPU; CUDA only: Megatron's engines are).

    python examples/prepare_stdlib_corpus.py out/data/stdlib
    GPT="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
      --max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm
      --swiglu --disable-bias-linear --bf16 --micro-batch-size 8 --global-batch-size 8
      --no-gradient-accumulation-fusion --tokenizer-type NullTokenizer --vocab-size 257
      --enable-hyper-connections --num-residual-streams 4"
    torchrun --nproc-per-node=1 examples/pretrain_gpt_mhc.py $GPT --train-iters 200 \\
      --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 20 --log-interval 20 \\
      --eval-interval 100 --eval-iters 10 --data-path out/data/stdlib --split 98,1,1 \\
      --save out/ckpt/gen --save-interval 200
    torchrun --nproc-per-node=1 examples/generate_mhc.py $GPT --load out/ckpt/gen \\
      --inference-dynamic-batching-buffer-size-gb 2 \\
      --prompts "import os" "def main(" --max-new-tokens 64 --greedy

Without Transformer Engine add ``--transformer-impl local --no-persist-layer-norm
--no-rope-fusion --no-masked-softmax-fusion`` to ``$GPT`` (both commands). The dynamic engine
needs FlashAttention (flash-attn >= 2.7.3, FA3 or FA4) and einops. ``--engine static`` runs
``StaticInferenceEngine`` (in 0.19.2 the dynamic engine underneath, so it needs them too);
Megatron's inference flags (``--inference-dynamic-batching-*``, ``--cuda-graph-impl local``)
apply. The script checks for them before it builds the model.

The model is built as the training example builds it: ``mhc_gpt_model_config_from_args`` (or
``mhc_hybrid_model_config_from_args`` with ``--hybrid-layer-pattern``) and Megatron's model
builder, then Megatron's ``load_checkpoint``. Tokens are the corpus's: bytes 0..255 and
end-of-document 256 (NullTokenizer's ``vocab_size - 1``); generation stops there.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # pretrain_gpt_mhc

import pretrain_gpt_mhc  # noqa: E402  (also puts the repository root on sys.path)

VOCAB_SIZE = 257  # bytes 0..255 + end of document


class ByteTokenizer:
    """What Megatron's engines and controller use of a tokenizer, for the byte corpus:
    ``tokenize(str) -> list[int]`` (UTF-8 bytes), ``detokenize(list[int]) -> str`` (bytes
    below 256, decoded with ``errors="replace"``), ``eod`` (256), ``bos`` (none)."""

    vocab_size = VOCAB_SIZE
    eod = VOCAB_SIZE - 1
    bos = None

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def generation_arguments(parser):
    """The training example's flags (Megatron's, the mHC group, its own) plus this script's."""
    pretrain_gpt_mhc.example_arguments(parser)
    g = parser.add_argument_group("generate_mhc.py")
    g.add_argument("--prompts", nargs="+", default=None, help="prompt texts (required)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (top-k 1)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=0.0, help="0: off")
    g.add_argument("--engine", choices=("dynamic", "static"), default="dynamic",
                   help="DynamicInferenceEngine, or StaticInferenceEngine")
    g.add_argument("--check-greedy", action="store_true",
                   help="with --greedy: check each prompt's tokens against greedy decoding by "
                        "repeated full forwards of the model (no KV cache); a difference that "
                        "is not a bf16 near-tie exits with status 1")
    return parser


def build_model(args):
    """The training example's model on this rank, checkpoint loaded, in eval mode: a
    ``GPTModel`` (or ``HybridModel``), in Megatron's ``Float16Module`` with ``--bf16`` /
    ``--fp16``. Input ``[b, s]`` token ids and positions; output logits ``[b, s, vocab]``."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.checkpointing import load_checkpoint

    from mhc_megatron.training import (
        mhc_gpt_model_config_from_args,
        mhc_hybrid_model_config_from_args,
    )

    if args.hybrid_layer_pattern is not None:
        model_cfg = mhc_hybrid_model_config_from_args(args)
    else:
        model_cfg = mhc_gpt_model_config_from_args(args)
    builder = model_cfg.get_builder_cls()(model_cfg)
    models = builder.build_distributed_models(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False)
    if len(models) != 1:
        raise SystemExit("generate_mhc.py: one model chunk expected (no virtual pipeline "
                         "stages); Megatron's inference wrapper refuses interleaved models.")
    args.no_load_optim = args.no_load_rng = True
    args.exit_on_missing_checkpoint = True
    load_checkpoint(models, None, None, strict=True)
    return models[0].eval()


def make_engine(args, model, tokenizer, prompts: list[list[int]]):
    """Megatron's wrapper, controller and engine around ``model``. The KV cache holds
    ``max(len(prompt)) + --max-new-tokens`` positions per request."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.contexts.static_context import StaticInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine, StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.training.argument_utils import inference_cfg_from_args

    max_len = max(len(p) for p in prompts) + args.max_new_tokens
    if args.engine == "static":
        context = StaticInferenceContext(len(prompts), max_len)
        controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer)
        engine = StaticInferenceEngine(
            controller, max_batch_size=len(prompts),
            buffer_size_gb=args.inference_dynamic_batching_buffer_size_gb)
        if engine.legacy:
            raise SystemExit("StaticInferenceEngine fell back to its legacy path: Megatron could "
                             "not build its dynamic context (its warning above says why).")
        return engine
    config = inference_cfg_from_args(args).to_inference_config(
        model, enable_cuda_graphs=args.cuda_graph_impl == "local", verbose=False)
    config.max_sequence_length = max_len
    if args.inference_dynamic_batching_max_requests is None:  # else sized by the KV buffer
        config.max_requests = 4 * math.ceil(len(prompts) / 4)
    context = DynamicInferenceContext(model.config, config)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer)
    return DynamicInferenceEngine(controller, context)


def main():
    if not torch.cuda.is_available():  # --help still works; the engines need CUDA
        from mhc_testing import warning_filters

        warning_filters.install()
    pretrain_gpt_mhc.skip_megatron_helper_build()
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.training import initialize_megatron
    from megatron.training.arguments import parse_and_validate_args

    from mhc_megatron.training.inference import inference_engines_unavailable

    args = parse_and_validate_args(extra_args_provider=generation_arguments)
    if not args.prompts:
        raise SystemExit("generate_mhc.py: give --prompts TEXT [TEXT ...]")
    if args.check_greedy and not args.greedy:
        raise SystemExit("generate_mhc.py: --check-greedy checks greedy decoding: add --greedy")
    if args.check_greedy and args.tensor_model_parallel_size != 1:
        raise SystemExit("generate_mhc.py: --check-greedy runs the full forward on one rank: "
                         "use --tensor-model-parallel-size 1")
    missing = inference_engines_unavailable()
    if missing is not None:
        raise SystemExit(f"generate_mhc.py: Megatron-Core's inference engines need {missing}.")
    if args.vocab_size != VOCAB_SIZE:
        raise SystemExit(f"generate_mhc.py decodes the byte corpus: --vocab-size {VOCAB_SIZE} "
                         f"(bytes + end of document), got {args.vocab_size}.")
    initialize_megatron()
    model = build_model(args)
    tokenizer = ByteTokenizer()
    prompts = [tokenizer.tokenize(p) for p in args.prompts]  # token ids, one list per prompt
    sampling = SamplingParams(
        temperature=args.temperature, top_k=1 if args.greedy else args.top_k,
        top_p=0.0 if args.greedy else args.top_p, num_tokens_to_generate=args.max_new_tokens,
        termination_id=tokenizer.eod)
    engine = make_engine(args, model, tokenizer, prompts)
    with torch.inference_mode():
        if args.engine == "static":
            results = engine.generate(prompts=prompts, sampling_params=sampling)
        else:
            results = [record.merge() for record in engine.generate(prompts, sampling)]
    generated = [list(request.generated_tokens) for request in results]
    if torch.distributed.get_rank() == 0:
        for i, (text, tokens) in enumerate(zip(args.prompts, generated)):
            print(f"----- prompt {i} ({len(prompts[i])} tokens, {len(tokens)} generated)\n"
                  f"{text}{tokenizer.detokenize(tokens)}", flush=True)
    if args.check_greedy and not check_greedy(model, prompts, generated):
        sys.exit(1)


def check_greedy(model, prompts: list[list[int]], generated: list[list[int]]) -> bool:
    """Print, per prompt, how the engine's greedy tokens compare with greedy decoding by
    repeated full forwards of ``model`` (:mod:`mhc_testing.greedy`); False on a divergence that
    is not a near-tie."""
    from mhc_testing.greedy import greedy_mismatch

    ok = True
    for i, (prompt, tokens) in enumerate(zip(prompts, generated)):
        found = greedy_mismatch(model, prompt, tokens)
        if found is None:
            verdict = f"equal to greedy decoding by full forwards ({len(tokens)} tokens)"
        elif found["tie"]:
            verdict = (f"equal up to a near-tie at token {found['step']} (logit gap "
                       f"{found['gap']:.3g} <= {found['bound']:.3g}); not compared past it")
        else:
            ok = False
            verdict = (f"DIVERGES at token {found['step']}: {found['got']} instead of "
                       f"{found['want']} (logit gap {found['gap']:.3g} > {found['bound']:.3g})")
        print(f"greedy check, prompt {i}: {verdict}", flush=True)
    return ok


if __name__ == "__main__":
    main()
