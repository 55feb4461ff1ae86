"""GPU benchmark of MHCRecomputeManager: activation memory and step time of a GPTModel decoder.

Configurations, one process, side by side (bf16 params and activations, Triton mHC kernels;
``--spec local``: Megatron's local modules, core attention recomputed by Megatron in every
configuration so the s^2 attention scores do not drown the residual traffic; ``--spec te``:
Transformer Engine's modules and fused attention, nothing recomputed by Megatron):

* ``baseline``: Megatron's own GPT block spec (plain residual);
* ``mHC``: n=4 hyper-connections, no recompute;
* ``mHC rc=k``: n=4 with ``mhc_recompute=True`` and blocks of k layers (eq. 20's value marked).

For each it reports the activation memory saved by forward (allocated after forward minus
before; grads are already allocated), the peak during forward+backward over the same
starting point, and the median forward+backward step time.

    python benchmarks/bench_recompute.py [--spec te] [--layers 8 --hidden 4096 --seq 4096 --mbs 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")

GIB = 1024**3


def build(args, mhc: bool, block: int | None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
    from mhc_testing.cpu import setup_cpu_megatron

    setup_cpu_megatron(1234)
    te = args.spec == "te"
    recompute = {} if te else dict(recompute_granularity="selective",
                                   recompute_modules=["core_attn"])
    config = MHCTransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True,
        **recompute, enable_hyper_connections=mhc, num_residual_streams=4,
        mhc_recompute=block is not None, mhc_recompute_layer_num=block,
    )
    make_spec = get_gpt_decoder_block_with_mhc_spec if mhc else get_gpt_decoder_block_spec
    spec = make_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope").to(args.device)
    return model, config


def measure(model, args):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device="cuda", generator=g)
    pos = torch.arange(args.seq, device="cuda").expand(args.mbs, args.seq)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda"), 1)
    mask = mask[None, None]

    def step():
        loss = model(ids, pos, mask, labels=ids).float().mean()
        loss.backward()

    for _ in range(2):  # warm-up (Triton compiles) and grads allocated
        step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = model(ids, pos, mask, labels=ids).float().mean()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del loss
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"saved_gib": saved / GIB, "peak_gib": peak / GIB, "ms": statistics.median(times)}


def census(model, args, top=8):
    """What the mHC-recompute forward still stores: saved tensors that pass our pack hook
    unreplaced and are alive after forward, grouped by (shape, dtype), largest first. (The
    hooks in Python and on over each whole sublayer, so that the pack hook sees every saved
    tensor: the same placeholders as the C++ hooks.)"""
    import collections

    from torch.multiprocessing.reductions import StorageWeakRef

    from mhc_megatron.recompute import manager as rc

    seen = {}
    orig = rc._AddressRanges.pack
    native, narrow = rc.native_hooks(), rc.narrow_hooks()

    def pack(self, t):
        out = orig(self, t)
        if isinstance(out, torch.Tensor):
            seen[StorageWeakRef(out.untyped_storage())] = (tuple(out.shape), str(out.dtype),
                                                           out.untyped_storage().nbytes())
        return out

    rc._AddressRanges.pack = pack
    rc.set_native_hooks(False)
    rc.set_narrow_hooks(False)
    try:
        ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device="cuda")
        pos = torch.arange(args.seq, device="cuda").expand(args.mbs, args.seq)
        mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda"), 1)
        loss = model(ids, pos, mask[None, None], labels=ids).float().mean()
        groups = collections.Counter()
        count = collections.Counter()
        for key, (shape, dtype, nbytes) in seen.items():
            if not key.expired():
                groups[(shape, dtype)] += nbytes
                count[(shape, dtype)] += 1
        del loss
    finally:
        rc._AddressRanges.pack = orig
        rc.set_native_hooks(native)
        rc.set_narrow_hooks(narrow)
    return [(f"{s} {d}", count[(s, d)], b / GIB) for (s, d), b in groups.most_common(top)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--spec", choices=("local", "te"), default="local",
                   help="Megatron's local modules (core_attn recomputed) or Transformer Engine's")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--out", default=None)
    p.add_argument("--census", action="store_true",
                   help="list what the eq. 20 recompute run still stores after forward")
    args = p.parse_args()
    args.device = "cuda"

    from mhc_testing.cpu import init_single_process_group
    from megatron.core import parallel_state

    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    eq20 = max(1, round(math.sqrt(4 * args.layers / 6)))
    runs = [("baseline", False, None), ("mHC", True, None)]
    runs += [(f"mHC rc={k}" + (" (eq. 20)" if k == eq20 else ""), True, k)
             for k in sorted(set(args.blocks) | {eq20})]
    rows = {}
    for name, mhc, block in runs:
        model, _ = build(args, mhc, block)
        rows[name] = measure(model, args)
        print(name, rows[name], flush=True)
        if args.census and block == eq20:
            for what, n, gib in census(model, args):
                print(f"  census: {n:3d} x {what}: {gib:.3f} GiB", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()

    base, plain = rows["baseline"], rows["mHC"]
    extra_plain = plain["saved_gib"] - base["saved_gib"]
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; GPTModel "
             f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, mbs {args.mbs}, bf16, "
             f"n=4, Triton mHC kernels, {args.spec} spec"
             + ("" if args.spec == "te" else ", core_attn recompute in all runs")
             + f"; median of {args.steps} fwd+bwd steps", "",
             "| config | activations after fwd (GiB) | extra over baseline (GiB) | "
             "% of mHC's extra | peak fwd+bwd (GiB) | step (ms) | step / mHC |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        extra = r["saved_gib"] - base["saved_gib"]
        share = f"{100 * extra / extra_plain:.0f}%" if name.startswith("mHC") else ""
        lines.append(f"| {name} | {r['saved_gib']:.2f} | {extra:.2f} | {share} | "
                     f"{r['peak_gib']:.2f} | {r['ms']:.1f} | {r['ms'] / plain['ms']:.3f} |")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
