"""Prefill and decode throughput of Megatron-Core 0.19.2's ``DynamicInferenceEngine``: a GPT of
12 x 768 (124M parameters with the tied 50304-token embedding) with Megatron's own layers
(baseline) against the same GPT with mHC n=4, on one GPU.

    python benchmarks/bench_inference.py [--spec local|te] [--batches 1 64] [--prompt-len 128]
        [--new-tokens 128] [--reps 5] [--cuda-graphs] [--out inference.md]

The models are ``bench_e2e.build``'s (bf16, RMSNorm, RoPE, SwiGLU with ffn 2048, no biases;
``--spec`` picks Megatron's local modules or Transformer Engine's), the baseline from
Megatron's own block spec, mHC from ``get_gpt_decoder_block_with_mhc_spec`` (Triton kernels).
Per batch size B both models get an engine of their own (paged KV cache sized for B requests
of ``--prompt-len + --new-tokens`` tokens, ``max_requests`` B rounded up to 4, every prompt
admitted in the first step); each repetition adds B random prompts and runs greedy decoding
of ``--new-tokens`` tokens per request to the end, step by step, each step timed between two
device syncs. Prefill tok/s: prompt tokens over the time of the steps that prefill (the first,
which also samples each request's first token); decode tok/s: tokens generated in decode-only
steps over their time (host bookkeeping included, as a server sees it). One untimed warm-up
run per engine (Triton compilation, CUDA-graph capture), then ``--reps`` repetitions with the
two models alternating (the first model of a repetition alternates too), so both see the same
clock and thermal state; the table gives the median and the range of the repetitions.

``--cuda-graphs``: Megatron's local CUDA graphs (``cuda_graph_impl="local"``, inference
scope ``layer``), decode steps only, one graph per batch size Megatron picks. Needs a CUDA
device, FlashAttention (flash-attn >= 2.7.3, FA3 or FA4) and einops (Megatron's dynamic
attention path).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")

BLOCK_TOKENS = 256
MODELS = (("baseline", False), ("mHC", True))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", choices=("local", "te"), default="local")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode steps from Megatron's local CUDA graphs (scope 'layer')")
    p.add_argument("--out", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.prompt_len < 1 or args.reps < 1 or min(args.batches) < 1:
        p.error("--new-tokens >= 2 (a decode step), --prompt-len, --reps and --batches >= 1")
    return args


class _IdTokenizer:
    """The engine detokenizes finished requests; the benchmark needs no text."""

    eod = -1
    bos = None

    def detokenize(self, ids) -> str:
        return ""


def kv_buffer_gb(config, batch: int, max_len: int) -> float:
    """KV cache for ``batch`` requests of ``max_len`` tokens: K and V, every layer, blocks of
    ``BLOCK_TOKENS`` (one spare block a request: Megatron moves a request to a new block one
    token before its block is full), 25% headroom."""
    heads = config.num_query_groups or config.num_attention_heads
    block_bytes = 2 * config.num_layers * BLOCK_TOKENS * heads * config.kv_channels * 2
    blocks = batch * (math.ceil(max_len / BLOCK_TOKENS) + 1) + 2
    return 1.25 * blocks * block_bytes / 1024**3


def make_engine(model, config, batch: int, args):
    """Megatron's context, GPT wrapper, controller and engine for ``batch`` requests (CUDA
    graphs captured in the engine's constructor with ``--cuda-graphs``)."""
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    max_len = args.prompt_len + args.new_tokens
    inference_config = InferenceConfig(
        block_size_tokens=BLOCK_TOKENS, buffer_size_gb=kv_buffer_gb(config, batch, max_len),
        max_requests=4 * math.ceil(batch / 4), max_sequence_length=max_len,
        max_tokens=max(64 * math.ceil(batch * args.prompt_len / 64), 4 * math.ceil(batch / 4)),
        num_cuda_graphs=-1 if args.cuda_graphs else None,
        use_cuda_graphs_for_non_decode_steps=False)
    context = DynamicInferenceContext(config, inference_config)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), _IdTokenizer())
    return DynamicInferenceEngine(controller, context)


