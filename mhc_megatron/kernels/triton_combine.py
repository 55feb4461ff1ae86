"""The fused Triton "combine" op of mHC (expand-combine), forward and backward.

``combine(x [T, n, C], f [T, C], f_bias [C] | None, h_res [T, n, n], h_post [T, n])
-> x' [T, n, C] = H_res x + H_post (f + f_bias)`` in ``x.dtype``, the math of
:func:`mhc_megatron.kernels.reference.expand_combine`.

``_combine_fwd`` on a (token x channel) grid walked row by row (``token_rows``);
``_combine_bwd``: ``dx``, ``df``, ``dH_post``, ``dH_res`` for a token block, looping over C.
When ``h_res`` comes from :func:`~mhc_megatron.kernels.triton_pre.pre` on this same ``x``, the
backward forms no ``dx``: it hands its upstream gradient ``g`` and ``h_res`` to pre's backward,
whose dx pass adds ``H_res^T g`` (:class:`~mhc_megatron.kernels.handoff.DxLink`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels.handoff import ProjectionHandoff
from mhc_megatron.kernels.launch import Launcher, Meta, cdiv, next_pow2
from mhc_megatron.kernels.reference import aggregate_shape, as_tokens
from mhc_megatron.kernels.triton_common import (
    _INTERPRETED,
    PROJECTION_STREAMS,
    TILES,
    _aggregate_tile,
    _check,
    _combine_tile,
    _dot_precision,
    _padded_m,
    _proj_dot,
    _projection_splits_phi,
    _splits,
    contiguous_f32,
    forced_precision,
    plan,
    stream_strides,
    streams_operand,
    token_block,
    token_rows,
)


@triton.jit
def _combine_fwd(x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, out_ptr, hnext_ptr, y_ptr, T, C,
                 HAS_BIAS: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 X_BCAST: tl.constexpr, HAS_AGG: tl.constexpr):
    """out [T, N, C] = H_res x + H_post (f + bias); x may be broadcast (X_BCAST).

    HAS_AGG (the recompute's replay, :func:`combine_aggregate`): also the next pre's aggregate
    of ``out``, ``y [T, C] = sum_i h_next[t, i] out[t, i, c]`` (``hnext [T, N]`` fp32), by
    the helper of ``_aggregate_fwd`` (the same bits) on the tile this program just stored,
    read back from cache: ``out`` makes no second trip through memory."""
    cb, t, tmask, t64 = token_rows(T, BT, tl.cdiv(C, BC), False)  # ascending (the projection
    XT, XS = stream_strides(N, C, X_BCAST)                        # after it walks down)
    c = cb * BC + tl.arange(0, BC)
    m2 = tmask[:, None] & (c < C)[None, :]
    K = N * C
    i = tl.arange(0, N)
    acc = _combine_tile(x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, t64, tmask, c, m2, XT, XS,
                        C, HAS_BIAS, N)
    tl.store(out_ptr + t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m2[:, None, :])
    if HAS_AGG:
        tl.debug_barrier()  # the tile's x' is read back (from cache) as the aggregate reads it
        y = _aggregate_tile(out_ptr, hnext_ptr, t64, tmask, c, m2, K, C, N, BT, BC)
        tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _combine_proj_fwd(x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, out_ptr, phi_ptr, part_ptr,
                      ss_ptr, T, C, C_PER_SPLIT, HAS_BIAS: tl.constexpr, N: tl.constexpr,
                      M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      X_BCAST: tl.constexpr, PREC: tl.constexpr, SPLIT_PHI: tl.constexpr,
                      INTERPRETED: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """``out [T, N, C]`` as :func:`_combine_fwd` writes it (the same helper, the same bits),
    and the next pre's projection of ``out`` onto its ``phi [M, N*C]`` from the tile in
    registers (:class:`~mhc_megatron.kernels.handoff.ProjectionHandoff`): for this program's
    tokens and channel split ``s``, ``part[s, t, :] = sum_{i, c in s} out[t, i, c]
    phi[:, i*C + c]`` and ``ss[s, t] = sum out[t, i, c]^2``, of ``out`` as stored (rounded to
    its dtype), i.e. what ``_proj_partial`` computes from ``out`` with the channel splits in
    place of its K splits. A (token block x channel split) grid walked up
    (:func:`~mhc_megatron.kernels.triton_common.token_rows`); each step a tile
    ``[BT, N, BC]``, laid flat as ``[BT, N*BC]`` (column ``i*BC + c``) for one 2-D dot
    against the matching rows of ``phi^T`` (loaded once per token block: ``BT`` tokens
    share them). The channel loop is software-pipelined (``LOOP_STAGES``)."""
    split, t, tmask, t64 = token_rows(T, BT, tl.cdiv(C, C_PER_SPLIT), False)
    XT, XS = stream_strides(N, C, X_BCAST)
    K = N * C
    i = tl.arange(0, N)
    r = tl.arange(0, N * BC)  # flat tile columns: stream r // BC, channel c0 + r % BC
    mcol = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    c_start = split * C_PER_SPLIT
    for c0 in tl.range(c_start, c_start + C_PER_SPLIT, BC, num_stages=LOOP_STAGES):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        o = _combine_tile(x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, t64, tmask, c, m2, XT,
                          XS, C, HAS_BIAS, N).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :], o,
                 mask=m2[:, None, :])
        of = o.to(tl.float32)  # zero outside the tile's tokens and channels
        ss += tl.sum(tl.sum(of * of, axis=2), axis=1)
        cr = c0 + r % BC
        ph = tl.load(phi_ptr + mcol[None, :].to(tl.int64) * K + ((r // BC) * C + cr)[:, None],
                     mask=(cr < C)[:, None] & (mcol[None, :] < M), other=0.0).to(tl.float32)
        acc = _proj_dot(tl.reshape(o, [BT, N * BC]), ph, acc, PREC, SPLIT_PHI, INTERPRETED)
    row = split.to(tl.int64) * T + t64
    tl.store(part_ptr + row[:, None] * MP + mcol[None, :], acc, mask=tmask[:, None])
    tl.store(ss_ptr + row, ss, mask=tmask)


@triton.jit
def _combine_bwd(g_ptr, x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr,
                 dx_ptr, df_ptr, dhres_ptr, dhpost_ptr, T, C,
                 HAS_BIAS: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 X_BCAST: tl.constexpr, LOOP_STAGES: tl.constexpr, HAS_DX: tl.constexpr):
    """dx [T, N, C], df, dH_post, dH_res for a token block; x may be broadcast (X_BCAST).
    Without HAS_DX no dx: pre's dx pass forms ``H_res^T g`` itself (the fold, see
    :class:`~mhc_megatron.kernels.handoff.DxLink`).

    The channel loop is software-pipelined (``LOOP_STAGES``: the next steps' loads are in
    flight while a step computes; Triton pipelines a loop without ``tl.dot`` only when the
    loop itself asks for it, not from the launch's ``num_stages``)."""
    t, tmask, t64 = token_block(T, BT)
    K = N * C
    XT, XS = stream_strides(N, C, X_BCAST)
    i = tl.arange(0, N)
    h_post = tl.load(hpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    d_post = tl.zeros([BT, N], dtype=tl.float32)
    d_res = tl.zeros([BT, N, N], dtype=tl.float32)
    for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        g3 = tl.load(g_ptr + t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :],
                     mask=m2[:, None, :], other=0.0).to(tl.float32)
        f = tl.load(f_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            f += tl.load(fbias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
        df = tl.sum(g3 * h_post[:, :, None], axis=1)
        tl.store(df_ptr + t64[:, None] * C + c[None, :], df.to(df_ptr.dtype.element_ty), mask=m2)
        d_post += tl.sum(g3 * f[:, None, :], axis=2)
        for j in tl.static_range(N):
            xj = tl.load(x_ptr + t64[:, None] * XT + j * XS + c[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            col = tl.sum(g3 * xj[:, None, :], axis=2)  # dH_res[:, :, j] contribution
            d_res += tl.where(i[None, None, :] == j, col[:, :, None], 0.0)
            if HAS_DX:
                h_col = tl.load(hres_ptr + t64[:, None] * (N * N) + i[None, :] * N + j,
                                mask=tmask[:, None], other=0.0)
                dxj = tl.sum(h_col[:, :, None] * g3, axis=1)
                tl.store(dx_ptr + t64[:, None] * K + j * C + c[None, :],
                         dxj.to(dx_ptr.dtype.element_ty), mask=m2)
    ij = i[:, None] * N + i[None, :]
    tl.store(dhpost_ptr + t64[:, None] * N + i[None, :], d_post, mask=tmask[:, None])
    tl.store(dhres_ptr + t64[:, None, None] * (N * N) + ij[None, :, :], d_res,
             mask=tmask[:, None, None])


# ------------------------------------------------------------------------------- host side
_FWD, _BWD = Launcher(_combine_fwd), Launcher(_combine_bwd)
_FWD_PROJ = Launcher(_combine_proj_fwd)


class _CombinePlan:
    """Launch shapes of the combine, forward and backward, for ``x [T, n, C]`` (T > 0)."""

    def __init__(self, T: int, n: int, C: int, has_bias: bool, bcast: bool):
        bt, bc, warps = TILES.combine_fwd
        bc = min(bc, next_pow2(C))
        self.fwd_grid = (cdiv(T, bt) * cdiv(C, bc),)  # token_rows
        self.fwd_meta = Meta(HAS_BIAS=has_bias, N=n, BT=bt, BC=bc, X_BCAST=bcast,
                             HAS_AGG=False, num_warps=warps)
        self.fwd_agg_meta = Meta(HAS_BIAS=has_bias, N=n, BT=bt, BC=bc, X_BCAST=bcast,
                                 HAS_AGG=True, num_warps=warps)
        bt, bc, warps, stages = TILES.combine_bwd
        self.bwd_grid = (cdiv(T, bt),)
        self.bwd_meta = Meta(HAS_BIAS=has_bias, N=n, BT=bt, BC=min(bc, next_pow2(C)),
                             X_BCAST=bcast, LOOP_STAGES=stages, HAS_DX=True, num_warps=warps)
        self.bwd_fold_meta = Meta(HAS_BIAS=has_bias, N=n, BT=bt, BC=min(bc, next_pow2(C)),
                                  X_BCAST=bcast, LOOP_STAGES=stages, HAS_DX=False,
                                  num_warps=warps)


class _CombineProjectionPlan:
    """Launch shape of ``_combine_proj_fwd`` for ``x [T, n, C]`` (T > 0) of ``dtype``: the
    projection's precision as pre's own (``forced``: :func:`forced_precision`)."""

    def __init__(self, T: int, n: int, C: int, has_bias: bool, bcast: bool, dtype: torch.dtype,
                 forced: str | None):
        bt, bc, warps, stages = TILES.combine_proj
        bc = min(bc, max(16, next_pow2(C)))
        self.mp = _padded_m(n)
        self.splits, self.per = _splits(cdiv(T, bt), C, bc)
        self.grid = (cdiv(T, bt) * self.splits,)  # token_rows
        self.meta = Meta(HAS_BIAS=has_bias, N=n, M=2 * n + n * n, MP=self.mp, BT=bt, BC=bc,
                         X_BCAST=bcast, PREC=_dot_precision(dtype, forced),
                         SPLIT_PHI=_projection_splits_phi(dtype, forced),
                         INTERPRETED=_INTERPRETED, LOOP_STAGES=stages, num_warps=warps,
                         num_stages=stages)


def _launch_combine_projection(x, f, f_bias, h_res, h_post, out, bcast,
                               handoff: ProjectionHandoff) -> None:
    """:func:`_launch_combine`'s ``out`` and, into ``handoff``, the next pre's projection
    partials of ``out`` onto ``handoff.phi`` (``_combine_proj_fwd``); ``x [T, n, C]`` as
    :func:`streams_operand` returns it, n in ``PROJECTION_STREAMS``, T > 0."""
    T, n, C = x.shape
    p = plan(_CombineProjectionPlan, T, n, C, f_bias is not None, bcast, x.dtype,
             forced_precision())
    part = torch.empty(p.splits, T, p.mp, device=x.device, dtype=torch.float32)
    ss = torch.empty(p.splits, T, device=x.device, dtype=torch.float32)
    _FWD_PROJ(p.grid, p.meta, x, f, f_bias if f_bias is not None else f, h_res, h_post, out,
              handoff.phi.contiguous(), part, ss, T, C, p.per)
    handoff.part, handoff.ss = part, ss


def _launch_combine(x, f, f_bias, h_res, h_post, out, bcast, h_next=None, y=None) -> None:
    """``out = H_res x + H_post (f + f_bias)`` for ``x [T, n, C]`` as :func:`streams_operand`
    returns it (``bcast``), fp32 mappings (T > 0); with ``h_next`` also the next pre's
    aggregate of ``out`` into ``y`` (``HAS_AGG``). The one launch of the combine's forward,
    shared by the autograd op and the recompute's fused replay: the same tiles, so the same
    ``out``."""
    T, n, C = x.shape
    p = plan(_CombinePlan, T, n, C, f_bias is not None, bcast)
    fb = f_bias if f_bias is not None else f  # unread without HAS_BIAS
    if h_next is None:  # HAS_AGG off: h_next / y unread
        _FWD(p.fwd_grid, p.fwd_meta, x, f, fb, h_res, h_post, out, h_post, f, T, C)
    else:
        _FWD(p.fwd_grid, p.fwd_agg_meta, x, f, fb, h_res, h_post, out, h_next, y, T, C)


class _CombineFn(torch.autograd.Function):
    """``x`` is ``[T, n, C]`` and ``f [T, C]`` (``n_streams`` None), or the streams
    ``[..., n*C]`` and ``f [..., C]``; the output has ``x``'s shape."""

    @staticmethod
    def forward(ctx, x, f, f_bias, h_res, h_post, link, n_streams=None, projection=None):
        (x, bcast), f = streams_operand(x), f.contiguous()
        T, n, C = as_tokens(x, n_streams).shape
        _check(x, n)
        ctx.mapping_dtypes = (h_res.dtype, h_post.dtype)  # grads are returned in these
        h_res, h_post = contiguous_f32(h_res), contiguous_f32(h_post)
        out = x.new_empty(x.shape)  # contiguous, also for a broadcast x
        if T > 0 and projection is not None and n in PROJECTION_STREAMS:
            _launch_combine_projection(as_tokens(x, n_streams), f, f_bias, h_res, h_post, out,
                                       bcast, projection)
        elif T > 0:
            _launch_combine(as_tokens(x, n_streams), f, f_bias, h_res, h_post, out, bcast)
        ctx.save_for_backward(x, f, f_bias, h_res, h_post)
        ctx.n_streams = n_streams
        ctx.bcast = bcast
        ctx.link = link
        return out

    @staticmethod
    def backward(ctx, g):
        x, f, f_bias, h_res, h_post = ctx.saved_tensors
        T, n, C = as_tokens(x, ctx.n_streams).shape
        g = g.contiguous()
        fold = ctx.link is not None  # pre's dx pass forms H_res^T g: no dx here
        dx = None if fold else x.new_empty(x.shape)  # contiguous, also for a broadcast x
        df = torch.empty_like(f)
        dh_res = torch.empty(T, n, n, device=x.device, dtype=torch.float32)
        dh_post = torch.empty(T, n, device=x.device, dtype=torch.float32)
        if T > 0:
            p = plan(_CombinePlan, T, n, C, f_bias is not None, ctx.bcast)
            _BWD(p.bwd_grid, p.bwd_fold_meta if fold else p.bwd_meta, g, x, f,
                 f_bias if f_bias is not None else f, h_res, h_post,
                 g if fold else dx, df, dh_res, dh_post, T, C)  # (dx unwritten in a fold)
        dbias = None
        if f_bias is not None and ctx.needs_input_grad[2]:
            # bf16/fp16 sums accumulate in fp32 inside torch's reduction: no fp32 copy of df
            dbias = df.view(-1, C).sum(
                0, dtype=torch.float32 if f_bias.dtype == torch.float32 else None)
            dbias = dbias.to(f_bias.dtype)
        if fold:
            ctx.link.pending = (g, h_res)  # pre's backward adds H_res^T g (see DxLink)
        res_dtype, post_dtype = ctx.mapping_dtypes
        if res_dtype != torch.float32:
            dh_res = dh_res.to(res_dtype)
        if post_dtype != torch.float32:
            dh_post = dh_post.to(post_dtype)
        return dx, df, dbias, dh_res, dh_post, None, None, None


def combine(x, f, f_bias, h_res, h_post, n=None, projection=None):
    """Fused expand-combine ``H_res x + H_post (f + f_bias)`` in ``x.dtype``: ``x [T, n, C]``,
    ``f [T, C]``, or with ``n`` given the streams ``x [..., n*C]`` and ``f [..., C]`` (no
    reshape outside the op, so no view nodes in the autograd graph); ``x``'s shape out.

    If ``h_res`` comes from :func:`~mhc_megatron.kernels.triton_pre.pre` on this same ``x``,
    the combine's ``dx = H_res^T g`` is formed inside pre's backward kernel, which adds it to
    pre's own: never written, never summed by autograd (see
    :class:`~mhc_megatron.kernels.handoff.DxLink`).

    ``projection``: a :class:`~mhc_megatron.kernels.handoff.ProjectionHandoff` for the pre
    that reads the output next; the combine fills it with that pre's projection partials of
    the output (n in ``PROJECTION_STREAMS``, else it stays empty) for the caller to attach."""
    link = getattr(h_res, "_mhc_dx_link", None)
    if link is not None and not (torch.is_grad_enabled() and link.claim(x)):
        link = None
    return _CombineFn.apply(x, f, f_bias, h_res, h_post, link, n, projection)


def combine_aggregate(x, f, f_bias, h_res, h_post, h_pre, n=None):
    """``(x', y)``: :func:`combine` and then the next pre's aggregate of its output,
    ``aggregate(x', h_pre, n)`` (:func:`~mhc_megatron.kernels.triton_pre.aggregate`), in one
    pass, bit for bit equal to the two ops: ``x'`` is not read back. ``h_pre [T, n]`` is the
    next pre's (fp32); ``y`` is ``[T, C]``, or ``[..., C]`` for the streams ``[..., n*C]``.
    No autograd: ``mhc_recompute`` replays the pair with it in backward
    (:func:`~mhc_megatron.recompute.register_replay_fusion`)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, f, f_bias, h_res, h_post, h_pre)):
        raise RuntimeError("triton_mhc.combine_aggregate has no backward: it is the recompute's "
                           "replay of a combine and the next aggregate. Fix: call it under "
                           "torch.no_grad(), or use combine and pre.")
    (x, bcast), f = streams_operand(x), f.contiguous()
    T, n_streams, C = as_tokens(x, n).shape
    _check(x, n_streams)
    h_res, h_post, h_pre = contiguous_f32(h_res), contiguous_f32(h_post), contiguous_f32(h_pre)
    out = x.new_empty(x.shape)
    y = torch.empty(aggregate_shape(out, n, C), device=x.device, dtype=x.dtype)
    if T > 0:
        _launch_combine(as_tokens(x, n), f, f_bias, h_res, h_post, out, bcast, h_pre, y)
    return out, y
