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

import functools

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels import host_replay, native_autograd
from mhc_megatron.kernels.autograd_apply import applier
from mhc_megatron.kernels.handoff import node_link
from mhc_megatron.kernels.launch import Launcher, LaunchPlan, Meta, cdiv, next_pow2, signature
from mhc_megatron.kernels.reference import aggregate_shape, token_dims
from mhc_megatron.kernels.triton_common import (
    TILES,
    _aggregate_tile,
    _check,
    contiguous_f32,
    plan,
    records_autograd,
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
    the helper of ``triton_pre_fwd._aggregate_fwd``
    (:func:`~mhc_megatron.kernels.triton_common._aggregate_tile`: the same bits) on the tile
    this program just stored, read back from cache: ``out`` makes no second trip through
    memory."""
    cb, t, tmask, t64 = token_rows(T, BT, tl.cdiv(C, BC), False)  # ascending (the projection
    XT, XS = stream_strides(N, C, X_BCAST)                        # after it walks down)
    c = cb * BC + tl.arange(0, BC)
    m2 = tmask[:, None] & (c < C)[None, :]
    K = N * C
    i = tl.arange(0, N)
    f = tl.load(f_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        f += tl.load(fbias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
    h_post = tl.load(hpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    acc = h_post[:, :, None] * f[:, None, :]
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + t64[:, None] * XT + j * XS + c[None, :], mask=m2, other=0.0)
        h_col = tl.load(hres_ptr + t64[:, None] * (N * N) + i[None, :] * N + j,
                        mask=tmask[:, None], other=0.0)
        acc += h_col[:, :, None] * xj.to(tl.float32)[:, None, :]
    tl.store(out_ptr + t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m2[:, None, :])
    if HAS_AGG:
        tl.debug_barrier()  # the tile's x' is read back (from cache) as the aggregate reads it
        y = _aggregate_tile(out_ptr, hnext_ptr, t64, tmask, c, m2, K, C, N, BT, BC)
        tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


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


class _CombinePlan(LaunchPlan):
    """Launch shapes of the combine, forward and backward, for ``x [T, n, C]`` (T > 0)."""

    def __init__(self, T: int, n: int, C: int, has_bias: bool, bcast: bool):
        super().__init__()
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


def _launch_combine(p, sig, x, dims, f, f_bias, h_res, h_post, out, h_next=None,
                    y=None) -> None:
    """``out = H_res x + H_post (f + f_bias)`` for ``x`` of token dims ``dims = (T, n, C)``
    (:func:`~mhc_megatron.kernels.reference.token_dims`) as
    :func:`~mhc_megatron.kernels.triton_common.streams_operand` returns it, fp32 mappings
    (T > 0); with ``h_next`` also the next pre's aggregate of ``out`` into ``y``
    (``HAS_AGG``). ``p`` is the call's ``_CombinePlan`` and ``sig`` its signature of ``(x, f,
    f_bias or f, h_res, h_post[, h_next])``. The one launch of the combine's forward, shared by
    the autograd op and the recompute's fused replay: the same tiles, so the same ``out``."""
    T, _, C = dims
    fb = f_bias if f_bias is not None else f  # unread without HAS_BIAS
    if h_next is None:  # HAS_AGG off: h_next / y unread
        _FWD.signed(p, sig, p.fwd_grid, p.fwd_meta, x, f, fb, h_res, h_post, out, h_post, f, T,
                    C)
    else:
        _FWD.signed(p, sig, p.fwd_grid, p.fwd_agg_meta, x, f, fb, h_res, h_post, out, h_next, y,
                    T, C)


def _combine_operands(x, f, h_res, h_post, n_streams) -> tuple:
    """The combine's operands as its kernel reads them, checked: ``(x, bcast, dims, f, h_res,
    h_post)`` (fp32 mappings; ``dims = (T, n, C)``)."""
    (x, bcast), f = streams_operand(x), f.contiguous()
    dims = token_dims(x, n_streams)
    _check(x, dims[1])
    return x, bcast, dims, f, contiguous_f32(h_res), contiguous_f32(h_post)