def run(engine, prompts: list[torch.Tensor], new_tokens: int) -> dict:
    """One generation of every prompt (greedy, ``new_tokens`` each), step by step; times and
    token counts of the prefill steps and of the decode-only steps."""
    from megatron.core.inference.sampling_params import SamplingParams

    engine.reset()
    sampling = SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1)
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, sampling)
    seconds = {"prefill": 0.0, "decode": 0.0}
    tokens = {"prefill": 0, "decode": 0}
    decode_steps = graphed_steps = 0
    gc.collect()
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = engine.step_modern()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        state = engine.decode_only
        phase = "decode" if (state.launched if state.launched is not None
                             else state.consumed) else "prefill"
        seconds[phase] += dt
        tokens[phase] += len(result["active_request_ids"]) + len(
            result["finished_request_records"])
        decode_steps += phase == "decode"
        graphed_steps += phase == "decode" and result["cuda_graph_request_count"] is not None
    generated = tokens["prefill"] + tokens["decode"]
    if generated != len(prompts) * new_tokens:
        raise RuntimeError(f"{generated} tokens generated, expected {len(prompts) * new_tokens}"
                           " (a request was paused, evicted or failed: KV buffer too small?)")
    return {"prefill_tok_s": sum(len(p) for p in prompts) / seconds["prefill"],
            "decode_tok_s": tokens["decode"] / seconds["decode"],
            "decode_ms": 1e3 * seconds["decode"] / decode_steps,
            "graphed_steps": graphed_steps, "decode_steps": decode_steps}


def measure_batch(batch: int, args) -> dict[str, list[dict]]:
    """Both models built, one engine each; a warm-up run each, then ``args.reps`` runs,
    alternating. Everything freed (and Megatron's CUDA graphs deleted) on return."""
    from bench_e2e import build
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    delete_cuda_graphs()
    shape = dict(layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads,
                 seq=args.prompt_len + args.new_tokens, mbs=1, vocab=args.vocab)
    engines = {}
    for name, mhc in MODELS:
        model, config = build(shape, args.spec, mhc, False, "cuda", graphs=args.cuda_graphs)
        engines[name] = make_engine(model.eval(), config, batch, args)
    g = torch.Generator(device="cuda").manual_seed(batch)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), device="cuda", generator=g)
               for _ in range(batch)]
    for engine in engines.values():
        run(engine, prompts, args.new_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(args.reps):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for name in order:
            runs[name].append(run(engines[name], prompts, args.new_tokens))
    del engines
    delete_cuda_graphs()
    return runs


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_inference.py needs a CUDA device: Megatron-Core's inference "
                         "engines are CUDA-only.")
    import triton
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.package_info import __version__ as mcore_version

    from mhc_testing.cpu import init_single_process_group

    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    if args.cuda_graphs:  # Megatron's graph managers take only a graph-safe RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True,
                                                        force_reset_rng=True)
    lines = [
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; megatron-core "
        f"{mcore_version}; triton {triton.__version__}",
        "command: python benchmarks/bench_inference.py " + " ".join(argv),
        f"GPT {args.layers} x {args.hidden}, {args.heads} heads, SwiGLU ffn {args.ffn}, vocab "
        f"{args.vocab}, bf16, {args.spec} specs; DynamicInferenceEngine, greedy; prompts of "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens each; "
        + ("decode from CUDA graphs" if args.cuda_graphs else "eager")
        + f"; median (range) of {args.reps} interleaved repetitions",
        "",
        "| batch | model | prefill tok/s | decode tok/s | decode ms/step | prefill / baseline "
        "| decode / baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in args.batches:
        runs = measure_batch(batch, args)
        base = {k: statistics.median(r[k] for r in runs["baseline"])
                for k in ("prefill_tok_s", "decode_tok_s")}
        for name, rs in runs.items():
            if args.cuda_graphs and any(r["graphed_steps"] != r["decode_steps"] for r in rs):
                raise RuntimeError(f"{name}, batch {batch}: a decode step ran without a graph")
            prefill = statistics.median(r["prefill_tok_s"] for r in rs)
            decode = statistics.median(r["decode_tok_s"] for r in rs)
            lines.append(
                f"| {batch} | {name} | {_cell([r['prefill_tok_s'] for r in rs], ',.0f')} | "
                f"{_cell([r['decode_tok_s'] for r in rs], ',.0f')} | "
                f"{_cell([r['decode_ms'] for r in rs], '.2f')} | "
                f"{prefill / base['prefill_tok_s']:.3f}x | {decode / base['decode_tok_s']:.3f}x |")
        gc.collect()
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
