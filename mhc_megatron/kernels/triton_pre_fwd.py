"""The forward kernels of the fused Triton "pre" op (:mod:`~mhc_megatron.kernels.triton_pre`)
and their launch plans.

``_proj_partial`` (projection ``x @ phi^T`` with ``tl.dot`` and the sum of squares, on a (token
block x K split) grid walked from the last tokens down), ``_mappings_fwd`` (per token: sum of
the partials, RMS, sigmoids, Sinkhorn in registers: the paper's log-domain one or
DeepSeek-V4's; for small inputs also the aggregate of its tokens, one launch fewer where a step
is bound by host time), ``_aggregate_fwd`` (``y = sum_i H_pre[i] x[i]`` on a (token x channel)
grid walked up): each starts on the token rows the kernel before it read or wrote last, still
in L2 (:func:`~mhc_megatron.kernels.triton_common.token_rows`). ``x [T, n, C]`` (or one
broadcast row a token, ``X_BCAST``), ``phi [m, n*C]`` (``m = 2n + n^2``), mappings fp32.

Host side: the launch shapes of a (T, n, C, dtype) (:class:`_PreForwardPlan`,
:class:`_AggregatePlan`, computed once by
:func:`~mhc_megatron.kernels.triton_common.plan`), a
:class:`~mhc_megatron.kernels.launch.Launcher` per kernel, and :func:`_launch_aggregate`, the
one launch of the aggregate, shared by pre's forward and the recompute's replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels.launch import Launcher, LaunchPlan, Meta, cdiv, next_pow2
from mhc_megatron.kernels.triton_common import (
    _INTERPRETED,
    TILES,
    Scratch,
    _aggregate_tile,
    _dot_precision,
    _mapping_logits,
    _padded_m,
    _projection_splits_phi,
    _sinkhorn_dsv4,
    _sinkhorn_log,
    _splits,
    _sweep_bc,
    plan,
    projection_rows,
    stream_strides,
    token_block,
    token_rows,
)


# ------------------------------------------------------------------------------ forward
@triton.jit
def _proj_partial(x_ptr, phi_ptr, part_ptr, ss_ptr, T, K, C, K_PER_SPLIT,
                  M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr, SPLIT_PHI: tl.constexpr, INTERPRETED: tl.constexpr,
                  X_BCAST: tl.constexpr):
    """part[s, t, :] = x[t, K-split s] @ phi[:, K-split s]^T; ss[s, t] = sum of x^2 there.

    X_BCAST: x's streams are one broadcast row (``x[t, k]`` at ``t*C + k % C``, see
    :func:`~mhc_megatron.kernels.triton_common.streams_operand`).

    SPLIT_PHI (16-bit x): x feeds the tensor cores as it is and phi as two 16-bit halves
    (hi + lo, ~16 mantissa bits), accumulated in fp32. Otherwise x is widened to fp32 and
    the dot runs at ``PREC``."""
    # the tokens from the last block down: the combine before wrote x' ascending
    split, t, tmask, t64 = token_rows(T, BT, tl.cdiv(K, K_PER_SPLIT), True)
    mcol = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        if X_BCAST:
            x_offs = t64[:, None] * C + (k % C)[None, :]
        else:
            x_offs = t64[:, None] * K + k[None, :]
        xt = tl.load(x_ptr + x_offs, mask=tmask[:, None] & kmask[None, :], other=0.0)
        xf = xt.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        ph = tl.load(phi_ptr + mcol[None, :].to(tl.int64) * K + k[:, None],
                     mask=kmask[:, None] & (mcol[None, :] < M), other=0.0).to(tl.float32)
        if SPLIT_PHI:
            ph_hi = ph.to(xt.dtype)
            ph_lo = (ph - ph_hi.to(tl.float32)).to(xt.dtype)
            if INTERPRETED:  # the CPU interpreter's bf16 dot is wrong: same split, fp32 dot
                acc = tl.dot(xf, ph_hi.to(tl.float32), acc, input_precision="ieee")
                acc = tl.dot(xf, ph_lo.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, ph_hi, acc)
                acc = tl.dot(xt, ph_lo, acc)
        else:
            acc = tl.dot(xf, ph, acc, input_precision=PREC)
    row = split.to(tl.int64) * T + t64
    tl.store(part_ptr + row[:, None] * MP + mcol[None, :], acc, mask=tmask[:, None])
    tl.store(ss_ptr + row, ss, mask=tmask)


@triton.jit
def _mappings_fwd(part_ptr, ss_ptr, alpha_ptr, bias_ptr, hpre_ptr, hpost_ptr, hres_ptr,
                  ht_ptr, rstd_ptr, x_ptr, y_ptr, T, K, C, SPLITS, eps, iters, form_eps,
                  N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, DSV4: tl.constexpr,
                  TRANSPOSED: tl.constexpr, HAS_AGG: tl.constexpr, BC: tl.constexpr,
                  X_BCAST: tl.constexpr):
    """Sum the split partials in order, then Ht [T, MP], rstd [T] and the mappings
    (``h_pre``, ``h_post [T, N]``, ``h_res [T, N, N]``) for a token block.

    The paper's form, or with DSV4 DeepSeek-V4's (``h_pre = sigmoid + form_eps``, the
    linear-domain Sinkhorn :func:`~mhc_megatron.kernels.triton_common._sinkhorn_dsv4`);
    TRANSPOSED stores ``h_res = M^T`` (``M[i, j]`` at ``j*N + i``). HAS_AGG: also the
    aggregate of the block's tokens, ``y [T, C] = sum_i h_pre[t, i] x[t, i, :]`` (``x [T, N, C]``,
    or one broadcast row a token with X_BCAST), ``BC`` channels a step, the bits of
    ``_aggregate_fwd`` (:func:`~mhc_megatron.kernels.triton_common._aggregate_tile`); else
    ``x_ptr``, ``y_ptr`` and ``C`` are unread."""
    t, tmask, t64 = token_block(T, BT)
    mcol = tl.arange(0, MP)
    acc, rstd = projection_rows(part_ptr, ss_ptr, t64, tmask, T, K, SPLITS, eps, MP, BT)
    tl.store(ht_ptr + t64[:, None] * MP + mcol[None, :], acc * rstd[:, None], mask=tmask[:, None])
    tl.store(rstd_ptr + t, rstd, mask=tmask)
    tl.debug_barrier()  # Ht rows written above are re-read below in another layout
    z_pre, z_post, z_res, _, _, _, _, _, _ = _mapping_logits(ht_ptr, alpha_ptr, bias_ptr, t64,
                                                             tmask, N, MP)
    i = tl.arange(0, N)
    if TRANSPOSED:
        ij = i[:, None] + i[None, :] * N
    else:
        ij = i[:, None] * N + i[None, :]
    if DSV4:
        h_pre = tl.sigmoid(z_pre) + form_eps
        h_res = _sinkhorn_dsv4(z_res, iters, form_eps)
    else:
        h_pre = tl.sigmoid(z_pre)
        h_res = tl.exp(_sinkhorn_log(z_res, iters))
    tl.store(hpre_ptr + t64[:, None] * N + i[None, :], h_pre, mask=tmask[:, None])
    tl.store(hpost_ptr + t64[:, None] * N + i[None, :], 2.0 * tl.sigmoid(z_post),
             mask=tmask[:, None])
    tl.store(hres_ptr + t64[:, None, None] * (N * N) + ij[None, :, :], h_res,
             mask=tmask[:, None, None])
    if HAS_AGG:
        tl.debug_barrier()  # h_pre rows written above are read back by other threads
        XT, XS = stream_strides(N, C, X_BCAST)
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            m2 = tmask[:, None] & (c < C)[None, :]
            y = _aggregate_tile(x_ptr, hpre_ptr, t64, tmask, c, m2, XT, XS, N, BT, BC)
            tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _aggregate_fwd(x_ptr, hpre_ptr, y_ptr, T, C, N: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, X_BCAST: tl.constexpr):
    """y[t, c] = sum_i h_pre[t, i] x[t, i, c] on a (token, channel) grid
    (:func:`~mhc_megatron.kernels.triton_common._aggregate_tile`: the same bits as the fused
    replay of the recompute, ``triton_combine._combine_fwd`` with ``HAS_AGG``)."""
    XT, XS = stream_strides(N, C, X_BCAST)
    cb, t, tmask, t64 = token_rows(T, BT, tl.cdiv(C, BC), False)  # up: the projection went down
    c = cb * BC + tl.arange(0, BC)
    m2 = tmask[:, None] & (c < C)[None, :]
    y = _aggregate_tile(x_ptr, hpre_ptr, t64, tmask, c, m2, XT, XS, N, BT, BC)
    tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)



# ------------------------------------------------------------------------------- host side
_PROJ, _MAPS_FWD, _AGG = Launcher(_proj_partial), Launcher(_mappings_fwd), Launcher(_aggregate_fwd)


class _AggregatePlan(LaunchPlan):
    """Launch shape of ``_aggregate_fwd`` for ``x [T, n, C]`` (``bcast``: one broadcast row
    a token, :func:`~mhc_megatron.kernels.triton_common.streams_operand`)."""

    def __init__(self, T: int, n: int, C: int, bcast: bool):
        super().__init__()
        bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
        self.grid = (cdiv(T, bt) * cdiv(C, bc),)  # token_rows
        self.meta = Meta(N=n, BT=bt, BC=bc, X_BCAST=bcast, num_warps=warps)


class _PreForwardPlan(LaunchPlan):
    """Launch shapes of pre's forward for ``x [T, n, C]`` (T > 0) of ``dtype``, the mappings
    in the form ``dsv4`` / ``transposed``
    (:func:`~mhc_megatron.kernels.triton_common.form_flags`)."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, forced: str | None,
                 bcast: bool, dsv4: bool = False, transposed: bool = False):
        super().__init__()
        self.m, self.mp, self.K = 2 * n + n * n, _padded_m(n), n * C
        bt, bk, warps, stages = TILES.proj[n]
        self.splits, self.per = _splits(cdiv(T, bt), self.K, bk)
        self.proj_grid = (cdiv(T, bt) * self.splits,)  # token_rows
        self.proj_meta = Meta(M=self.m, MP=self.mp, BT=bt, BK=bk,
                              PREC=_dot_precision(dtype, forced),
                              SPLIT_PHI=_projection_splits_phi(dtype, forced),
                              INTERPRETED=_INTERPRETED, X_BCAST=bcast, num_warps=warps,
                              num_stages=stages)
        map_bt, map_warps = TILES.maps
        agg_elements, agg_width, agg_bc = TILES.maps_agg
        self.map_grid = (cdiv(T, map_bt),)
        # the aggregate in the mapping kernel (small inputs, not too wide)
        self.map_agg = T * self.K <= agg_elements and self.K <= agg_width
        self.map_meta = Meta(N=n, MP=self.mp, BT=map_bt, DSV4=dsv4, TRANSPOSED=transposed,
                             HAS_AGG=self.map_agg, BC=min(agg_bc, next_pow2(C)), X_BCAST=bcast,
                             num_warps=map_warps)
        # the projection's partials [splits, T, mp] and sums of squares [splits, T]
        self.scratch = Scratch(((self.splits, T, self.mp), torch.float32),
                               ((self.splits, T), torch.float32))



def _launch_aggregate(x: torch.Tensor, dims: tuple[int, int, int], h_pre: torch.Tensor,
                      y: torch.Tensor, bcast: bool, sig: tuple | None) -> None:
    """``y [T, C] = sum_i h_pre[:, i] x[:, i]`` for ``x`` of token dims ``dims = (T, n, C)``
    (:func:`~mhc_megatron.kernels.reference.token_dims`) as
    :func:`~mhc_megatron.kernels.triton_common.streams_operand` returns it (``bcast``), fp32
    ``h_pre [T, n]`` (T > 0): the one launch of the aggregate, shared by pre's forward and
    :func:`~mhc_megatron.kernels.triton_pre.aggregate`, so that both give the same bits.
    ``sig``: the calling op's launch signature (:func:`~mhc_megatron.kernels.launch.signature`;
    ``x`` and ``h_pre`` are given to it or allocated by it as fp32, ``y`` allocated by it)."""
    T, n, C = dims
    p = plan(_AggregatePlan, T, n, C, bcast)
    _AGG.signed(p, sig, p.grid, p.meta, x, h_pre, y, T, C)
