"""What a whole training step pays for mHC, against the bytes mHC must move.

    python benchmarks/bench_e2e.py [--configs dense moe] [--specs te local] [--steps 10]
        [--profile] [--out bench_e2e.md]

One process, side by side, per config and spec family: ``baseline`` (Megatron's own GPT block
spec), ``mHC`` (n=4, Triton kernels) and ``mHC + recompute`` (``mhc_recompute``, eq. 20
blocks). A step is forward + backward of one micro-batch (bf16 weights and activations, no
optimiser: it is the same for all three); reported: median step time, tokens/s, peak memory
allocated during the step, and mHC's overhead next to its byte floor.

Configs (``--layers`` etc. override):

* ``dense``: 8 layers, hidden 4096, SwiGLU 11008, 32 heads, seq 4096, micro-batch 1;
* ``moe``: DeepSeek-like, 8 layers, hidden 2048, 16 heads, 64 experts top-6 (expert FFN 1408,
  shared expert 2816), alltoall dispatcher, seq 4096, micro-batch 1; experts as TE's grouped
  GEMM with TE specs, as Megatron's SequentialMLP (its only local expert module) otherwise.

Spec families: ``te`` (Transformer Engine's modules and fused attention: the form users run;
needs TE) and ``local`` (Megatron's local modules, core attention replaced by torch SDPA's
flash attention for every run, so the s^2 scores do not dominate).

Byte floor: per sublayer and token, mHC's kernels must read and write (bf16, x = n*C
streams, y = C, as ``benchmarks/bench_mhc.py`` counts them) ``pre`` x + y, ``combine``
x + y + x, backward 3x + 3y, i.e. 6x + 5y; with ``mhc_recompute`` the forward ops once more
(3x + 2y). Two sublayers a layer; divided by the measured copy bandwidth (read + write) of
this GPU, that is the time mHC cannot go below (its GEMMs for the mappings are negligible at
these widths). ``--profile`` adds, per config, where the mHC run's time goes: device time
by kernel category (mHC Triton kernels, GEMMs, attention, copies and elementwise, other) and
the step time not covered by kernels (launch and Python overhead).

``--smoke`` shrinks every config to a few layers of width 64 (CPU or GPU): a check that the
script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import torch
from bench_mhc import N, copy_bandwidth, sublayer_bytes  # benchmarks/ is on sys.path

sys.path.insert(0, ".")

GIB = 1024**3
CONFIGS = {
    "dense": dict(layers=8, hidden=4096, ffn=11008, heads=32, seq=4096, mbs=1),
    "moe": dict(layers=8, hidden=2048, ffn=1408, heads=16, seq=4096, mbs=1, experts=64, topk=6,
                shared=2816),
}
SMOKE = dict(layers=2, hidden=64, ffn=128, heads=4, seq=64, mbs=2)
RUNS = [("baseline", False, False), ("mHC", True, False), ("mHC + recompute", True, True)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    p.add_argument("--specs", nargs="+", choices=("te", "local"), default=None,
                   help="default: te and local where TE is installed, else local")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    for key in ("layers", "hidden", "seq", "mbs"):
        p.add_argument(f"--{key}", type=int, default=None)
    args = p.parse_args(argv)
    if args.specs is None:
        import importlib.util

        args.specs = (["te"] if importlib.util.find_spec("transformer_engine") else []) + ["local"]
    return args


def shape_of(name: str, args) -> dict:
    shape = dict(CONFIGS[name])
    if args.smoke:
        shape.update(SMOKE)
        if "experts" in shape:
            shape.update(experts=4, topk=2, shared=128)
    for key in ("layers", "hidden", "seq", "mbs"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


def build(shape: dict, spec: str, mhc: bool, recompute: bool, device):
    """The GPT of one run: bf16, RMSNorm, RoPE, SwiGLU, no biases; MoE where ``experts``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
    from mhc_megatron.testing.cpu import setup_cpu_megatron

    setup_cpu_megatron(1234)
    moe = {}
    if "experts" in shape:
        moe = dict(num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
                   moe_ffn_hidden_size=shape["ffn"],
                   moe_shared_expert_intermediate_size=shape["shared"],
                   moe_grouped_gemm=spec == "te", moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="alltoall" if torch.cuda.is_available()
                   else "allgather", moe_router_dtype="fp32")
    config = MHCTransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        ffn_hidden_size=shape["ffn"] if not moe else 4 * shape["hidden"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True, enable_hyper_connections=mhc,
        num_residual_streams=N, mhc_recompute=recompute, **moe)
    te = spec == "te"
    make_spec = get_gpt_decoder_block_with_mhc_spec if mhc else get_gpt_decoder_block_spec
    block = make_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if not te:  # flash attention for every run of the local family
        from mhc_megatron.testing.attention import SDPACoreAttention

        for layer_spec in block.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(config, block, vocab_size=shape["vocab"],
                     max_sequence_length=shape["seq"], position_embedding_type="rope")
    return model.to(device), config


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_step(model, shape: dict, spec: str, device):
    """One forward + backward of a fixed micro-batch (no mask with SDPA: it is causal)."""
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (shape["mbs"], shape["seq"]), device=device,
                        generator=g)
    pos = torch.arange(shape["seq"], device=device).expand(shape["mbs"], shape["seq"])
    mask = None if spec == "local" else torch.triu(
        torch.ones(shape["seq"], shape["seq"], dtype=torch.bool, device=device), 1)[None, None]

    def step():
        model(ids, pos, mask, labels=ids).float().mean().backward()

    return step


