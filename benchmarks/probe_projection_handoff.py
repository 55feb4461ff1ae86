"""The projection hand-off on the GPU (``MHC_PROJECTION_HANDOFF``,
:class:`~mhc_megatron.kernels.handoff.ProjectionHandoff`): a sublayer's forward mHC work after
the combine before it, through the product's ops (no autograd), side by side:

* **shipped**: ``combine`` writes x'; ``pre`` reads x' for its projection
  (``_proj_partial``), forms the mappings, reads x' again for the aggregate;
* **hand-off**: ``combine`` forms the projection from the x' tile it writes
  (``_combine_proj_fwd``), ``pre`` takes it: one pass over x' less, per tile of
  ``TILES.combine_proj`` (tokens, channels per step, warps, loop stages);

and the combine alone both ways. ``triton.testing.do_bench`` clears L2 before every
repetition (the sublayer's GEMMs run between these ops in a training step). Bandwidth: the
chain's floor bytes (read x and f, write x', read x' once, write y: 3x + 2y) or the combine's
(2x + y) over the time. Every variant is checked against the shipped chain before it is timed:
x' bit for bit, the mappings and y to the rounding of the projection's order of additions.

    python benchmarks/probe_projection_handoff.py [--sizes 4096x4096 16384x4096] [--tiles 64,32,4,2 ...]
    TRITON_INTERPRET=1 python benchmarks/probe_projection_handoff.py --check
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import bench, probe_sizes  # noqa: E402
from mhc_megatron.kernels import reference as ref  # noqa: E402
from mhc_megatron.kernels import triton_mhc  # noqa: E402
from mhc_megatron.kernels.handoff import ProjectionHandoff  # noqa: E402
from mhc_megatron.kernels.triton_common import TILES  # noqa: E402

# (tokens, channels per step, warps, loop stages); the first is the shipped default
TILES_TRIED = [(64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 2),
               (128, 32, 8, 2), (64, 16, 4, 3), (32, 64, 4, 2)]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_size(T, n, C, tiles, bw):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    m = 2 * n + n * n
    x = torch.randn(T, n, C, generator=g).to(dev, dt)
    f = torch.randn(T, C, generator=g).to(dev, dt)
    h_res = ref.sinkhorn(torch.randn(T, n, n, generator=g), 20).to(dev)
    h_post = (2 * torch.rand(T, n, generator=g)).to(dev)
    phi = (torch.randn(m, n * C, generator=g) * 0.5 / (n * C) ** 0.5).to(dev)
    alpha = (torch.rand(3, generator=g) + 0.5).to(dev)
    bias = torch.randn(m, generator=g).to(dev)
    xb = x.numel() * x.element_size()
    chain_bytes, combine_bytes = 3 * xb + 2 * xb / n, 2 * xb + xb / n

    def shipped():
        out = triton_mhc.combine(x, f, None, h_res, h_post)
        return (out, *triton_mhc.pre(out, phi, alpha, bias, 20, 1e-6))

    def handed():
        handoff = ProjectionHandoff(phi)
        out = triton_mhc.combine(x, f, None, h_res, h_post, projection=handoff)
        return (out, *triton_mhc.pre(out, phi, alpha, bias, 20, 1e-6, projection=handoff))

    def projecting_combine():
        triton_mhc.combine(x, f, None, h_res, h_post, projection=ProjectionHandoff(phi))

    def gbs(nbytes, ms):
        return f"{nbytes / ms / 1e6:.0f} ({100 * nbytes / ms / 1e6 / bw:.0f}%)" if bw else "-"

    def timed(fn):
        return bench(fn) if bw else float("nan")

    print(f"\n### T={T} C={C} n={n} bf16\n\n| what | form | ms | GB/s of its floor bytes "
          f"(% of copy) | rel. diff (mappings / y) |\n|---|---|---|---|---|")
    with torch.no_grad():
        ref_outs = shipped()
        ms = timed(shipped)
        print(f"| chain | shipped: combine; pre projects, aggregate up | {ms:.4f} | "
              f"{gbs(chain_bytes, ms)} | - |")
        ms = timed(lambda: triton_mhc.combine(x, f, None, h_res, h_post))
        print(f"| combine | shipped | {ms:.4f} | {gbs(combine_bytes, ms)} | - |")
        old = TILES.combine_proj
        try:
            for tile in tiles:
                TILES.combine_proj = tile  # (clears the launch plans)
                outs = handed()
                assert torch.equal(outs[0], ref_outs[0]), tile
                e_maps = max(rel_err(a, b) for a, b in zip(outs[2:], ref_outs[2:]))
                e_y = rel_err(outs[1], ref_outs[1])
                assert e_maps < 1e-4 and e_y < 2e-3, (tile, e_maps, e_y)
                ms = timed(handed)
                print(f"| chain | hand-off {tile}: combine projects; aggregate down | {ms:.4f} | "
                      f"{gbs(chain_bytes, ms)} | {e_maps:.0e} / {e_y:.0e} |")
                ms = timed(projecting_combine)
                print(f"| combine | projecting {tile} | {ms:.4f} | {gbs(combine_bytes, ms)} "
                      "| - |")
        finally:
            TILES.combine_proj = old


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="*", default=["4096x4096", "16384x4096"], help="TxC")
    p.add_argument("--tiles", nargs="*", default=None,
                   help="tokens,channels,warps,stages each (default: TILES_TRIED)")
    p.add_argument("--check", action="store_true", help="correctness only, small sizes")
    args = p.parse_args()
    tiles = ([tuple(int(v) for v in t.split(",")) for t in args.tiles] if args.tiles
             else TILES_TRIED)
    if args.check and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("--check on CPU needs TRITON_INTERPRET=1")
    probe_sizes(args.sizes, args.check,
                lambda T, C, bw: run_size(T, 4, C, tiles if bw else tiles[:2], bw),
                check_sizes=((37, 40), (70, 130)))


if __name__ == "__main__":
    main()