def _combine_forward_call(x, f, f_bias, h_res, h_post, bcast, dims) -> tuple:
    """``(plan, key, inputs)`` of the combine's forward on its operands (T > 0): ``inputs``
    ``(x, f, f_bias or f, h_res, h_post)`` (``f`` stands in for a missing bias: unread)."""
    T, n, C = dims
    p = plan(_CombinePlan, T, n, C, f_bias is not None, bcast)
    inputs = (x, f, f_bias if f_bias is not None else f, h_res, h_post)
    return p, (signature(*inputs), "forward", x.shape), inputs


def _combine_forward(x, f, f_bias, h_res, h_post, n_streams):
    """The combine's forward (the kernel of :class:`_CombineFn`): ``(out, saved, bcast,
    dims)``, ``saved`` = ``(x, f, f_bias, h_res, h_post)`` as the kernel read them (fp32
    mappings)."""
    x, bcast, dims, f, h_res, h_post = _combine_operands(x, f, h_res, h_post, n_streams)
    if dims[0] == 0:
        out = x.new_empty(x.shape)
    else:
        p, key, inputs = _combine_forward_call(x, f, f_bias, h_res, h_post, bcast, dims)
        (out,) = host_replay.run(p, key, inputs, (),
                                 lambda: _combine_forward_kernels(p, key[0], x, dims, f, f_bias,
                                                                  h_res, h_post))
    return out, (x, f, f_bias, h_res, h_post), bcast, dims


def _combine_native(x, f, f_bias, h_res, h_post, link, n_streams):
    """The combine through its C++ autograd node (:mod:`~mhc_megatron.kernels.native_autograd`):
    ``x'``, or None where it does not apply (no extension, no recipe of this forward yet, an
    operand the op would copy or cast, no tokens). A combine on the mappings of a pre that ran
    from its call site replays from that site's combine where its operands match."""
    ext = native_autograd.extension()
    if ext is None or (link is not None and link.native is None) or (
            f_bias is not None and not f_bias.is_contiguous()) or not native_autograd.plain(
            x, f, f_bias, h_res, h_post):
        return None
    native_link = None if link is None else link.native
    site = None if link is None else link.site
    at_site = native_autograd.combine_site(site, n_streams)
    if at_site is not None:
        out = ext.combine_site_apply(at_site, x, f, f_bias, h_res, h_post, native_link)
        if out is not None:
            return out
    xk, bcast, dims, fk, h_res_k, h_post_k = _combine_operands(x, f, h_res, h_post, n_streams)
    if xk is not x or fk is not f or h_res_k is not h_res or h_post_k is not h_post \
            or dims[0] == 0:
        return None
    p, key, _ = _combine_forward_call(x, f, f_bias, h_res, h_post, bcast, dims)
    recipe = host_replay.recorded(p, key)
    if recipe is None:
        return None
    table = recipe.table or native_autograd.table(
        recipe, functools.partial(_combine_native_backward, dims, bcast))
    out = ext.combine_apply(table, x, f, f_bias, h_res, h_post, native_link)
    if site is not None:
        native_autograd.remember_combine(site, n_streams, table, (x, f, f_bias, h_res, h_post))
    return out


def _combine_native_backward(dims, bcast, x, f, f_bias, h_res, h_post, g, fold) -> tuple:
    """The combine's backward for its C++ node, where the node has no recipe to replay:
    ``(dx, df, dh_res, dh_post, recipe id or -1, g)``, ``g`` as the kernel read it (the
    node hands it to pre's backward)."""
    g = g.contiguous() if g is not None else x.new_zeros(x.shape)
    grads, recipe = _combine_backward((x, f, f_bias, h_res, h_post), dims, bcast, fold, g)
    return (*grads, -1 if recipe is None else recipe.rid, g)


def _combine_forward_kernels(p, sig, x, dims, f, f_bias, h_res, h_post) -> tuple:
    """The combine forward's allocation and launch (T > 0), as :func:`host_replay.run
    <mhc_megatron.kernels.host_replay.run>` takes them: ``((out,), ())``."""
    out = x.new_empty(x.shape)  # contiguous, also for a broadcast x
    _launch_combine(p, sig, x, dims, f, f_bias, h_res, h_post, out)
    return (out,), ()


