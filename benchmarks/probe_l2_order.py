"""Two ways to spend fewer DRAM bytes between mHC's kernels, measured on the GPU against the
shipped kernels (``--check`` runs the correctness part on the interpreter):

1. **The order in which consecutive kernels walk the tokens** (L2 reuse). Forward chain
   ``_combine_fwd`` (writes x') -> ``_proj_partial`` (reads x') -> ``_aggregate_fwd`` (reads
   x'), as shipped (:func:`~mhc_megatron.kernels.triton_common.token_rows`: 1-D grids
   walked token block by token block, up / down / up, so each kernel starts on the rows the
   one before touched last, still in L2), all up, and as before ``token_rows`` (2-D grids
   with the token block fastest: column stripe by column stripe). Backward chain
   ``_dhpre_partial`` -> ``_pre_dx_dphi`` -> ``_combine_bwd`` of the sublayer before, with
   the dx pass's token loop and the combine's backward walking down.
2. **The fold** (shipped: :class:`~mhc_megatron.kernels.handoff.DxLink`): the combine's
   backward writes no dx, and pre's dx pass adds ``H_res^T g`` from the combine's upstream
   gradient ``g`` (one x-sized write and read less), each (stream, channel block) program
   reading the n stream tiles of ``g`` (n-1 of them from L2); against the form before it
   (the combine writes dx, the dx pass adds it); and ``_dx_fold_rows``, one program for all
   n streams of a channel block (2-D dots over ``[tokens, n * channels]`` tiles, ``g`` read
   once and mixed per token), at several tiles.

``triton.testing.do_bench`` clears L2 before every repetition, as the sublayer's GEMMs do
before these chains in a training step. Every variant's outputs are checked against the
shipped kernels' (the same values; fp32 rounding where a loop runs the other way; bf16
rounding for the fold, whose combine dx is not rounded to bf16 first) before it is timed.

    python benchmarks/probe_l2_order.py [--sizes 4096x4096 16384x4096]
    TRITON_INTERPRET=1 python benchmarks/probe_l2_order.py --check
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import bench, probe_sizes  # noqa: E402
from kernel_variants import edited_kernel  # noqa: E402
from mhc_megatron.kernels import triton_combine as tc  # noqa: E402
from mhc_megatron.kernels import triton_pre as tp  # noqa: E402
from mhc_megatron.kernels.launch import cdiv  # noqa: E402
from mhc_megatron.kernels.triton_common import forced_precision, plan  # noqa: E402

@triton.jit
def _dx_fold_rows(x_ptr, dy_ptr, hpre_ptr, hres_ptr, dp_ptr, coef_ptr, phi_ptr, g_ptr, dx_ptr,
                  dphi_ptr, T, C, TOKENS_PER_SPLIT, N: tl.constexpr, M: tl.constexpr,
                  MP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                  LOOP_STAGES: tl.constexpr):
    """The fold with all N streams of a channel block in one program: tile columns
    ``j < N*BC`` are (stream ``j // BC``, channel ``cb*BC + j % BC``), so both dots stay 2-D
    (``dP @ phi[:, cols]``, ``dP^T x[:, cols]``) for any N, and the combine's upstream ``g``
    is read once, ``[BT, N, BC]``, mixed by ``H_res^T`` per token and laid flat."""
    cb = tl.program_id(0)
    split = tl.program_id(1)
    K = N * C
    j = tl.arange(0, N * BC)
    s_j = j // BC
    c_j = cb * BC + j % BC
    cmask = c_j < C
    k_j = s_j * C + c_j
    cc = cb * BC + tl.arange(0, BC)
    i = tl.arange(0, N)
    mcol = tl.arange(0, MP)
    ph = tl.load(phi_ptr + mcol[:, None].to(tl.int64) * K + k_j[None, :],
                 mask=(mcol[:, None] < M) & cmask[None, :], other=0.0).to(tl.float32)
    dphi = tl.zeros([MP, N * BC], dtype=tl.float32)
    t_start = split * TOKENS_PER_SPLIT
    for t0 in tl.range(t_start, t_start + TOKENS_PER_SPLIT, BT, num_stages=LOOP_STAGES):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        m2 = tmask[:, None] & cmask[None, :]
        dp = tl.load(dp_ptr + t64[:, None] * MP + mcol[None, :], mask=tmask[:, None], other=0.0)
        coef = tl.load(coef_ptr + t, mask=tmask, other=0.0)
        hp = tl.load(hpre_ptr + t64[:, None] * N + s_j[None, :], mask=tmask[:, None], other=0.0)
        dy = tl.load(dy_ptr + t64[:, None] * C + c_j[None, :], mask=m2, other=0.0).to(tl.float32)
        offs = t64[:, None] * K + k_j[None, :]
        xs = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        m3 = tmask[:, None, None] & (cc < C)[None, None, :]
        g3 = tl.load(g_ptr + t64[:, None, None] * K + i[None, :, None] * C + cc[None, None, :],
                     mask=m3, other=0.0).to(tl.float32)
        h3 = tl.load(hres_ptr + t64[:, None, None] * (N * N) + i[None, :, None] * N
                     + i[None, None, :], mask=tmask[:, None, None], other=0.0)  # [t, i, s]
        r = tl.sum(h3[:, :, :, None] * g3[:, :, None, :], axis=1)  # [t, s, c]
        dxs = (tl.dot(dp, ph, input_precision=PREC) + coef[:, None] * xs + hp * dy
               + tl.reshape(r, [BT, N * BC]))
        tl.store(dx_ptr + offs, dxs.to(dx_ptr.dtype.element_ty), mask=m2)
        dphi = tl.dot(tl.trans(dp), xs, dphi, input_precision=PREC)
    tl.store(dphi_ptr + split.to(tl.int64) * MP * K + mcol[:, None] * K + k_j[None, :], dphi,
             mask=cmask[None, :])


# (tokens, channels, warps, loop stages)
FOLD_TILES = [(16, 32, 4, 2), (16, 32, 4, 3), (32, 32, 4, 2), (16, 64, 8, 2), (32, 32, 8, 2)]


IMPORTS = ("from mhc_megatron.kernels.triton_common import stream_strides, token_block, "
           "token_rows, _aggregate_tile")
TOKEN_BLOCK = "t, tmask, t64 = token_block(T, BT)"
DX_FOLD = """        if HAS_G:  # g's N stream tiles, shared by the N programs of a block (L2)
            for i in tl.static_range(N):
                g_i = tl.load(g_ptr + t64[:, None] * K + i * C + c[None, :], mask=m2,
                              other=0.0).to(tl.float32)
                h_is = tl.load(hres_ptr + t64 * (N * N) + i * N + s, mask=tmask, other=0.0)
                dxs += h_is[:, None] * g_i"""
DX_ACC = """        if HAS_G:  # before the fold: g_ptr is the combine's dx
            dxs += tl.load(g_ptr + offs, mask=m2, other=0.0).to(tl.float32)"""


ROWS_C = "cb, t, tmask, t64 = token_rows(T, BT, tl.cdiv(C, BC), False)"
ROWS_K = "split, t, tmask, t64 = token_rows(T, BT, tl.cdiv(K, K_PER_SPLIT), True)"


def column_stripes(kernel, rows: str, inner: str):
    """``kernel`` as it was before ``token_rows``: a 2-D (token block, ``inner``) grid with
    the token block fastest, i.e. walked column stripe by column stripe."""
    return edited_kernel(kernel, [(rows, f"t, tmask, t64 = token_block(T, BT)\n"
                                         f"    {inner} = tl.program_id(1)")], IMPORTS)


def variants():
    comb = column_stripes(tc._combine_fwd, ROWS_C, "cb")
    proj = column_stripes(tp._proj_partial, ROWS_K, "split")
    agg = column_stripes(tp._aggregate_fwd, ROWS_C, "cb")
    proj_up = edited_kernel(tp._proj_partial, [(ROWS_K, ROWS_K.replace("True)", "False)"))],
                            IMPORTS)
    dx_down = edited_kernel(tp._pre_dx_dphi, [(
        "for t0 in tl.range(t_start, t_start + TOKENS_PER_SPLIT, BT, num_stages=LOOP_STAGES):",
        "for i0 in tl.range(0, TOKENS_PER_SPLIT, BT, num_stages=LOOP_STAGES):\n"
        "        t0 = t_start + TOKENS_PER_SPLIT - BT - i0")], IMPORTS)
    cbwd_down = edited_kernel(tc._combine_bwd, [
        (TOKEN_BLOCK, "_, t, tmask, t64 = token_rows(T, BT, 1, True)")], IMPORTS)
    # before the fold: the combine's backward wrote dx, pre's dx pass added it
    dx_acc = edited_kernel(tp._pre_dx_dphi, [(DX_FOLD, DX_ACC)], IMPORTS)
    return {"comb": comb, "proj": proj, "agg": agg, "proj_up": proj_up, "dx_down": dx_down,
            "cbwd_down": cbwd_down, "dx_acc": dx_acc}


def run_size(T, n, C, v, bw):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    m = 2 * n + n * n
    x0 = torch.randn(T, n, C, device=dev, dtype=dt, generator=g)
    f = torch.randn(T, C, device=dev, dtype=dt, generator=g)
    hres = torch.rand(T, n, n, device=dev, generator=g)
    hpost = torch.rand(T, n, device=dev, generator=g)
    hpre = torch.rand(T, n, device=dev, generator=g)
    phi = torch.randn(m, n * C, device=dev, generator=g) * (n * C) ** -0.5
    dy = torch.randn(T, C, device=dev, dtype=dt, generator=g)
    acc = torch.randn(T, n, C, device=dev, dtype=dt, generator=g)
    fp = plan(tc._CombinePlan, T, n, C, False, False)
    pf = plan(tp._PreForwardPlan, T, n, C, dt, forced_precision(), False)
    ag = plan(tp._AggregatePlan, T, n, C, False)
    pb = plan(tp._PreBackwardPlan, T, n, C, dt, forced_precision(), True, True, False)
    xp = torch.empty_like(x0)
    part = torch.empty(pf.splits, T, pf.mp, device=dev)
    ss = torch.empty(pf.splits, T, device=dev)
    y = torch.empty(T, C, device=dev, dtype=dt)
    dhp = torch.empty(pb.dh_splits, T, n, device=dev)
    dp = torch.randn(T, pb.mp, device=dev, generator=g) * 1e-2
    coef = torch.randn(T, device=dev, generator=g) * 1e-3
    gx = torch.empty_like(x0)
    dphi = torch.empty(pb.dx_splits, pb.mp, pb.K, device=dev)
    dxc, dfc = torch.empty_like(x0), torch.empty_like(f)
    dhr, dhpo = torch.empty(T, n, n, device=dev), torch.empty(T, n, device=dev)
    cb_grid = fp.bwd_grid

    def fwd(comb, proj, agg, grids):
        def run():
            comb[grids[0]](x0, f, f, hres, hpost, xp, hpost, f, T, C, **fp.fwd_meta.kwargs)
            proj[grids[1]](xp, phi, part, ss, T, pf.K, C, pf.per, **pf.proj_meta.kwargs)
            agg[grids[2]](xp, hpre, y, T, C, **ag.meta.kwargs)
        return run, (xp, part, ss, y)

    g_up = torch.randn(T, n, C, device=dev, dtype=dt, generator=g)

    def bwd(dx, cbwd):  # dH_pre, dx (the fold, as shipped), the sublayer before's combine
        def run():
            tp._dhpre_partial[pb.dh_grid](x0, dy, dhp, T, C, pb.dh_per, **pb.dh_meta.kwargs)
            dx[pb.dx_grid](x0, dy, hpre, dp, coef, phi, g_up, hres, gx, dphi, T, C, pb.dx_per,
                           **pb.dx_meta.kwargs)
            cbwd[cb_grid](gx, x0, f, f, hres, hpost, dxc, dfc, dhr, dhpo, T, C,
                          **fp.bwd_fold_meta.kwargs)
        return run, (dhp, gx, dphi, dfc, dhr, dhpo)

    stripes = ((cdiv(T, fp.fwd_meta.kwargs["BT"]), cdiv(C, fp.fwd_meta.kwargs["BC"])),
               (cdiv(T, pf.proj_meta.kwargs["BT"]), pf.splits),
               (cdiv(T, ag.meta.kwargs["BT"]), cdiv(C, ag.meta.kwargs["BC"])))
    shipped = (fp.fwd_grid, pf.proj_grid, ag.grid)
    cases = [
        ("forward", "shipped: token rows, up / down / up",
         *fwd(tc._combine_fwd, tp._proj_partial, tp._aggregate_fwd, shipped)),
        ("forward", "token rows, all up", *fwd(tc._combine_fwd, v["proj_up"],
                                              tp._aggregate_fwd, shipped)),
        ("forward", "column stripes (before token_rows)",
         *fwd(v["comb"], v["proj"], v["agg"], stripes)),
        ("backward", "shipped", *bwd(tp._pre_dx_dphi, tc._combine_bwd)),
        ("backward", "dx loop descending", *bwd(v["dx_down"], tc._combine_bwd)),
        ("backward", "dx loop descending, combine bwd descending",
         *bwd(v["dx_down"], v["cbwd_down"])),
    ]
    def cbwd_only(meta):
        def run():
            tc._combine_bwd[cb_grid](g_up, x0, f, f, hres, hpost, acc, dfc, dhr, dhpo, T, C,
                                     **meta.kwargs)
        return run, (dfc, dhr, dhpo)

    def dx_pass(fold):
        if fold:  # as shipped: H_res^T g formed in the dx pass
            return lambda: tp._pre_dx_dphi[pb.dx_grid](
                x0, dy, hpre, dp, coef, phi, g_up, hres, gx, dphi, T, C, pb.dx_per,
                **pb.dx_meta.kwargs)
        return lambda: v["dx_acc"][pb.dx_grid](  # before: adds the combine's dx (acc)
            x0, dy, hpre, dp, coef, phi, acc, hres, gx, dphi, T, C, pb.dx_per,
            **pb.dx_meta.kwargs)

    def pair(fold):
        def run():
            cbwd_only(fp.bwd_fold_meta if fold else fp.bwd_meta)[0]()
            dx_pass(fold)()
        return run, (gx, dphi)

    cases += [
        ("combine bwd", "shipped, linked to pre: no dx", *cbwd_only(fp.bwd_fold_meta)),
        ("combine bwd", "before the fold: writes dx", *cbwd_only(fp.bwd_meta)),
        ("pair (L2 keeps some of dx)", "shipped: the dx pass adds H_res^T g", *pair(True)),
        ("pair (L2 keeps some of dx)", "before: combine bwd writes dx, dx pass adds it",
         *pair(False)),
    ]
    fold_rows = {}
    for bt, bc, warps, stages in FOLD_TILES if bw else FOLD_TILES[:1]:
        bc = min(bc, max(16, triton.next_power_of_2(C)))
        nb = triton.cdiv(C, bc)
        splits = max(1, min(triton.cdiv(512, nb), triton.cdiv(T, bt)))
        per = triton.cdiv(triton.cdiv(T, splits), bt) * bt
        splits = triton.cdiv(T, per)
        part = torch.empty(splits, pb.mp, pb.K, device=dev)

        def run(bt=bt, bc=bc, warps=warps, stages=stages, nb=nb, splits=splits, per=per,
                part=part):
            _dx_fold_rows[(nb, splits)](x0, dy, hpre, hres, dp, coef, phi, g_up, gx, part, T, C,
                                        per, N=n, M=pb.m, MP=pb.mp, BT=bt, BC=bc,
                                        PREC=pb.dx_meta.kwargs["PREC"], LOOP_STAGES=stages,
                                        num_warps=warps, num_stages=stages)
        fold_rows[(bt, bc, warps, stages)] = (run, part)
    single = {"dx pass alone, shipped (the fold)": dx_pass(True),
              "dx pass alone, before the fold (adds the combine's dx)": dx_pass(False)}
    tol = {"pair (L2 keeps some of dx)": 2e-2}
    ref = {}
    print(f"\n### T={T} C={C} n={n} bf16\n\n| chain | order | ms | rel. diff |\n|---|---|---|---|")
    for chain, name, run, outs in cases:
        run()
        got = [o.float().clone() for o in outs]
        if chain not in ref:
            ref[chain], err = got, 0.0
        else:
            err = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                      for a, b in zip(got, ref[chain]))
        assert err < tol.get(chain, 1e-4), (chain, name, err)
        ms = bench(run) if bw else float("nan")
        print(f"| {chain} | {name} | {ms:.4f} | {err:.0e} |")
    for name, run in single.items():
        run()
        print(f"| dx pass | {name} | {bench(run) if bw else float('nan'):.4f} | - |")
    # reference: the shipped dx pass's dx and dphi (summed over its splits)
    dx_pass(True)()
    ref_dx, ref_dphi = gx.float().clone(), dphi.sum(0)
    for tile, (run, part) in fold_rows.items():
        gx.zero_()
        run()
        e_dx = ((gx.float() - ref_dx).norm() / ref_dx.norm()).item()
        e_dphi = ((part.sum(0) - ref_dphi).norm() / ref_dphi.norm()).item()
        assert e_dx < 2e-2 and e_dphi < 1e-4, (tile, e_dx, e_dphi)
        ms = bench(run) if bw else float("nan")
        print(f"| dx pass | fold, all streams a program {tile} | {ms:.4f} | "
              f"{e_dx:.0e} / {e_dphi:.0e} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="*", default=["4096x4096", "16384x4096"], help="TxC")
    p.add_argument("--check", action="store_true", help="correctness only, small sizes")
    args = p.parse_args()
    v = variants()
    probe_sizes(args.sizes, args.check, lambda T, C, bw: run_size(T, 4, C, v, bw))


if __name__ == "__main__":
    main()
