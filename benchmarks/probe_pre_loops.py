"""Two loop forms of pre's streaming kernels, against the shipped ones (GPU; ``--check`` runs
on the interpreter), each launched exactly as pre launches it (its plan's grid and meta):

* ``_dhpre_partial`` (dH_pre partials: reads x and dy, no ``tl.dot``, so the launch's
  ``num_stages`` pipelines none of its loads): ``pipelined S``, its channel loop as
  ``tl.range(..., num_stages=S)``;
* ``_proj_partial`` (projection partials: x and phi feed the dots, pipelined): ``ss
  deferred``, the sum of squares kept elementwise over the K steps and reduced once after
  the loop, instead of a cross-thread reduction every step.

A variant's outputs are checked against the shipped kernel's (exact, or fp32 rounding for a
changed reduction order) before it is timed; ms is the median of ``bench``, % of copy
bandwidth for the kernel's floor bytes (x read, plus dy for dH_pre).

    python benchmarks/probe_pre_loops.py [--sizes 4096x4096 16384x4096]
    TRITON_INTERPRET=1 python benchmarks/probe_pre_loops.py --check
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import bench, probe_sizes  # noqa: E402
from kernel_variants import edited_kernel  # noqa: E402
from mhc_megatron.kernels import triton_pre as tp  # noqa: E402
from mhc_megatron.kernels.triton_common import forced_precision, plan  # noqa: E402

IMPORTS = ("from mhc_megatron.kernels.triton_common import stream_strides, token_block, "
           "token_rows")
DH_LOOP = "for c0 in range(c_start, c_start + C_PER_SPLIT, BC):"
SS_STEP = "ss += tl.sum(xf * xf, axis=1)"


def variants():
    dh = [(f"pipelined {s}", edited_kernel(tp._dhpre_partial, [(DH_LOOP, DH_LOOP.replace(
        "range(", "tl.range(").replace("BC):", f"BC, num_stages={s}):"))], IMPORTS))
        for s in (2, 3)]
    proj = [("ss deferred", edited_kernel(tp._proj_partial, [
        ("ss = tl.zeros([BT], dtype=tl.float32)", "ss2 = tl.zeros([BT, BK], dtype=tl.float32)"),
        (SS_STEP, "ss2 += xf * xf"),
        ("row = split.to(tl.int64) * T + t64", "ss = tl.sum(ss2, axis=1)\n"
                                               "    row = split.to(tl.int64) * T + t64")],
        IMPORTS))]
    return dh, proj


def run_size(T, n, C, dh_variants, proj_variants, bw):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(T, n, C, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, C, device=dev, dtype=torch.bfloat16)
    m = 2 * n + n * n
    phi = torch.randn(m, n * C, device=dev) * (n * C) ** -0.5
    fwd = plan(tp._PreForwardPlan, T, n, C, x.dtype, forced_precision(), False)
    bwd = plan(tp._PreBackwardPlan, T, n, C, x.dtype, forced_precision(), True, True, False)
    rows = []

    def dh_launch(kern):
        part = torch.full((bwd.dh_splits, T, n), float("nan"), device=dev)
        return (lambda: kern[bwd.dh_grid](x, dy, part, T, C, bwd.dh_per,
                                          **bwd.dh_meta.kwargs)), (part,)

    def proj_launch(kern):
        part = torch.full((fwd.splits, T, fwd.mp), float("nan"), device=dev)
        ss = torch.full((fwd.splits, T), float("nan"), device=dev)
        return (lambda: kern[fwd.proj_grid](x, phi, part, ss, T, fwd.K, C, fwd.per,
                                            **fwd.proj_meta.kwargs)), (part, ss)

    xb = x.numel() * x.element_size()
    for name, ship, launch, nbytes, others in (
            ("_dhpre_partial", tp._dhpre_partial, dh_launch, xb + dy.numel() * 2, dh_variants),
            ("_proj_partial", tp._proj_partial, proj_launch, xb, proj_variants)):
        run, ref = launch(ship)
        run()
        rows.append((name, "shipped", run, nbytes, "-"))
        for vname, kern in others:
            vrun, outs = launch(kern)
            vrun()
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(outs, ref))
            assert err < 1e-5, (name, vname, err)
            rows.append((name, vname, vrun, nbytes, f"{err:.0e}"))
    print(f"\n### T={T} C={C} n={n} bf16\n\n| kernel | variant | ms | % of copy BW | rel. diff |"
          "\n|---|---|---|---|---|")
    for name, vname, run, nbytes, err in rows:
        if bw is None:
            print(f"| {name} | {vname} | - | - | {err} |")
            continue
        ms = bench(run)
        print(f"| {name} | {vname} | {ms:.4f} | {nbytes / ms / 1e6 / bw:.0%} | {err} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="*", default=["4096x4096", "16384x4096"], help="TxC")
    p.add_argument("--check", action="store_true", help="correctness only, small sizes")
    args = p.parse_args()
    dh, proj = variants()
    probe_sizes(args.sizes, args.check, lambda T, C, bw: run_size(T, 4, C, dh, proj, bw))


if __name__ == "__main__":
    main()