class _CombineFn(torch.autograd.Function):
    """``x`` is ``[T, n, C]`` and ``f [T, C]`` (``n_streams`` None), or the streams
    ``[..., n*C]`` and ``f [..., C]``; the output has ``x``'s shape."""

    @staticmethod
    def forward(ctx, x, f, f_bias, h_res, h_post, link, n_streams=None):
        ctx.mapping_dtypes = (h_res.dtype, h_post.dtype)  # grads are returned in these
        out, saved, ctx.bcast, ctx.dims = _combine_forward(x, f, f_bias, h_res, h_post,
                                                           n_streams)
        ctx.save_for_backward(*saved)
        ctx.link = link
        return out

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors  # x, f, f_bias, h_res, h_post
        f_bias = saved[2]
        g = g.contiguous()
        fold = ctx.link is not None  # pre's dx pass forms H_res^T g: no dx here
        (dx, df, dh_res, dh_post), _ = _combine_backward(saved, ctx.dims, ctx.bcast, fold, g)
        dbias = None
        if f_bias is not None and ctx.needs_input_grad[2]:
            # bf16/fp16 sums accumulate in fp32 inside torch's reduction: no fp32 copy of df
            dbias = df.view(-1, ctx.dims[2]).sum(
                0, dtype=torch.float32 if f_bias.dtype == torch.float32 else None)
            dbias = dbias.to(f_bias.dtype)
        if fold:
            ctx.link.park(g, saved[3])  # pre's backward adds H_res^T g (see DxLink)
        res_dtype, post_dtype = ctx.mapping_dtypes
        if res_dtype != torch.float32:
            dh_res = dh_res.to(res_dtype)
        if post_dtype != torch.float32:
            dh_post = dh_post.to(post_dtype)
        return dx, df, dbias, dh_res, dh_post, None, None


def _combine_backward(saved, dims, bcast, fold, g) -> tuple:
    """The combine's kernel in backward (its Python function's and its C++ node's where that
    has no recipe): ``((dx, df, dh_res, dh_post), recipe)`` for the contiguous upstream
    gradient ``g``; ``dx`` None in a fold; ``recipe`` the replayable recording it ran or made
    (:func:`~mhc_megatron.kernels.host_replay.recorded`), or None. ``saved`` is ``(x, f,
    f_bias, h_res, h_post)``."""
    x, f, f_bias, h_res, h_post = saved
    T, n, C = dims
    if T == 0:
        return _combine_backward_outputs(x, f, fold, dims), None
    p = plan(_CombinePlan, T, n, C, f_bias is not None, bcast)
    inputs = (g, x, f, f_bias if f_bias is not None else f, h_res, h_post)
    sig = signature(*inputs)
    key = (sig, "backward", fold, x.shape, f.shape)
    # (dh_res and dh_post, fp32, small, both for pre's backward: one allocation)
    grads = host_replay.run(p, key, inputs, (),
                            lambda: _combine_backward_kernels(p, sig, inputs, fold, dims),
                            shared=(1, 2) if fold else (2, 3))
    return (None, *grads) if fold else grads, host_replay.recorded(p, key)


_apply_combine = applier(_CombineFn, tensor_positions=(0, 1, 2, 3, 4))


def _combine_backward_outputs(x, f, fold, dims) -> tuple:
    """The combine backward's gradients, uninitialised: ``(dx, df, dh_res, dh_post)``; ``dx``
    None in a fold (pre's dx pass forms it)."""
    T, n, _ = dims
    dx = None if fold else x.new_empty(x.shape)  # contiguous, also for a broadcast x
    return (dx, torch.empty_like(f), torch.empty(T, n, n, device=x.device, dtype=torch.float32),
            torch.empty(T, n, device=x.device, dtype=torch.float32))


def _combine_backward_kernels(p, sig, inputs, fold, dims) -> tuple:
    """The combine backward's allocations and launch (T > 0), as :func:`host_replay.run
    <mhc_megatron.kernels.host_replay.run>` takes them: ``((dx, df, dh_res, dh_post), ())``,
    without ``dx`` in a fold."""
    g, x, f, fb, h_res, h_post = inputs
    T, _, C = dims
    dx, df, dh_res, dh_post = _combine_backward_outputs(x, f, fold, dims)
    _BWD.signed(p, sig, p.bwd_grid, p.bwd_fold_meta if fold else p.bwd_meta, g, x, f, fb, h_res,
                h_post, g if fold else dx, df, dh_res, dh_post, T, C)  # (dx unwritten in a fold)
    return ((df, dh_res, dh_post) if fold else (dx, df, dh_res, dh_post)), ()


