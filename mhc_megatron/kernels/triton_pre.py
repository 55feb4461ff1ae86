"""The fused Triton "pre" op of mHC: dynamic mappings and aggregate, forward and backward.

``pre(x [T, n, C], phi [m, n*C], alpha [3], bias [m]) -> (y [T, C], h_pre [T, n],
h_post [T, n], h_res [T, n, n])``, the math of :func:`mhc_megatron.kernels.reference.pre`
(``m = 2n + n^2``, mappings fp32), and ``aggregate(x, h_pre) -> y`` (pre's ``y`` again, bit
for bit: what ``mhc_recompute`` replays).

Forward: ``_proj_partial`` (projection ``x @ phi^T`` with ``tl.dot`` and the sum of squares,
on a (token block x K split) grid walked from the last tokens down), ``_mappings_fwd`` (per
token: sum of the partials, RMS, sigmoids, log-domain Sinkhorn in registers),
``_aggregate_fwd`` (``y = sum_i H_pre[i] x[i]`` on a (token x channel) grid walked up): each
starts on the token rows the kernel before it read or wrote last, still in L2
(:func:`~mhc_megatron.kernels.triton_common.token_rows`).

Backward: ``_dhpre_partial`` (``dH_pre`` partials over C splits), ``_mappings_bwd`` (sigmoid
and Sinkhorn backward, exact: the iterations are replayed once from the logits into an fp32
scratch and walked back; writes per token block the sums of the logit gradients for
``dalpha``/``dbias``, and ``dP`` and the RMS term), ``_pre_dx_dphi`` (one more pass over x:
``dx`` and the ``dphi`` partials together; adds the combine's ``dx``, ``H_res^T g``, from the
upstream gradient ``g`` the combine hands over by
:class:`~mhc_megatron.kernels.handoff.DxLink`) and ``_param_grads`` (the fixed-order sums of
the partials into ``dphi``, ``dbias``, ``dalpha`` in the parameters' dtypes).

Host side: the launch shapes of a (T, n, C, dtype) are computed once (:func:`plan`) and the
kernels launched through :class:`~mhc_megatron.kernels.launch.Launcher`.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from mhc_megatron._logging import log_rank0

from mhc_megatron.kernels.handoff import DxLink
from mhc_megatron.kernels.launch import Launcher, Meta, cdiv, next_pow2
from mhc_megatron.kernels.reference import aggregate_shape, as_tokens
from mhc_megatron.kernels.triton_common import (
    _INTERPRETED,
    TILES,
    _aggregate_tile,
    _check,
    _dot_precision,
    _mapping_logits,
    _padded_m,
    _projection_splits_phi,
    _sinkhorn_log,
    _sinkhorn_log_bwd,
    _splits,
    _sweep_bc,
    contiguous_f32,
    forced_precision,
    plan,
    stream_strides,
    streams_operand,
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
                  ht_ptr, rstd_ptr, T, K, SPLITS, eps, iters,
                  N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr):
    """Sum the split partials in order, then Ht, rstd and the mappings for a token block."""
    t, tmask, t64 = token_block(T, BT)
    mcol = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for s in range(SPLITS):
        row = s * T + t64
        acc += tl.load(part_ptr + row[:, None] * MP + mcol[None, :], mask=tmask[:, None], other=0.0)
        ss += tl.load(ss_ptr + row, mask=tmask, other=0.0)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    tl.store(ht_ptr + t64[:, None] * MP + mcol[None, :], acc * rstd[:, None], mask=tmask[:, None])
    tl.store(rstd_ptr + t, rstd, mask=tmask)
    tl.debug_barrier()  # Ht rows written above are re-read below in another layout
    z_pre, z_post, z_res, _, _, _, _, _, _ = _mapping_logits(ht_ptr, alpha_ptr, bias_ptr, t64,
                                                             tmask, N, MP)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    tl.store(hpre_ptr + t64[:, None] * N + i[None, :], tl.sigmoid(z_pre), mask=tmask[:, None])
    tl.store(hpost_ptr + t64[:, None] * N + i[None, :], 2.0 * tl.sigmoid(z_post),
             mask=tmask[:, None])
    tl.store(hres_ptr + t64[:, None, None] * (N * N) + ij[None, :, :],
             tl.exp(_sinkhorn_log(z_res, iters)), mask=tmask[:, None, None])


@triton.jit
def _aggregate_fwd(x_ptr, hpre_ptr, y_ptr, T, C, N: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, X_BCAST: tl.constexpr):
    """y[t, c] = sum_i h_pre[t, i] x[t, i, c] on a (token, channel) grid
    (:func:`~mhc_megatron.kernels.triton_common._aggregate_tile`: the same bits as the fused
    replay of the recompute, ``_combine_fwd`` with ``HAS_AGG``)."""
    XT, XS = stream_strides(N, C, X_BCAST)
    cb, t, tmask, t64 = token_rows(T, BT, tl.cdiv(C, BC), False)  # up: the projection went down
    c = cb * BC + tl.arange(0, BC)
    m2 = tmask[:, None] & (c < C)[None, :]
    y = _aggregate_tile(x_ptr, hpre_ptr, t64, tmask, c, m2, XT, XS, N, BT, BC)
    tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _dhpre_partial(x_ptr, dy_ptr, part_ptr, T, C, C_PER_SPLIT, N: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, X_BCAST: tl.constexpr):
    """part[s, t, i] = sum over channels of C-split s of dy[t, c] x[t, i, c]."""
    XT, XS = stream_strides(N, C, X_BCAST)
    t, tmask, t64 = token_block(T, BT)
    split = tl.program_id(1)
    i = tl.arange(0, N)
    acc = tl.zeros([BT, N], dtype=tl.float32)
    c_start = split * C_PER_SPLIT
    for c0 in range(c_start, c_start + C_PER_SPLIT, BC):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        x3 = tl.load(x_ptr + t64[:, None, None] * XT + i[None, :, None] * XS + c[None, None, :],
                     mask=m2[:, None, :], other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(x3 * dy[:, None, :], axis=2)
    row = split.to(tl.int64) * T + t64
    tl.store(part_ptr + row[:, None] * N + i[None, :], acc, mask=tmask[:, None])


@triton.jit
def _mappings_bwd(part_ptr, SPLITS, dhpre_ptr, dhpost_ptr, dhres_ptr, ht_ptr, rstd_ptr,
                  alpha_ptr, bias_ptr, red_ptr, dp_ptr, coef_ptr, hist_ptr, T, K, iters,
                  HAS_DHPRE: tl.constexpr, N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr):
    """Per token block: sigmoid and Sinkhorn backward, then the logit grads dz, dP (its
    padding columns zeroed) and the RMS coefficient for dx.

    dz is only summed over tokens: this program writes its block's sums to
    ``red [program, MP]``, columns ``[0, M)`` the bias grads (sum of dz) and ``[M, M+3)``
    the alpha grads (sum of dz * Ht per pre / post / res group); the caller sums the rows.

    The Sinkhorn backward (:func:`~mhc_megatron.kernels.triton_common._sinkhorn_log_bwd`)
    replays the iterations once from the logits into the scratch ``hist [iters, T, N*N]``
    (fp32, written and read back by the same program), then walks them in reverse."""
    t, tmask, t64 = token_block(T, BT)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    d_pre = tl.zeros([BT, N], dtype=tl.float32)
    for s in range(SPLITS):
        d_pre += tl.load(part_ptr + (s * T + t64)[:, None] * N + i[None, :], mask=tmask[:, None],
                         other=0.0)
    if HAS_DHPRE:
        d_pre += tl.load(dhpre_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)

    z_pre, z_post, z_res, ht_pre, ht_post, ht_res, a_pre, a_post, a_res = _mapping_logits(
        ht_ptr, alpha_ptr, bias_ptr, t64, tmask, N, MP)
    s_pre = tl.sigmoid(z_pre)
    s_post = tl.sigmoid(z_post)
    dz_pre = d_pre * s_pre * (1.0 - s_pre)
    d_post = tl.load(dhpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    dz_post = d_post * 2.0 * s_post * (1.0 - s_post)

    d_res = tl.load(dhres_ptr + t64[:, None, None] * (N * N) + ij[None, :, :],
                    mask=tmask[:, None, None], other=0.0)
    dz_res = _sinkhorn_log_bwd(z_res, d_res, hist_ptr, t64, tmask, T, iters, N)

    # masked tokens have dz = 0 (their upstream grads load as 0) and Ht = 0
    M: tl.constexpr = 2 * N + N * N
    red = red_ptr + tl.program_id(0).to(tl.int64) * MP
    tl.store(red + i, tl.sum(dz_pre, axis=0))
    tl.store(red + N + i, tl.sum(dz_post, axis=0))
    tl.store(red + 2 * N + ij, tl.sum(dz_res, axis=0))
    g = tl.arange(0, 4)
    a_grads = tl.where(g == 0, tl.sum(tl.sum(dz_pre * ht_pre, axis=1), axis=0),
                       tl.where(g == 1, tl.sum(tl.sum(dz_post * ht_post, axis=1), axis=0),
                                tl.sum(tl.sum(tl.sum(dz_res * ht_res, axis=2), axis=1),
                                       axis=0)))
    tl.store(red + M + g, a_grads, mask=g < 3)

    # Ht = P * rstd, rstd = (sum(x^2)/K + eps)^-1/2:
    #   dP = dHt * rstd;  dx += dP @ phi - (sum_m dHt_m Ht_m) * rstd^2 / K * x
    rstd = tl.load(rstd_ptr + t, mask=tmask, other=0.0)
    dht_pre = dz_pre * a_pre
    dht_post = dz_post * a_post
    dht_res = dz_res * a_res
    dsum = (tl.sum(dht_pre * ht_pre, axis=1) + tl.sum(dht_post * ht_post, axis=1)
            + tl.sum(tl.sum(dht_res * ht_res, axis=2), axis=1))
    tl.store(coef_ptr + t, -dsum * rstd * rstd / K, mask=tmask)
    prow = dp_ptr + t64 * MP
    tl.store(prow[:, None] + i[None, :], dht_pre * rstd[:, None], mask=tmask[:, None])
    tl.store(prow[:, None] + N + i[None, :], dht_post * rstd[:, None], mask=tmask[:, None])
    tl.store(prow[:, None, None] + 2 * N + ij[None, :, :], dht_res * rstd[:, None, None],
             mask=tmask[:, None, None])
    if MP > M:  # _pre_dx_dphi reads dP's padding columns: zeros
        pad = tl.arange(0, MP)
        tl.store(prow[:, None] + pad[None, :], tl.zeros([BT, MP], dtype=tl.float32),
                 mask=tmask[:, None] & (pad >= M)[None, :])


@triton.jit
def _pre_dx_dphi(x_ptr, dy_ptr, hpre_ptr, dp_ptr, coef_ptr, phi_ptr, g_ptr, hres_ptr, dx_ptr,
                 dphi_ptr, T, C, TOKENS_PER_SPLIT, HAS_G: tl.constexpr, N: tl.constexpr,
                 M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 PREC: tl.constexpr, X_BCAST: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """One pass over x for both x and phi gradients of "pre".

    Program (stream s, channel block, token split) walks its tokens:
    ``dx[t, s, c] = (dP @ phi)[t, s*C+c] + coef[t] x[t, s, c] + h_pre[t, s] dy[t, c]
    (+ sum_i H_res[t, i, s] g[t, i, c], the combine's dx from its upstream gradient ``g``
    [T, N, C] and ``H_res`` [T, N, N], when HAS_G: the fold of
    :class:`~mhc_megatron.kernels.handoff.DxLink`)`` and accumulates
    ``dphi_part[split, :, s*C+c] = sum_t dP[t, :]^T x[t, s, c]``. The stream index varies
    fastest in the launch order, so the N programs sharing a dy tile run together (L2).
    The token loop is software-pipelined as a whole (``LOOP_STAGES``): the launch's
    ``num_stages`` would pipeline only the loads that feed a ``tl.dot`` (dP, x), not those of
    dy and the combine's dx (measured: 0.216 -> 0.165 ms at 4096 x 4096 on an H100)."""
    s = tl.program_id(0) % N
    c = (tl.program_id(0) // N) * BC + tl.arange(0, BC)
    split = tl.program_id(1)
    cmask = c < C
    K = N * C
    XT, XS = stream_strides(N, C, X_BCAST)
    k = s * C + c
    mcol = tl.arange(0, MP)
    ph = tl.load(phi_ptr + mcol[:, None].to(tl.int64) * K + k[None, :],
                 mask=(mcol[:, None] < M) & cmask[None, :], other=0.0).to(tl.float32)
    dphi = tl.zeros([MP, BC], dtype=tl.float32)
    t_start = split * TOKENS_PER_SPLIT
    for t0 in tl.range(t_start, t_start + TOKENS_PER_SPLIT, BT, num_stages=LOOP_STAGES):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        m2 = tmask[:, None] & cmask[None, :]
        dp = tl.load(dp_ptr + t64[:, None] * MP + mcol[None, :], mask=tmask[:, None], other=0.0)
        coef = tl.load(coef_ptr + t, mask=tmask, other=0.0)
        h_s = tl.load(hpre_ptr + t64 * N + s, mask=tmask, other=0.0)
        dy = tl.load(dy_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        offs = t64[:, None] * K + k[None, :]  # dx: [T, N, C]
        xs = tl.load(x_ptr + t64[:, None] * XT + s * XS + c[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        dxs = tl.dot(dp, ph, input_precision=PREC) + coef[:, None] * xs + h_s[:, None] * dy
        if HAS_G:  # g's N stream tiles, shared by the N programs of a block (L2)
            for i in tl.static_range(N):
                g_i = tl.load(g_ptr + t64[:, None] * K + i * C + c[None, :], mask=m2,
                              other=0.0).to(tl.float32)
                h_is = tl.load(hres_ptr + t64 * (N * N) + i * N + s, mask=tmask, other=0.0)
                dxs += h_is[:, None] * g_i
        tl.store(dx_ptr + offs, dxs.to(dx_ptr.dtype.element_ty), mask=m2)
        dphi = tl.dot(tl.trans(dp), xs, dphi, input_precision=PREC)
    tl.store(dphi_ptr + split.to(tl.int64) * MP * K + mcol[:, None] * K + k[None, :], dphi,
             mask=cmask[None, :])


@triton.jit
def _param_grads(dphi_part_ptr, red_ptr, dphi_ptr, dbias_ptr, dalpha_ptr, SPLITS, SPLIT_STRIDE,
                 MK, ROWS, M: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr,
                 ROWS_STEP: tl.constexpr):
    """The parameter gradients from their partials, summed in a fixed order.

    Programs ``0 .. P-2``: ``dphi.flat[i] = sum_s dphi_part[s].flat[i]`` for ``i < M*K``
    (``dphi_part [SPLITS, MP, K]``: its first ``M`` rows, flattened, are ``dphi``'s layout).
    The last program: ``dbias[j] = sum_r red[r, j]`` and ``dalpha[g] = sum_r red[r, M + g]``
    (``red [ROWS, MP]``, written by ``_mappings_bwd``)."""
    pid = tl.program_id(0)
    if pid == tl.num_programs(0) - 1:
        j = tl.arange(0, MP)
        r = tl.arange(0, ROWS_STEP)
        red2 = tl.zeros([ROWS_STEP, MP], dtype=tl.float32)
        for r0 in range(0, ROWS, ROWS_STEP):  # ROWS_STEP rows a load, not one row a latency
            red2 += tl.load(red_ptr + (r0 + r)[:, None] * MP + j[None, :],
                            mask=(r0 + r < ROWS)[:, None], other=0.0)
        red = tl.sum(red2, axis=0)
        tl.store(dbias_ptr + j, red.to(dbias_ptr.dtype.element_ty), mask=j < M)
        tl.store(dalpha_ptr + (j - M), red.to(dalpha_ptr.dtype.element_ty),
                 mask=(j >= M) & (j < M + 3))
    else:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MK
        dphi = tl.zeros([BLOCK], dtype=tl.float32)
        src = dphi_part_ptr + i
        for _ in range(SPLITS):  # pointer steps: no int32 product of the split and its stride
            dphi += tl.load(src, mask=mask, other=0.0)
            src += SPLIT_STRIDE
        tl.store(dphi_ptr + i, dphi.to(dphi_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------- host side
_PROJ, _MAPS_FWD, _AGG = Launcher(_proj_partial), Launcher(_mappings_fwd), Launcher(_aggregate_fwd)
_DHPRE, _MAPS_BWD = Launcher(_dhpre_partial), Launcher(_mappings_bwd)
_DX_DPHI, _PARAM_GRADS = Launcher(_pre_dx_dphi), Launcher(_param_grads)
_PARAM_GRADS_BLOCK = 1024
logger = logging.getLogger(__name__)


class _AggregatePlan:
    """Launch shape of ``_aggregate_fwd`` for ``x [T, n, C]`` (``bcast``: one broadcast row
    a token, :func:`streams_operand`)."""

    def __init__(self, T: int, n: int, C: int, bcast: bool):
        bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
        self.grid = (cdiv(T, bt) * cdiv(C, bc),)  # token_rows
        self.meta = Meta(N=n, BT=bt, BC=bc, X_BCAST=bcast, num_warps=warps)


class _PreForwardPlan:
    """Launch shapes of pre's forward for ``x [T, n, C]`` (T > 0) of ``dtype``."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, forced: str | None,
                 bcast: bool):
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
        self.map_grid = (cdiv(T, map_bt),)
        self.map_meta = Meta(N=n, MP=self.mp, BT=map_bt, num_warps=map_warps)


class _PreBackwardPlan:
    """Launch shapes of pre's backward for ``x [T, n, C]`` of ``dtype``."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, forced: str | None,
                 has_dhpre: bool, has_g: bool, bcast: bool):
        self.m, self.mp, self.K = 2 * n + n * n, _padded_m(n), n * C
        bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
        self.dh_splits, per = _splits(cdiv(T, bt), C, bc)
        self.dh_grid = (cdiv(T, bt), self.dh_splits)
        self.dh_per = per
        self.dh_meta = Meta(N=n, BT=bt, BC=bc, X_BCAST=bcast, num_warps=warps)
        map_bt, map_warps = TILES.maps
        self.map_programs = max(cdiv(T, map_bt), 1)
        self.map_meta = Meta(HAS_DHPRE=has_dhpre, N=n, MP=self.mp, BT=map_bt,
                             num_warps=map_warps)
        bt_dx, bc_dx, warps_dx, stages_dx = TILES.dx
        bc_dx = min(bc_dx, max(16, next_pow2(C)))
        dx_blocks = n * cdiv(C, bc_dx)
        self.dx_splits, self.dx_per = _splits(dx_blocks, max(T, 1), bt_dx)
        self.dx_grid = (dx_blocks, self.dx_splits)
        self.dx_meta = Meta(HAS_G=has_g, N=n, M=self.m, MP=self.mp, BT=bt_dx, BC=bc_dx,
                            PREC=_dot_precision(dtype, forced), X_BCAST=bcast,
                            LOOP_STAGES=stages_dx, num_warps=warps_dx, num_stages=stages_dx)
        mk = self.m * self.K
        self.grads_grid = (cdiv(mk, _PARAM_GRADS_BLOCK) + 1,)
        self.grads_meta = Meta(M=self.m, MP=self.mp, BLOCK=_PARAM_GRADS_BLOCK,
                               ROWS_STEP=max(1, min(32, next_pow2(self.map_programs))),
                               num_warps=4)


def _launch_dx_dphi(p: _PreBackwardPlan, *args) -> None:
    """``_pre_dx_dphi`` at its plan's loop stages, one stage fewer (kept in the plan) each time
    the GPU's shared memory cannot hold them: with the combine's ``g`` a stage buffers n
    stream tiles of it, too many for 3 stages at n=8 in fp32 on an H100."""
    while True:
        try:
            _DX_DPHI(p.dx_grid, p.dx_meta, *args)
            return
        except OutOfResources:
            stages = p.dx_meta.kwargs["LOOP_STAGES"]
            if stages <= 1:
                raise
            p.dx_meta = Meta(**{**p.dx_meta.kwargs, "LOOP_STAGES": stages - 1,
                                "num_stages": stages - 1})
            log_rank0(logger, logging.INFO, "mHC dx pass: %d loop stages do not fit in shared "
                      "memory here; %d", stages, stages - 1)


def _launch_aggregate(x: torch.Tensor, h_pre: torch.Tensor, y: torch.Tensor,
                      bcast: bool) -> None:
    """``y [T, C] = sum_i h_pre[:, i] x[:, i]`` for ``x [T, n, C]`` as
    :func:`streams_operand` returns it (``bcast``), fp32 ``h_pre [T, n]`` (T > 0): the one
    launch of the aggregate, shared by pre's forward and :func:`aggregate`, so that both
    give the same bits."""
    T, n, C = x.shape
    p = plan(_AggregatePlan, T, n, C, bcast)
    _AGG(p.grid, p.meta, x, h_pre, y, T, C)


class _PreFn(torch.autograd.Function):
    """``x`` is ``[T, n, C]`` (``n_streams`` None; possibly one broadcast row a token, read
    as is: :func:`streams_operand`) or the streams ``[..., n*C]``; ``y`` is ``[T, C]`` or
    ``[..., C]`` accordingly, the mappings are per token."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, iters, eps, link, n_streams=None):
        x, bcast = streams_operand(x)
        x3 = as_tokens(x, n_streams)
        T, n, C = x3.shape
        _check(x3, n)
        phi, alpha, bias = phi.contiguous(), alpha.contiguous(), bias.contiguous()
        dev, f32 = x.device, torch.float32
        mp = _padded_m(n)
        y = torch.empty(aggregate_shape(x, n_streams, C), device=dev, dtype=x.dtype)
        h_pre = torch.empty(T, n, device=dev, dtype=f32)
        h_post = torch.empty(T, n, device=dev, dtype=f32)
        h_res = torch.empty(T, n, n, device=dev, dtype=f32)
        ht = torch.empty(T, mp, device=dev, dtype=f32)
        rstd = torch.empty(T, device=dev, dtype=f32)
        if T > 0:
            p = plan(_PreForwardPlan, T, n, C, x.dtype, forced_precision(), bcast)
            part = torch.empty(p.splits, T, mp, device=dev, dtype=f32)
            part_ss = torch.empty(p.splits, T, device=dev, dtype=f32)
            _PROJ(p.proj_grid, p.proj_meta, x, phi, part, part_ss, T, p.K, C, p.per)
            _MAPS_FWD(p.map_grid, p.map_meta, part, part_ss, alpha, bias, h_pre, h_post, h_res,
                      ht, rstd, T, p.K, p.splits, float(eps), int(iters))
            _launch_aggregate(x3, h_pre, y, bcast)
        ctx.save_for_backward(x, phi, alpha, bias, ht, rstd, h_pre)
        ctx.bcast = bcast
        ctx.iters = int(iters)
        ctx.n_streams = n_streams
        ctx.link = link
        ctx.set_materialize_grads(False)  # unused outputs get None: their work is skipped
        return y, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dy, dh_pre, dh_post, dh_res):
        x, phi, alpha, bias, ht, rstd, h_pre = ctx.saved_tensors
        T, n, C = as_tokens(x, ctx.n_streams).shape
        dev, f32 = x.device, torch.float32
        g_combine = h_res_combine = None  # the combine's upstream gradient and H_res
        if ctx.link is not None and ctx.link.pending is not None:
            (g_combine, h_res_combine), ctx.link.pending = ctx.link.pending, None
        p = plan(_PreBackwardPlan, T, n, C, x.dtype, forced_precision(), dh_pre is not None,
                 g_combine is not None, ctx.bcast)
        dphi = torch.empty(p.m, p.K, device=dev, dtype=phi.dtype)
        dbias = torch.empty(p.m, device=dev, dtype=bias.dtype)
        dalpha = torch.empty(3, device=dev, dtype=alpha.dtype)
        if T == 0:
            dx = x.new_zeros(x.shape)
            return dx, dphi.zero_(), dalpha.zero_(), dbias.zero_(), None, None, None, None
        dy = (torch.zeros(aggregate_shape(x, ctx.n_streams, C), device=dev, dtype=x.dtype)
              if dy is None else dy.contiguous())
        dh_post = torch.zeros(T, n, device=dev) if dh_post is None else contiguous_f32(dh_post)
        dh_res = torch.zeros(T, n, n, device=dev) if dh_res is None else contiguous_f32(dh_res)
        dx = x.new_empty(x.shape)  # contiguous, also for a broadcast x
        dp = torch.empty(T, p.mp, device=dev, dtype=f32)  # every column written
        coef = torch.empty(T, device=dev, dtype=f32)
        dphi_part = torch.empty(p.dx_splits, p.mp, p.K, device=dev, dtype=f32)
        red_part = torch.empty(p.map_programs, p.mp, device=dev, dtype=f32)
        part = torch.empty(p.dh_splits, T, n, device=dev, dtype=f32)
        _DHPRE(p.dh_grid, p.dh_meta, x, dy, part, T, C, p.dh_per)
        hist = torch.empty(max(ctx.iters, 1), T, n * n, device=dev, dtype=f32)
        dh_pre = contiguous_f32(dh_pre) if dh_pre is not None else dh_post  # (unread if None)
        _MAPS_BWD((p.map_programs,), p.map_meta, part, p.dh_splits, dh_pre, dh_post, dh_res, ht,
                  rstd, alpha, bias, red_part, dp, coef, hist, T, p.K, ctx.iters)
        del hist
        fold = g_combine is not None
        _launch_dx_dphi(p, x, dy, h_pre, dp, coef, phi,
                        g_combine if fold else x, h_res_combine if fold else h_pre,  # unread
                        dx, dphi_part, T, C, p.dx_per)
        _PARAM_GRADS(p.grads_grid, p.grads_meta, dphi_part, red_part, dphi, dbias, dalpha,
                     p.dx_splits, p.mp * p.K, p.m * p.K, p.map_programs)
        return dx, dphi, dalpha, dbias, None, None, None, None


def pre(x, phi, alpha, bias, sinkhorn_iterations, eps, n=None):
    """Fused mappings + aggregate: ``(y, h_pre [T,n], h_post [T,n], h_res [T,n,n])`` for
    ``x [T, n, C]`` (``y [T, C]``) or, with ``n`` given, for the streams ``x [..., n*C]``
    (``y [..., C]``; no reshape outside the op, so no view nodes in the autograd graph)."""
    link = DxLink(x) if torch.is_grad_enabled() and x.requires_grad else None
    outs = _PreFn.apply(x, phi, alpha, bias, sinkhorn_iterations, eps, link, n)
    if link is not None:
        outs[3]._mhc_dx_link = link
    return outs


def aggregate(x, h_pre, n=None):
    """``y`` of :func:`pre` from ``x`` (``[T, n, C]``, or ``[..., n*C]`` with ``n``) and pre's
    ``h_pre [T, n]``, bit for bit (the same kernel launch); no autograd: ``mhc_recompute``
    replays it in backward."""
    x, bcast = streams_operand(x)
    x3 = as_tokens(x, n)
    T, n_streams, C = x3.shape
    _check(x3, n_streams)
    if torch.is_grad_enabled() and (x.requires_grad or h_pre.requires_grad):
        raise RuntimeError("triton_mhc.aggregate has no backward: it is the recompute's replay "
                           "of pre's aggregate. Fix: call it under torch.no_grad(), or use pre.")
    y = torch.empty(aggregate_shape(x, n, C), device=x.device, dtype=x.dtype)
    if T > 0:
        _launch_aggregate(x3, contiguous_f32(h_pre), y, bcast)
    return y
