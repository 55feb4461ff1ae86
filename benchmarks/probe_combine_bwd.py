"""What holds ``_combine_bwd`` (combine's backward: dx, df, dH_res, dH_post) below copy
bandwidth: the shipped kernel (its unlinked form, with dx) against variants, each launched as
``_CombineFn.backward`` launches it (same arguments, grid ``cdiv(T, tokens)``, ``BC =
min(channels, next_pow2(C))``), n=4, bf16, with a bias. Source variants are the shipped
source (``inspect``) with lines edited, compiled from a temporary module; the product code
is not touched:

* ``shipped`` at ``TILES.combine_bwd`` (its channel loop software-pipelined, ``LOOP_STAGES``
  stages); ``loop stages S``: the same kernel with S stages (1: a plain loop, the kernel
  before 2026-11-25; the launch's ``num_stages`` does not pipeline a loop without
  ``tl.dot``: measured, the same binary);
* ``no dH reductions``: no d_post / dH_res sums (zeros, not checked); x and f kept loaded by
  ``+ 0.0 * x`` in dx / df. The layout changes of the [BT, N, BC] form remain (x broadcast
  into it, dx / df out of it, the sums over the stream axis across warps);
* ``h_res hoisted``: H_res loaded once as a [BT, N, N] tile, column j taken by an exact
  ``where`` + sum, instead of n column loads every channel step.

Hand-written n=4 kernels (the same arguments plus LOOP_STAGES; 1: a plain loop):

* ``deferred``: g as [BT, N, BC]; d_post and the n dH_res columns kept as elementwise
  [BT, N, BC] products summed over the channel steps, reduced over channels after the loop;
  H_res columns loaded once;
* ``split`` / ``split deferred``: g and x as n separate [BT, BC] tiles (and the bias as a
  [BT, BC] tile), one layout throughout: dx and df are elementwise, no layout conversion in
  the loop; dH as 20 in-warp [BT] sums a step, or 20 [BT, BC] accumulators summed at the end.

Each variant is checked against the shipped kernel (dx, df to bf16 rounding; dH fp32 to 1e-5
relative), the shipped kernel against fp32 torch math; one that disagrees is WRONG, untimed.
GB/s counts the floor: read g, x [T, n, C] and f [T, C], write dx and df.

    python benchmarks/probe_combine_bwd.py [--sizes 4096x4096 16384x4096]     # GPU
    TRITON_INTERPRET=1 python benchmarks/probe_combine_bwd.py --check       # CPU, no timing
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import bench, copy_bandwidth  # noqa: E402
from kernel_variants import edited_kernel  # noqa: E402
from mhc_megatron.kernels import triton_combine as tc  # noqa: E402
from mhc_megatron.kernels.launch import cdiv, next_pow2  # noqa: E402
from mhc_megatron.kernels.triton_common import TILES, stream_strides, token_block  # noqa: E402

N4_TILES = [(8, 128, 4), (4, 128, 4), (8, 64, 4), (4, 256, 4), (16, 64, 8)]
SPLIT_TILES = N4_TILES + [(2, 256, 4), (8, 256, 8)]  # (tokens, channels, warps)
LOOP = "for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):"
NO_DH = [("d_post += tl.sum(g3 * f[:, None, :], axis=2)", "pass"),
         ("col = tl.sum(g3 * xj[:, None, :], axis=2)", "pass"),
         ("d_res += tl.where(i[None, None, :] == j, col[:, :, None], 0.0)", "pass"),
         ("axis=1)\n        tl.store(df_ptr", "axis=1) + f * 0.0\n        tl.store(df_ptr"),
         ("h_col[:, :, None] * g3, axis=1)", "h_col[:, :, None] * g3, axis=1) + xj * 0.0")]
HOIST = [(LOOP, "h_all = tl.load(hres_ptr + t64[:, None, None] * (N * N) + (i[:, None] * N + "
                "i[None, :])[None, :, :], mask=tmask[:, None, None], other=0.0)\n    " + LOOP),
         ("h_col = tl.load(hres_ptr + t64[:, None] * (N * N) + i[None, :] * N + j,\n"
          "                                mask=tmask[:, None], other=0.0)",
          "h_col = tl.sum(tl.where(i[None, None, :] == j, h_all, 0.0), axis=2)")]


# the combine's backward as it runs unlinked (HAS_DX: it writes dx; linked to pre it writes
# none, see DxLink): the form this probe studies, with the launch arguments of its variants
DX_ON = [("LOOP_STAGES: tl.constexpr, HAS_DX: tl.constexpr):", "LOOP_STAGES: tl.constexpr):"),
         ("if HAS_DX:", "if True:  # HAS_DX")]


def kernel_variant(edits):
    """``_combine_bwd`` (with dx) with ``edits`` (old, new) applied to its source."""
    return edited_kernel(tc._combine_bwd, DX_ON + edits, "from mhc_megatron.kernels."
                         "triton_common import stream_strides, token_block")


@triton.jit
def _stream3(acc, g3, h_col, x_ptrs, dx_ptrs, mask):
    """Stream j of a channel step: stores dx_j = sum_i H_res[i, j] g_i, returns acc + g x_j."""
    xj = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptrs, tl.sum(h_col * g3, axis=1).to(dx_ptrs.dtype.element_ty), mask=mask)
    return acc + g3 * xj[:, None, :]


@triton.jit
def _bwd_deferred4(g_ptr, x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, dx_ptr, df_ptr,
                   dhres_ptr, dhpost_ptr, T, C, HAS_BIAS: tl.constexpr, N: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, X_BCAST: tl.constexpr,
                   LOOP_STAGES: tl.constexpr):
    tl.static_assert(N == 4)
    t, tmask, t64 = token_block(T, BT)
    K = N * C
    XT, XS = stream_strides(N, C, X_BCAST)
    i = tl.arange(0, N)
    hp = tl.load(hpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    hcol = hres_ptr + t64[:, None] * (N * N) + i[None, :] * N  # + j: H_res[:, :, j]
    h0 = tl.load(hcol, mask=tmask[:, None], other=0.0)[:, :, None]
    h1 = tl.load(hcol + 1, mask=tmask[:, None], other=0.0)[:, :, None]
    h2 = tl.load(hcol + 2, mask=tmask[:, None], other=0.0)[:, :, None]
    h3 = tl.load(hcol + 3, mask=tmask[:, None], other=0.0)[:, :, None]
    z = tl.zeros([BT, N, BC], dtype=tl.float32)
    ap, a0, a1, a2, a3 = z, z, z, z, z
    for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        g3 = tl.load(g_ptr + t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :],
                     mask=m2[:, None, :], other=0.0).to(tl.float32)
        f = tl.load(f_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            f += tl.load(fbias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
        df = tl.sum(g3 * hp[:, :, None], axis=1)
        tl.store(df_ptr + t64[:, None] * C + c[None, :], df.to(df_ptr.dtype.element_ty), mask=m2)
        ap += g3 * f[:, None, :]
        xp = x_ptr + t64[:, None] * XT + c[None, :]
        dxp = dx_ptr + t64[:, None] * K + c[None, :]
        a0 = _stream3(a0, g3, h0, xp, dxp, m2)
        a1 = _stream3(a1, g3, h1, xp + XS, dxp + C, m2)
        a2 = _stream3(a2, g3, h2, xp + 2 * XS, dxp + 2 * C, m2)
        a3 = _stream3(a3, g3, h3, xp + 3 * XS, dxp + 3 * C, m2)
    tl.store(dhpost_ptr + t64[:, None] * N + i[None, :], tl.sum(ap, axis=2), mask=tmask[:, None])
    rcol = dhres_ptr + t64[:, None] * (N * N) + i[None, :] * N  # + j: dH_res[:, :, j]
    tl.store(rcol, tl.sum(a0, axis=2), mask=tmask[:, None])
    tl.store(rcol + 1, tl.sum(a1, axis=2), mask=tmask[:, None])
    tl.store(rcol + 2, tl.sum(a2, axis=2), mask=tmask[:, None])
    tl.store(rcol + 3, tl.sum(a3, axis=2), mask=tmask[:, None])


@triton.jit
def _load4(ptr, stride, mask):
    """``ptr[k * stride]``, k < 4, of a token block as [BT, 1] columns."""
    return (tl.load(ptr, mask=mask, other=0.0)[:, None],
            tl.load(ptr + stride, mask=mask, other=0.0)[:, None],
            tl.load(ptr + 2 * stride, mask=mask, other=0.0)[:, None],
            tl.load(ptr + 3 * stride, mask=mask, other=0.0)[:, None])


@triton.jit
def _acc4(a0, a1, a2, a3, g0, g1, g2, g3, v, DEFER: tl.constexpr):
    """a_i += g_i v of a channel step: elementwise (DEFER) or summed over channels now."""
    if DEFER:
        return a0 + g0 * v, a1 + g1 * v, a2 + g2 * v, a3 + g3 * v
    return (a0 + tl.sum(g0 * v, axis=1, keep_dims=True),
            a1 + tl.sum(g1 * v, axis=1, keep_dims=True),
            a2 + tl.sum(g2 * v, axis=1, keep_dims=True),
            a3 + tl.sum(g3 * v, axis=1, keep_dims=True))


@triton.jit
def _mix4(ptrs, h0, h1, h2, h3, g0, g1, g2, g3, mask):
    """Stores sum_i h_i g_i (dx_j, or df) of a channel step."""
    out = h0 * g0 + h1 * g1 + h2 * g2 + h3 * g3
    tl.store(ptrs, out.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store4(ptr, stride, a0, a1, a2, a3, mask):
    """``ptr[k * stride]`` = a_k summed over channels, for a token block."""
    tl.store(ptr, tl.sum(a0, axis=1), mask=mask)
    tl.store(ptr + stride, tl.sum(a1, axis=1), mask=mask)
    tl.store(ptr + 2 * stride, tl.sum(a2, axis=1), mask=mask)
    tl.store(ptr + 3 * stride, tl.sum(a3, axis=1), mask=mask)


@triton.jit
def _bwd_split4(g_ptr, x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, dx_ptr, df_ptr, dhres_ptr,
                dhpost_ptr, T, C, HAS_BIAS: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, X_BCAST: tl.constexpr, DEFER: tl.constexpr,
                LOOP_STAGES: tl.constexpr):
    tl.static_assert(N == 4)
    t, tmask, t64 = token_block(T, BT)
    K = N * C
    XT, XS = stream_strides(N, C, X_BCAST)
    hp0, hp1, hp2, hp3 = _load4(hpost_ptr + t64 * N, 1, tmask)
    hrow = hres_ptr + t64 * (N * N)  # h_ij: H_res[i, j], at i * N + j
    h00, h10, h20, h30 = _load4(hrow, N, tmask)
    h01, h11, h21, h31 = _load4(hrow + 1, N, tmask)
    h02, h12, h22, h32 = _load4(hrow + 2, N, tmask)
    h03, h13, h23, h33 = _load4(hrow + 3, N, tmask)
    if DEFER:
        z = tl.zeros([BT, BC], dtype=tl.float32)
    else:
        z = tl.zeros([BT, 1], dtype=tl.float32)
    p0, p1, p2, p3 = z, z, z, z  # dH_post; a_ij: dH_res[i, j]
    a00, a10, a20, a30, a01, a11, a21, a31 = z, z, z, z, z, z, z, z
    a02, a12, a22, a32, a03, a13, a23, a33 = z, z, z, z, z, z, z, z
    for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        gp = g_ptr + t64[:, None] * K + c[None, :]
        g0 = tl.load(gp, mask=m2, other=0.0).to(tl.float32)
        g1 = tl.load(gp + C, mask=m2, other=0.0).to(tl.float32)
        g2 = tl.load(gp + 2 * C, mask=m2, other=0.0).to(tl.float32)
        g3 = tl.load(gp + 3 * C, mask=m2, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:  # as a [BT, BC] tile (L1 hits): the layout of the others
            f += tl.load(fbias_ptr + c[None, :] + 0 * t[:, None], mask=m2, other=0.0).to(
                tl.float32)
        _mix4(df_ptr + t64[:, None] * C + c[None, :], hp0, hp1, hp2, hp3, g0, g1, g2, g3, m2)
        p0, p1, p2, p3 = _acc4(p0, p1, p2, p3, g0, g1, g2, g3, f, DEFER)
        xp = x_ptr + t64[:, None] * XT + c[None, :]
        x0 = tl.load(xp, mask=m2, other=0.0).to(tl.float32)
        a00, a10, a20, a30 = _acc4(a00, a10, a20, a30, g0, g1, g2, g3, x0, DEFER)
        x1 = tl.load(xp + XS, mask=m2, other=0.0).to(tl.float32)
        a01, a11, a21, a31 = _acc4(a01, a11, a21, a31, g0, g1, g2, g3, x1, DEFER)
        x2 = tl.load(xp + 2 * XS, mask=m2, other=0.0).to(tl.float32)
        a02, a12, a22, a32 = _acc4(a02, a12, a22, a32, g0, g1, g2, g3, x2, DEFER)
        x3 = tl.load(xp + 3 * XS, mask=m2, other=0.0).to(tl.float32)
        a03, a13, a23, a33 = _acc4(a03, a13, a23, a33, g0, g1, g2, g3, x3, DEFER)
        dxp = dx_ptr + t64[:, None] * K + c[None, :]
        _mix4(dxp, h00, h10, h20, h30, g0, g1, g2, g3, m2)
        _mix4(dxp + C, h01, h11, h21, h31, g0, g1, g2, g3, m2)
        _mix4(dxp + 2 * C, h02, h12, h22, h32, g0, g1, g2, g3, m2)
        _mix4(dxp + 3 * C, h03, h13, h23, h33, g0, g1, g2, g3, m2)
    _store4(dhpost_ptr + t64 * N, 1, p0, p1, p2, p3, tmask)
    rrow = dhres_ptr + t64 * (N * N)
    _store4(rrow, N, a00, a10, a20, a30, tmask)
    _store4(rrow + 1, N, a01, a11, a21, a31, tmask)
    _store4(rrow + 2, N, a02, a12, a22, a32, tmask)
    _store4(rrow + 3, N, a03, a13, a23, a33, tmask)


def variants():
    """(name, kernel, tile, extra launch keywords, check dH)."""
    ship, tile, stages = kernel_variant([]), tuple(TILES.combine_bwd[:3]), TILES.combine_bwd[3]
    shipped = {"LOOP_STAGES": stages}
    rows = [("shipped", ship, tile, shipped, True)]
    rows += [(f"loop stages {s}", ship, tile, {"LOOP_STAGES": s}, True)
             for s in (1, 2, 3) if s != stages]
    rows += [("no dH reductions", kernel_variant(NO_DH), tile, shipped, False),
             ("h_res hoisted", kernel_variant(HOIST), tile, shipped, True)]
    hand = [("deferred", _bwd_deferred4, N4_TILES, {}),
            ("split", _bwd_split4, SPLIT_TILES, {"DEFER": False}),
            ("split deferred", _bwd_split4, SPLIT_TILES, {"DEFER": True})]
    for name, kern, tiles, extra in hand:
        rows += [(f"{name}, n=4, loop stages {s}", kern, t, {**extra, "LOOP_STAGES": s}, True)
                 for s in (1, 3) for t in tiles]
    return rows


def make_inputs(T, n, C, dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16, generator=gen)
    g, x = torch.randn(T, n, C, **bf), torch.randn(T, n, C, **bf)
    f, fb = torch.randn(T, C, **bf), torch.randn(C, **bf)
    h_res = torch.rand(T, n, n, device=dev, generator=gen)
    return g, x, f, fb, h_res, torch.rand(T, n, device=dev, generator=gen)


def torch_grads(g, x, f, fb, h_res, h_post):
    """dx, df (bf16), dH_res, dH_post in fp32 torch math."""
    g32, x32, f32 = g.float(), x.float(), f.float() + fb.float()
    return (torch.einsum("tij,tic->tjc", h_res, g32).to(x.dtype),
            torch.einsum("ti,tic->tc", h_post, g32).to(f.dtype),
            torch.einsum("tic,tjc->tij", g32, x32), torch.einsum("tic,tc->ti", g32, f32))


def rel_diff(a, b):
    return ((a - b).norm() / b.norm()).item()


def differs(out, ref, check_dh):
    """'' when ``out`` (dx, df, dH_res, dH_post) agrees with ``ref``, else what differs."""
    bad = [name for name, a, b in zip(("dx", "df"), out, ref)
           if not torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-5)]
    if check_dh:
        bad += [f"{name} rel. diff {rel_diff(a, b):.1e}" for name, a, b in
                zip(("dH_res", "dH_post"), out[2:], ref[2:]) if not rel_diff(a, b) <= 1e-5]
    return ", ".join(bad)


def run_size(T, n, C, dev, rows, bw=None):
    """One table: each of ``rows`` checked, then timed unless ``bw`` is None."""
    g, x, f, fb, h_res, h_post = inputs = make_inputs(T, n, C, dev)
    nbytes = 3 * x.numel() * x.element_size() + 2 * f.numel() * f.element_size()

    def launch(kern, tile, extra):
        bt, bc, warps = tile
        nan = float("nan")  # what a kernel leaves unwritten shows
        outs = (torch.full_like(x, nan), torch.full_like(f, nan),
                torch.full((T, n, n), nan, device=dev), torch.full((T, n), nan, device=dev))
        meta = dict(HAS_BIAS=True, N=n, BT=bt, BC=min(bc, next_pow2(C)), X_BCAST=False,
                    num_warps=warps, **extra)

        def run():
            return kern[(cdiv(T, bt),)](g, x, f, fb, h_res, h_post, *outs, T, C, **meta)
        compiled = run()
        regs = getattr(compiled, "n_regs", None)  # None under the interpreter
        return run, outs, "-" if regs is None else f"{regs} ({compiled.n_spills})"

    print(f"\n### T={T} C={C} n={n} bf16: {nbytes / 1e9:.3f} GB floor traffic\n\n"
          "| variant | tile (tokens, channels, warps) | regs (spills) | ms | GB/s | "
          "% of copy BW | check |\n|---|---|---|---|---|---|---|")
    ref = None
    for name, kern, tile, extra, check_dh in rows:
        try:
            run, outs, regs = launch(kern, tile, extra)
        except Exception as e:  # compile or launch (resources): reported, unless shipped
            if ref is None:
                raise
            print(f"| {name} | {tile} | - | - | - | - | FAILED: {type(e).__name__}: "
                  f"{(str(e).splitlines() or [''])[0][:100]} |")
            continue
        if ref is None:  # the shipped kernel, against torch
            bad = differs(outs, torch_grads(*inputs), True)
            assert not bad, f"the shipped kernel disagrees with torch: {bad}"
            ref = outs
        bad = differs(outs, ref, check_dh)
        if bad:
            print(f"| {name} | {tile} | {regs} | - | - | - | WRONG: {bad} |")
            continue
        exact = all(torch.equal(a, b) for a, b in zip(outs[:2], ref[:2]))
        check = f"dx, df {'exact' if exact else 'to bf16 rounding'}; dH " + (
            f"rel. diff {max(rel_diff(a, b) for a, b in zip(outs[2:], ref[2:])):.0e}"
            if check_dh else "not checked")
        if bw is None:
            print(f"| {name} | {tile} | {regs} | - | - | - | {check} |")
            continue
        ms = bench(run)
        gbs = nbytes / ms / 1e6
        print(f"| {name} | {tile} | {regs} | {ms:.3f} | {gbs:.0f} | {gbs / bw:.0%} | {check} |")
    if bw is not None:
        src = torch.empty(nbytes // 4, device=dev, dtype=torch.bfloat16)  # read+write nbytes
        dst = torch.empty_like(src)
        ms = bench(lambda: dst.copy_(src))
        gbs = nbytes / ms / 1e6
        print(f"| copy (same bytes) | - | - | {ms:.3f} | {gbs:.0f} | {gbs / bw:.0%} | - |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="*", default=["4096x4096", "16384x4096"], help="TxC")
    p.add_argument("--check", action="store_true", help="correctness only, at 37x4x40 and "
                   "64x4x128 (TxnxC); runs on CPU with TRITON_INTERPRET=1")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}; shipped tile "
          f"{tuple(TILES.combine_bwd)} (tokens, channels, warps, loop stages)")
    rows = variants()
    if args.check:
        for T, n, C in [(37, 4, 40), (64, 4, 128)]:
            run_size(T, n, C, dev, rows)
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    for size in args.sizes:
        T, C = (int(v) for v in size.split("x"))
        run_size(T, 4, C, dev, rows, bw)


if __name__ == "__main__":
    main()