def combine(x, f, f_bias, h_res, h_post, n=None):
    """Fused expand-combine ``H_res x + H_post (f + f_bias)`` in ``x.dtype``: ``x [T, n, C]``,
    ``f [T, C]``, or with ``n`` given the streams ``x [..., n*C]`` and ``f [..., C]`` (no
    reshape outside the op, so no view nodes in the autograd graph); ``x``'s shape out.

    If ``h_res`` comes from :func:`~mhc_megatron.kernels.triton_pre.pre` on this same ``x``,
    the combine's ``dx = H_res^T g`` is formed inside pre's backward kernel, which adds it to
    pre's own: never written, never summed by autograd (see
    :class:`~mhc_megatron.kernels.handoff.DxLink`). Without autograd (no grad mode, inference
    mode, or no input that requires grad) the kernel runs without an autograd function around
    it."""
    if not records_autograd(x, f, f_bias, h_res, h_post):
        return _combine_forward(x, f, f_bias, h_res, h_post, n)[0]
    link = getattr(h_res, "_mhc_dx_link", None)
    if link is None:  # (a pre called from its module's site: the link is its node's)
        link = node_link(h_res)
    if link is not None and not link.claim(x):
        link = None
    out = _combine_native(x, f, f_bias, h_res, h_post, link, n)
    return out if out is not None else _apply_combine(x, f, f_bias, h_res, h_post, link, n)


def combine_aggregate(x, f, f_bias, h_res, h_post, h_pre, n=None):
    """``(x', y)``: :func:`combine` and then the next pre's aggregate of its output,
    ``aggregate(x', h_pre, n)`` (:func:`~mhc_megatron.kernels.triton_pre.aggregate`), in one
    pass, bit for bit equal to the two ops: ``x'`` is not read back. ``h_pre [T, n]`` is the
    next pre's (fp32); ``y`` is ``[T, C]``, or ``[..., C]`` for the streams ``[..., n*C]``.
    No autograd: ``mhc_recompute`` replays the pair with it in backward (the Triton ops'
    ``replay_combine_aggregate``, :class:`~mhc_megatron.kernels.dispatch.MHCOps`)."""
    if records_autograd(x, f, f_bias, h_res, h_post, h_pre):
        raise RuntimeError("triton_mhc.combine_aggregate has no backward: it is the recompute's "
                           "replay of a combine and the next aggregate. Fix: call it under "
                           "torch.no_grad(), or use combine and pre.")
    (x, bcast), f = streams_operand(x), f.contiguous()
    T, n_streams, C = dims = token_dims(x, n)
    _check(x, n_streams)
    h_res, h_post, h_pre = contiguous_f32(h_res), contiguous_f32(h_post), contiguous_f32(h_pre)
    if T == 0:
        return _combine_aggregate_outputs(x, n, C)
    p = plan(_CombinePlan, T, n_streams, C, f_bias is not None, bcast)
    inputs = (x, f, f_bias if f_bias is not None else f, h_res, h_post, h_pre)
    sig = signature(*inputs)
    # (x's shape and layout: y's, as in the aggregate's key)
    return host_replay.run(p, (sig, "forward and aggregate", x.shape, n is None), inputs, (),
                           lambda: _combine_aggregate_kernels(p, sig, x, dims, f, f_bias, h_res,
                                                              h_post, h_pre, n))


def _combine_aggregate_outputs(x, n, C) -> tuple:
    """``(x', y)`` of :func:`combine_aggregate`, uninitialised."""
    out = x.new_empty(x.shape)  # contiguous, also for a broadcast x
    return out, torch.empty(aggregate_shape(out, n, C), device=x.device, dtype=x.dtype)


def _combine_aggregate_kernels(p, sig, x, dims, f, f_bias, h_res, h_post, h_pre, n) -> tuple:
    """:func:`combine_aggregate`'s allocations and launch (T > 0), as :func:`host_replay.run
    <mhc_megatron.kernels.host_replay.run>` takes them: ``((x', y), ())``."""
    out, y = _combine_aggregate_outputs(x, n, dims[2])
    _launch_combine(p, sig, x, dims, f, f_bias, h_res, h_post, out, h_pre, y)
    return (out, y), ()
