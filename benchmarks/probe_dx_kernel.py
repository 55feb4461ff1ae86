"""What holds ``_pre_dx_dphi`` below copy bandwidth: the shipped kernel against variants of
itself with parts removed, launched exactly as pre's backward launches it (GPU only).

The variants are built from the kernel's own source (``inspect``), with one line edited each,
written to a temporary module and compiled; the product code is not touched:

* ``shipped``: as in mhc_megatron/kernels/triton_mhc.py;
* ``no dphi dot``: without ``dphi += dP^T x`` (dphi stays zero);
* ``no dx dot``: without the ``dP @ phi`` term of dx (dP still loaded and read);
* ``no dots``: neither dot (dP still loaded): the same loads and stores, elementwise only;
  dP is kept alive by a column sum folded into dphi, a cross-warp reduction that is not free
  itself (``no dphi dot`` runs slower than ``shipped``), so this time is an upper bound of
  the streaming part;
* ``plain loop``: the kernel before 2026-11-25, its token loop a plain ``range``, where the
  launch's ``num_stages`` pipelines only the loads that feed a dot (dP, x), not dy and the
  combine's dx (now its upstream gradient g, n stream tiles a step); the shipped kernel
  pipelines the loop as a whole (``tl.range(...,
  num_stages=TILES.dx[3])``); ``loop stages 2``: the same with 2 stages;
* ``dphi transposed``: ``dphi^T += x^T dP`` (channels as the dot's M dimension), and the same
  with x as bf16 and dP split into bf16 hi + lo;
* ``copy``: torch's device copy of the same bytes (read 3 x-sized + y-sized, write 1).

Since the fold (2026-11-25, :class:`~mhc_megatron.kernels.handoff.DxLink`) the kernel reads
the combine's upstream gradient ``g`` (its n stream tiles a step, n-1 of them from L2) instead
of the combine's dx; rows measured before that read the dx.

    python benchmarks/probe_dx_kernel.py [--size 16384x4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import bench, copy_bandwidth  # noqa: E402
from kernel_variants import edited_kernel  # noqa: E402
from mhc_megatron.kernels import triton_mhc as tm  # noqa: E402

DX_DOT = "tl.dot(dp, ph, input_precision=PREC) + "
DPHI_DOT = "dphi = tl.dot(tl.trans(dp), xs, dphi, input_precision=PREC)"
LOOP = "for t0 in tl.range(t_start, t_start + TOKENS_PER_SPLIT, BT, num_stages=LOOP_STAGES):"
LOOP_STAGED = "for t0 in tl.range(t_start, t_start + TOKENS_PER_SPLIT, BT, num_stages={}):"
KEEP_DP = "dphi += tl.sum(dp, axis=0)[:, None] * 0.0  # dP stays loaded"
VARIANTS = {
    "shipped": [],
    "no dphi dot": [(DPHI_DOT, KEEP_DP)],
    "no dx dot": [(DX_DOT, "")],
    "no dots": [(DX_DOT, ""), (DPHI_DOT, KEEP_DP)],
    # dphi^T = x^T dP: the token axis as K, the channel block (not the 32 padded mapping
    # columns) as the dot's M, so the dot can take Hopper's 64-row tensor-core path
    # the token loop software-pipelined as a whole: the launch's num_stages pipelines only the
    # loads that feed a tl.dot (dP, x), not dy and the combine's dx
    "plain loop": [(LOOP, "for t0 in range(t_start, t_start + TOKENS_PER_SPLIT, BT):")],
    "loop stages 2": [(LOOP, LOOP_STAGED.format(2))],
    "dphi transposed": [("dphi = tl.zeros([MP, BC]", "dphi = tl.zeros([BC, MP]"),
                        (DPHI_DOT, "dphi = tl.dot(tl.trans(xs), dp, dphi, input_precision=PREC)"),
                        ("k[None, :], dphi,", "k[None, :], tl.trans(dphi),")],
    "dphi transposed, bf16 x": [
        ("dphi = tl.zeros([MP, BC]", "dphi = tl.zeros([BC, MP]"),
        (DPHI_DOT, "dp_hi = dp.to(tl.bfloat16)\n        dp_lo = (dp - dp_hi.to(tl.float32))"
                   ".to(tl.bfloat16)\n        xb = tl.trans(xs.to(tl.bfloat16))\n"
                   "        dphi = tl.dot(xb, dp_lo, tl.dot(xb, dp_hi, dphi))"),
        ("k[None, :], dphi,", "k[None, :], tl.trans(dphi),")],
}


def kernel_variant(edits):
    """``_pre_dx_dphi`` with ``edits`` (old, new) applied to its source."""
    return edited_kernel(tm._pre_dx_dphi, edits,
                         "from mhc_megatron.kernels.triton_common import stream_strides")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="16384x4096")
    args = p.parse_args()
    T, C = (int(v) for v in args.size.split("x"))
    n, dt, dev = 4, torch.bfloat16, "cuda"
    m, mp, K = 2 * n + n * n, tm._padded_m(n), n * C
    x = torch.randn(T, n, C, device=dev, dtype=dt)
    g = torch.randn_like(x)  # the combine's upstream gradient (the fold, DxLink)
    h_res = torch.rand(T, n, n, device=dev)
    dy = torch.randn(T, C, device=dev, dtype=dt)
    h_pre = torch.rand(T, n, device=dev)
    dp = torch.randn(T, mp, device=dev) * 1e-2
    coef = torch.randn(T, device=dev) * 1e-3
    phi = torch.randn(m, K, device=dev) * K ** -0.5
    dx = torch.empty_like(x)
    bt, bc, warps, stages = tm.TILES.dx
    blocks = n * triton.cdiv(C, bc)
    splits, per = tm._splits(blocks, T, bt)
    dphi = torch.zeros(splits, mp, K, device=dev)
    prec = tm._dot_precision(dt, os.environ.get("MHC_TRITON_DOT_PRECISION"))
    nbytes = 3 * x.numel() * x.element_size() + dy.numel() * dy.element_size()  # x, g, dx
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; _pre_dx_dphi at T={T} C={C} n=4 bf16, tiles "
          f"{tm.TILES.dx}, grid ({blocks}, {splits}); {nbytes / 1e9:.3f} GB moved; "
          f"copy bandwidth {bw:.0f} GB/s")
    print("| variant | ms | GB/s | % of copy BW |\n|---|---|---|---|")
    for name, edits in VARIANTS.items():
        kern = kernel_variant(edits)

        def run(kern=kern):
            kern[(blocks, splits)](x, dy, h_pre, dp, coef, phi, g, h_res, dx, dphi, T, C,
                                   per, HAS_G=True, N=n, M=m, MP=mp, BT=bt, BC=bc, PREC=prec,
                                   X_BCAST=False, LOOP_STAGES=stages, num_warps=warps,
                                   num_stages=stages)
        ms = bench(run)
        if name == "shipped":
            ref_dx, ref_dphi = dx.clone(), dphi.clone()
        elif name.startswith(("dphi", "loop", "plain")):  # same results as the shipped kernel?
            run()
            err = ((dphi - ref_dphi).norm() / ref_dphi.norm()).item()
            assert torch.equal(dx, ref_dx) and err < 1e-2, (name, err)
            name = f"{name} (dphi rel. diff {err:.1e})"
        print(f"| {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | {nbytes / ms / 1e6 / bw:.0%} |")
    src = torch.empty(nbytes // 4, device=dev, dtype=dt)  # reads nbytes/2, writes nbytes/2
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    gbs = nbytes / ms / 1e6
    print(f"| copy (same bytes) | {ms:.3f} | {gbs:.0f} | {gbs / bw:.0%} |")


if __name__ == "__main__":
    main()
