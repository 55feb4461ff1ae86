"""Probe: one mHC sublayer's pre + input RMSNorm + combine, forward and backward, unfused
(pre, then Transformer Engine's RMSNorm, or torch's without TE) against ``mhc_fuse_input_norm``
(the norm formed by pre's kernels), and the fused kernels' tiles (``--tile``).

    python benchmarks/probe_fused_norm.py [--sizes 4096x4096 16384x4096] [--reps 20]
        [--tile dx=64,64,4,2 --tile agg_norm=8,1024,4 ...]

Prints a table of the median time per variant and the device time per kernel of each.
The sublayer itself is the identity (f = the normalised input), so that only mHC's and the
norm's work is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")

N = 4


def _norm_module(c, device):
    try:
        import transformer_engine.pytorch as te

        return "TE RMSNorm", te.RMSNorm(c, eps=1e-5, params_dtype=torch.bfloat16).to(device)
    except ImportError:
        mod = torch.nn.RMSNorm(c, eps=1e-5).to(device, torch.bfloat16)
        return "torch RMSNorm", mod


def _step(variant, x, phi, alpha, bias, w, norm_mod, up):
    from mhc_megatron.kernels import triton_mhc

    x.grad = None
    if variant == "unfused":
        y, _, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=N)
        f = norm_mod(y)
    else:
        y, _, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=N,
                                             norm=(w, 1e-5))
        f = triton_mhc.input_norm(y, w, 1e-5)
    out = triton_mhc.combine(x, f, None, h_res, h_post, n=N)
    out.backward(up)


def _time(fn, reps):
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            out[e.key[:40]] = e.device_time_total / 1e3
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["4096x4096", "16384x4096"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tile", action="append", default=[], metavar="NAME=V,V,...",
                   help="a TILES field for one more fused run (repeatable: one run each)")
    args = p.parse_args(argv)
    from mhc_megatron.kernels.triton_common import TILES

    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; n={N}, bf16; "
          f"median of {args.reps}, ms; pre + norm + combine, forward and backward")
    for size in args.sizes:
        T, C = (int(v) for v in size.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        m = 2 * N + N * N
        x = torch.randn(T // 4, 4, N * C, device=dev, dtype=torch.bfloat16,
                        generator=g).requires_grad_()
        phi = (0.02 * torch.randn(m, N * C, device=dev, generator=g)).requires_grad_()
        alpha = torch.full((3,), 0.5, device=dev, requires_grad=True)
        bias = (0.1 * torch.randn(m, device=dev, generator=g)).requires_grad_()
        w = (1 + 0.1 * torch.randn(C, device=dev, generator=g)).to(torch.bfloat16)
        w.requires_grad_()
        up = torch.randn(T // 4, 4, N * C, device=dev, dtype=torch.bfloat16, generator=g)
        norm_name, norm_mod = _norm_module(C, dev)
        rows = []
        variants = [("unfused", None), ("fused", None)] + [("fused", t) for t in args.tile]
        for variant, tile in variants:
            saved = None
            if tile is not None:
                field, _, values = tile.partition("=")
                saved = (field, getattr(TILES, field))
                setattr(TILES, field, tuple(int(v) for v in values.split(",")))
            fn = lambda: _step(variant, x, phi, alpha, bias, w, norm_mod, up)  # noqa: E731
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ms = _time(fn, args.reps)
            name = (f"unfused ({norm_name})" if variant == "unfused"
                    else f"fused, {tile or 'default tiles'}")
            rows.append((name, ms, _kernels(fn)))
            if saved is not None:
                setattr(TILES, *saved)
        print(f"\n{T} x {C}\n\n| variant | ms | kernels (device ms) |\n|---|---|---|")
        for name, ms, kernels in rows:
            top = ", ".join(f"{k} {v:.3f}" for k, v in sorted(kernels.items(),
                                                                key=lambda kv: -kv[1]))
            print(f"| {name} | {ms:.3f} | {top} |")


if __name__ == "__main__":
    main()