def measure(step, tokens: int, steps: int, warmup: int) -> dict:
    """Median time of ``step`` and the peak memory allocated during one step."""
    for _ in range(warmup):  # Triton compiles; grads allocated
        step()
    _sync()
    peak = 0.0
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        _sync()
        peak = (torch.cuda.max_memory_allocated() - before) / GIB
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        step()
        _sync()
        times.append(1e3 * (time.perf_counter() - start))
    ms = statistics.median(times)
    return {"ms": ms, "tokens_s": tokens / ms * 1e3, "peak_gib": peak}


def floor_bytes(shape: dict, recompute: bool) -> float:
    """mHC's bytes per step (see the module docstring), from bench_mhc's per-op counts."""
    ops = sublayer_bytes(shape["mbs"] * shape["seq"], shape["hidden"])
    per_sublayer = sum(ops.values())
    if recompute:  # the forward ops once more
        per_sublayer += ops["pre fwd"] + ops["post fwd"]
    return 2 * shape["layers"] * per_sublayer


CATEGORIES = [("mHC kernels", ("_proj_partial", "_mappings", "_aggregate", "_combine",
                               "_dhpre", "_pre_dx_dphi", "mhc")),
              ("GEMM", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "matmul")),
              ("attention", ("flash", "fmha", "attn", "attention", "sdpa")),
              ("copies, elementwise", ("copy", "elementwise", "vectorized", "reduce", "cat",
                                       "index", "fill"))]


def profile(step) -> list[tuple[str, float]]:
    """Device time per kernel category over one ``step``, and the step time that kernels
    leave uncovered."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    _sync()
    cuda = torch.cuda.is_available()
    with torch_profile(activities=[ProfilerActivity.CPU]
                       + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        step()
        _sync()
        wall = 1e3 * (time.perf_counter() - start)
    totals = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0) if cuda else 0.0
        if not us or event.key.startswith(("aten::", "autograd", "ProfilerStep")):
            continue  # CPU-side ops: their kernels are counted under the kernels' own names
        name = event.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        totals[cat] += us / 1e3
    busy = sum(totals.values())
    return [*totals.items(), ("not covered by kernels (launch, Python, syncs)", wall - busy)]


def main(argv=None):
    args = parse_args(argv)
    from megatron.core import parallel_state

    from mhc_megatron.testing.cpu import init_single_process_group

    device = "cuda" if torch.cuda.is_available() else "cpu"
    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth() if device == "cuda" else float("nan")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke only)"
    lines = [f"{name}; torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s (read+write); "
             f"n={N}, bf16, forward+backward of one micro-batch, median of {args.steps}", "",
             "| config | spec | run | step (ms) | tokens/s | peak alloc (GiB) | vs baseline "
             "| vs mHC | mHC byte floor (ms) | overhead / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    profiles = []
    for cfg_name in args.configs:
        shape = {**shape_of(cfg_name, args), "vocab": args.vocab if not args.smoke else 256}
        for spec in args.specs:
            base_ms = mhc_ms = None
            for run, mhc, recompute in RUNS:
                model, _ = build(shape, spec, mhc, recompute, device)
                step = make_step(model, shape, spec, device)
                r = measure(step, shape["mbs"] * shape["seq"], args.steps, args.warmup)
                if args.profile and run == "mHC":
                    profiles.append((cfg_name, spec, profile(step)))
                del model, step
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                base_ms = r["ms"] if base_ms is None else base_ms
                mhc_ms = r["ms"] if run == "mHC" else mhc_ms
                rel = f"{r['ms'] / base_ms:.3f}x"
                rel_mhc = f"{r['ms'] / mhc_ms:.3f}x" if recompute else "-"
                floor = over = "-"
                if mhc:
                    floor_ms = floor_bytes(shape, recompute) / (bw * 1e9) * 1e3
                    floor = f"{floor_ms:.1f}"
                    if math.isfinite(floor_ms) and floor_ms > 0:
                        over = f"{(r['ms'] - base_ms) / floor_ms:.2f}"
                lines.append(f"| {cfg_name} | {spec} | {run} | {r['ms']:.1f} | "
                             f"{r['tokens_s']:,.0f} | {r['peak_gib']:.2f} | {rel} | {rel_mhc} | {floor} "
                             f"| {over} |")
                print(lines[-1], flush=True)
    for cfg_name, spec, rows in profiles:
        lines += ["", f"where the mHC step's time goes ({cfg_name}, {spec}):", "",
                  "| category | ms |", "|---|---|"]
        lines += [f"| {cat} | {ms:.2f} |" for cat, ms in rows]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
