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

With ``norm = (weight, eps)`` the aggregate is ``_aggregate_norm_fwd``, which also forms the
sublayer's input RMSNorm of ``y``, and the backward folds the norm's backward in
(:mod:`~mhc_megatron.kernels.triton_input_norm`).

Backward (kernels in :mod:`~mhc_megatron.kernels.triton_pre_bwd`): ``_dhpre_partial``
(``dH_pre`` partials over C splits), ``_mappings_bwd`` (sigmoid
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
from mhc_megatron.kernels.triton_pre_bwd import (
    _dhpre_partial,
    _mappings_bwd,
    _param_grads,
    _pre_dx_dphi,
)
from mhc_megatron.kernels.triton_input_norm import (
    DHPRE_NORM,
    NormLink,
    launch_aggregate_norm,
    norm_backward_unfused,
)
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
                 has_dhpre: bool, has_g: bool, bcast: bool, norm: bool = False):
        self.m, self.mp, self.K = 2 * n + n * n, _padded_m(n), n * C
        bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
        self.dh_splits, per = _splits(cdiv(T, bt), C, bc)
        self.dh_grid = (cdiv(T, bt), self.dh_splits)
        self.dh_per = per
        self.dh_meta = Meta(N=n, BT=bt, BC=bc, X_BCAST=bcast, num_warps=warps)
        map_bt, map_warps = TILES.maps
        self.map_programs = max(cdiv(T, map_bt), 1)
        self.map_meta = Meta(HAS_DHPRE=has_dhpre, NORM=norm, N=n, MP=self.mp, BT=map_bt,
                             num_warps=map_warps)
        bt_dx, bc_dx, warps_dx, stages_dx = TILES.dx
        bc_dx = min(bc_dx, max(16, next_pow2(C)))
        dx_blocks = n * cdiv(C, bc_dx)
        self.dx_splits, self.dx_per = _splits(dx_blocks, max(T, 1), bt_dx)
        self.dx_grid = (dx_blocks, self.dx_splits)
        self.dx_meta = Meta(HAS_G=has_g, NORM=norm, N=n, M=self.m, MP=self.mp, BT=bt_dx,
                            BC=bc_dx,
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
    ``[..., C]`` accordingly, the mappings are per token. With ``norm_w`` (the input norm
    fused, :mod:`~mhc_megatron.kernels.triton_input_norm`) the forward also parks the
    normalised ``y`` on ``norm_link``, and the backward takes the norm's upstream gradient
    from it."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, iters, eps, link, n_streams=None, norm_w=None,
                norm_link=None):
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
        norm = norm_w is not None
        if norm:
            norm_w = norm_w.contiguous()
            norm_link.yn = torch.empty_like(y)
            norm_link.rstd = torch.empty(T, device=dev, dtype=f32)
        if T > 0:
            p = plan(_PreForwardPlan, T, n, C, x.dtype, forced_precision(), bcast)
            part = torch.empty(p.splits, T, mp, device=dev, dtype=f32)
            part_ss = torch.empty(p.splits, T, device=dev, dtype=f32)
            _PROJ(p.proj_grid, p.proj_meta, x, phi, part, part_ss, T, p.K, C, p.per)
            _MAPS_FWD(p.map_grid, p.map_meta, part, part_ss, alpha, bias, h_pre, h_post, h_res,
                      ht, rstd, T, p.K, p.splits, float(eps), int(iters))
            if norm:
                launch_aggregate_norm(x3, h_pre, norm_w, y, norm_link.yn, norm_link.rstd,
                                      norm_link.eps, bcast)
            else:
                _launch_aggregate(x3, h_pre, y, bcast)
        ctx.save_for_backward(x, phi, alpha, bias, ht, rstd, h_pre,
                              *((norm_w, norm_link.rstd) if norm else ()))
        ctx.bcast = bcast
        ctx.iters = int(iters)
        ctx.n_streams = n_streams
        ctx.link = link
        ctx.norm_link = norm_link
        ctx.set_materialize_grads(False)  # unused outputs get None: their work is skipped
        return y, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dy, dh_pre, dh_post, dh_res):
        x, phi, alpha, bias, ht, rstd, h_pre, *normed = ctx.saved_tensors
        T, n, C = as_tokens(x, ctx.n_streams).shape
        dev, f32 = x.device, torch.float32
        g_combine = h_res_combine = None  # the combine's upstream gradient and H_res
        if ctx.link is not None and ctx.link.pending is not None:
            (g_combine, h_res_combine), ctx.link.pending = ctx.link.pending, None
        norm_w, norm_rstd = normed if normed else (None, None)
        dw = None if norm_w is None else torch.zeros(C, device=dev, dtype=f32)
        pending = None
        if ctx.norm_link is not None:
            pending, ctx.norm_link.pending = ctx.norm_link.pending, None
        if pending is not None and dy is not None:  # y has another consumer: norm unfused
            dy_norm, dw = norm_backward_unfused(*pending, norm_w, norm_rstd)
            dy, pending = (dy.float() + dy_norm).to(dy.dtype), None
        norm = pending is not None
        p = plan(_PreBackwardPlan, T, n, C, x.dtype, forced_precision(), dh_pre is not None,
                 g_combine is not None, ctx.bcast, norm)
        dphi = torch.empty(p.m, p.K, device=dev, dtype=phi.dtype)
        dbias = torch.empty(p.m, device=dev, dtype=bias.dtype)
        dalpha = torch.empty(3, device=dev, dtype=alpha.dtype)
        if dw is not None:
            dw = dw.to(norm_w.dtype)
        if T == 0:
            dx = x.new_zeros(x.shape)
            return (dx, dphi.zero_(), dalpha.zero_(), dbias.zero_(), None, None, None, None, dw,
                    None)
        if norm:
            dy, y_saved = pending  # dy: the normalised input's gradient (dyn)
        elif dy is None:
            dy = torch.zeros(aggregate_shape(x, ctx.n_streams, C), device=dev, dtype=x.dtype)
        else:
            dy = dy.contiguous()
        dh_post = torch.zeros(T, n, device=dev) if dh_post is None else contiguous_f32(dh_post)
        dh_res = torch.zeros(T, n, n, device=dev) if dh_res is None else contiguous_f32(dh_res)
        dx = x.new_empty(x.shape)  # contiguous, also for a broadcast x
        dp = torch.empty(T, p.mp, device=dev, dtype=f32)  # every column written
        coef = torch.empty(T, device=dev, dtype=f32)
        dphi_part = torch.empty(p.dx_splits, p.mp, p.K, device=dev, dtype=f32)
        red_part = torch.empty(p.map_programs, p.mp, device=dev, dtype=f32)
        part = torch.empty(p.dh_splits, T, n, device=dev, dtype=f32)
        if norm:
            y_saved = y_saved.contiguous()
            norm_e = torch.empty(p.dh_splits, T, n, device=dev, dtype=f32)
            norm_a = torch.empty(p.dh_splits, T, device=dev, dtype=f32)
            norm_coef = torch.empty(T, device=dev, dtype=f32)
            dw_part = torch.empty(p.dh_grid[0], C, device=dev, dtype=f32)
            DHPRE_NORM(p.dh_grid, p.dh_meta, x, dy, norm_w, h_pre, norm_rstd, part, norm_e,
                       norm_a, dw_part, T, C, p.dh_per)
        else:
            _DHPRE(p.dh_grid, p.dh_meta, x, dy, part, T, C, p.dh_per)
            y_saved = norm_e = norm_a = norm_rstd = norm_coef = dw_part = rstd  # unread
            norm_w = h_pre  # unread
        hist = torch.empty(max(ctx.iters, 1), T, n * n, device=dev, dtype=f32)
        dh_pre = contiguous_f32(dh_pre) if dh_pre is not None else dh_post  # (unread if None)
        _MAPS_BWD((p.map_programs,), p.map_meta, part, p.dh_splits, dh_pre, dh_post, dh_res, ht,
                  rstd, alpha, bias, red_part, dp, coef, hist, T, p.K, ctx.iters, norm_e, norm_a,
                  norm_rstd, norm_coef)
        del hist
        fold = g_combine is not None
        _launch_dx_dphi(p, x, dy, h_pre, dp, coef, phi,
                        g_combine if fold else x, h_res_combine if fold else h_pre,  # unread
                        dx, dphi_part, T, C, p.dx_per, norm_w, y_saved, norm_rstd, norm_coef)
        _PARAM_GRADS(p.grads_grid, p.grads_meta, dphi_part, red_part, dphi, dbias, dalpha,
                     p.dx_splits, p.mp * p.K, p.m * p.K, p.map_programs)
        if norm:
            dw = dw_part.sum(dim=0).to(dw.dtype)
        return dx, dphi, dalpha, dbias, None, None, None, None, dw, None


def pre(x, phi, alpha, bias, sinkhorn_iterations, eps, n=None, norm=None):
    """Fused mappings + aggregate: ``(y, h_pre [T,n], h_post [T,n], h_res [T,n,n])`` for
    ``x [T, n, C]`` (``y [T, C]``) or, with ``n`` given, for the streams ``x [..., n*C]``
    (``y [..., C]``; no reshape outside the op, so no view nodes in the autograd graph).
    ``norm = (weight [C], eps)``: the same kernels also form ``RMSNorm(y) * weight``, which
    :func:`~mhc_megatron.kernels.triton_input_norm.input_norm` of this ``y`` returns."""
    link = DxLink(x) if torch.is_grad_enabled() and x.requires_grad else None
    norm_w, norm_link = (None, None) if norm is None else (norm[0], NormLink(*norm))
    outs = _PreFn.apply(x, phi, alpha, bias, sinkhorn_iterations, eps, link, n, norm_w,
                        norm_link)
    if link is not None:
        outs[3]._mhc_dx_link = link
    if norm_link is not None:
        norm_link.park(outs[0])
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
