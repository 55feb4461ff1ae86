"""Coordinate search of the Triton kernels' tile sizes on the GPU (n=4, bf16).

For each group of ``triton_mhc.TILES`` in turn it times the op that group drives over a few
candidates, keeps the fastest, and goes on to the next group; it prints every timing and
writes the result as JSON for ``bench_mhc.py --tiles``. The chosen values are then copied
into ``KernelTiles``' defaults by hand (with the table that justifies them).

    python benchmarks/tune_tiles.py [--size 16384x4096] [--out tiles.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import EPS, ITERS, Case, bench  # noqa: E402
from mhc_megatron.kernels import triton_mhc  # noqa: E402

T = triton_mhc.TILES


def ops(cs):
    x, phi, alpha, bias, f, fb = cs.x, cs.phi, cs.alpha, cs.bias, cs.f, cs.fb
    with torch.no_grad():
        _, hp, hq, hr = triton_mhc.pre(x, phi, alpha, bias, ITERS, EPS)
    xl = x.detach().clone().requires_grad_()
    pl = [t.detach().clone().requires_grad_() for t in (phi, alpha, bias)]
    outs = triton_mhc.pre(xl, *pl, ITERS, EPS)
    grads = [cs.gy, torch.randn_like(hp), torch.randn_like(hq), torch.randn_like(hr)]
    ls = [t.detach().clone().requires_grad_() for t in (x, f, fb, hr, hq)]
    out = triton_mhc.combine(*ls)

    def pre_fwd():
        with torch.no_grad():
            triton_mhc.pre(x, phi, alpha, bias, ITERS, EPS)

    def post_fwd():
        with torch.no_grad():
            triton_mhc.combine(x, f, fb, hr, hq)

    return {
        "pre fwd": pre_fwd,
        "post fwd": post_fwd,
        "pre bwd": lambda: torch.autograd.grad(outs, [xl] + pl, grads, retain_graph=True),
        "post bwd": lambda: torch.autograd.grad(out, ls, cs.gx, retain_graph=True),
    }


GROUPS = [  # (TILES field, op it drives, candidates)
    ("proj", "pre fwd", [{4: v} for v in [(64, 64, 8, 3), (64, 128, 8, 3), (64, 128, 4, 3),
                                         (128, 64, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4),
                                         (32, 256, 4, 3), (64, 256, 8, 2), (64, 128, 8, 4),
                                         (128, 128, 8, 2), (64, 64, 4, 4)]]),
    ("target_programs", "pre fwd", [512, 1024, 2048, 4096]),
    ("sweep", "pre fwd", [(16, 256, 4), (8, 256, 4), (32, 256, 4), (16, 512, 4), (8, 512, 4),
                          (16, 512, 8), (32, 512, 8), (4, 1024, 4), (8, 1024, 8)]),
    ("map_tokens", "pre bwd", [16, 32, 64]),
    ("dx", "pre bwd", [(32, 64, 4), (16, 64, 4), (64, 64, 4), (32, 128, 4), (32, 128, 8),
                       (64, 128, 8), (16, 128, 4), (32, 32, 4), (64, 32, 4), (128, 64, 4),
                       (128, 32, 4), (64, 64, 8)]),
    ("combine_fwd", "post fwd", [(8, 128, 4), (4, 128, 4), (16, 128, 4), (8, 256, 4),
                                 (4, 256, 4), (8, 256, 8), (16, 64, 4), (2, 512, 4)]),
    ("combine_bwd", "post bwd", [(8, 128, 4), (4, 128, 4), (16, 128, 4), (8, 256, 8),
                                 (4, 256, 4), (16, 64, 4), (2, 256, 4), (4, 512, 8)]),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="16384x4096")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    m, c = (int(v) for v in args.size.split("x"))
    cs = Case(m, c)
    print(f"{torch.cuda.get_device_name()}; M={m} C={c} n=4 bf16; ms (median of do_bench)")
    for field, op, candidates in GROUPS:
        best = None
        for cand in candidates:
            value = {**T.proj, **cand} if field == "proj" else cand
            setattr(T, field, value)
            try:
                ms = bench(ops(cs)[op], rep=100)
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                print(f"  {field}={cand}: failed ({type(exc).__name__})")
                continue
            print(f"  {field}={cand}: {op} {ms:.3f} ms", flush=True)
            if best is None or ms < best[0]:
                best = (ms, value)
        setattr(T, field, best[1])
        print(f"{field}: best {best[1]} ({best[0]:.3f} ms)", flush=True)
    tiles = {k: v for k, v in dataclasses.asdict(T).items()}
    tiles["proj"] = {str(k): v for k, v in tiles["proj"].items()}
    print(json.dumps(tiles))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(tiles, fh)


if __name__ == "__main__":
    main()
