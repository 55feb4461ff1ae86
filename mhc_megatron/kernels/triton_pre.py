"""The fused Triton "pre" op of mHC: dynamic mappings and aggregate, forward and backward.

``pre(x [T, n, C], phi [m, n*C], alpha [3], bias [m], form=PAPER) -> (y [T, C], h_pre [T, n],
h_post [T, n], h_res [T, n, n])``, the math of :func:`mhc_megatron.kernels.reference.pre`
(``m = 2n + n^2``, mappings fp32) in the mapping form ``form`` (the paper's or DeepSeek-V4's,
``h_res`` transposed or not: :class:`~mhc_megatron.kernels.reference.MappingForm`; constexpr
branches of the mapping kernels, so each form compiles on its own), and
``aggregate(x, h_pre) -> y`` (pre's ``y`` again, bit for bit: what ``mhc_recompute`` replays).

Layout: the forward kernels (projection, mappings, aggregate) and their launch plans in
:mod:`~mhc_megatron.kernels.triton_pre_fwd`; the backward kernels (``dH_pre``, mappings
backward, the dx + dphi pass, the parameter gradients) and theirs in
:mod:`~mhc_megatron.kernels.triton_pre_bwd`; here the autograd function that launches them
in order and the entry points.

Host side: the launch shapes of a (T, n, C, dtype, form) are computed once
(:func:`~mhc_megatron.kernels.triton_common.plan`), with the temporaries, which are reused
from call to call (:class:`~mhc_megatron.kernels.triton_common.Scratch`), and the kernels
launched through :class:`~mhc_megatron.kernels.launch.Launcher`.
"""

from __future__ import annotations

import functools

import torch

from mhc_megatron.kernels import host_replay, native_autograd
from mhc_megatron.kernels.autograd_apply import applier
from mhc_megatron.kernels.handoff import DxLink
from mhc_megatron.kernels.launch import signature, signature_with_alignment
from mhc_megatron.kernels.reference import PAPER, aggregate_shape, token_dims
from mhc_megatron.kernels.triton_common import (
    _check,
    _padded_m,
    contiguous_f32,
    forced_precision,
    form_flags,
    plan,
    records_autograd,
    streams_operand,
)
from mhc_megatron.kernels.triton_pre_bwd import (
    _DHPRE,
    _MAPS_BWD,
    GRAD_ROUND_CODES,
    _launch_dx_dphi,
    _launch_param_grads,
    _PreBackwardPlan,
)
from mhc_megatron.kernels.triton_pre_fwd import (
    _MAPS_FWD,
    _PROJ,
    _AggregatePlan,
    _launch_aggregate,
    _PreForwardPlan,
)


def _pre_operands(x, phi, alpha, bias, n_streams, form):
    """pre's operands as its kernels read them, checked: ``(x, bcast, dims, phi, alpha, bias,
    dsv4, transposed)`` (x's own pointer to the kernels: ``dims = (T, n, C)``)."""
    dsv4, transposed = form_flags(form)  # (refuses an unknown form)
    x, bcast = streams_operand(x)
    dims = token_dims(x, n_streams)
    _check(x, dims[1])
    return (x, bcast, dims, phi.contiguous(), alpha.contiguous(), bias.contiguous(), dsv4,
            transposed)


def _pre_forward_call(x, phi, alpha, bias, iters, eps, form, bcast, dims, dsv4, transposed,
                      n_streams) -> tuple:
    """``(plan, key, scratch)`` of pre's forward on its operands (T > 0): the plan, the
    recipe key (:func:`host_replay.run <mhc_megatron.kernels.host_replay.run>`: the
    signature, the launches' other scalars, eps and the form's eps, and what y's shape
    follows: x's shape and layout, ``[..., C]`` for the streams ``[..., n*C]`` (``n_streams``
    given), ``[T, C]`` for tokens ``[T, n, C]``; at n=1 the two can share a shape) and the
    reused temporaries."""
    T, n, C = dims
    p = plan(_PreForwardPlan, T, n, C, x.dtype, forced_precision(), bcast, dsv4, transposed)
    key = (signature(x, phi, alpha, bias, extra=(int(iters),)), float(eps), float(form.eps),
           x.shape, n_streams is None)
    return p, key, p.scratch.tensors(x.device)


def _pre_forward(x, phi, alpha, bias, iters, eps, n_streams, form):
    """pre's forward (the kernels of :class:`_PreFn`): ``((y, h_pre, h_post, h_res), saved,
    bcast, dims)``, ``saved`` = ``(x, phi, alpha, bias, ht, rstd)`` as the kernels read and
    wrote them (what the backward needs besides ``h_pre``)."""
    x, bcast, dims, phi, alpha, bias, dsv4, transposed = _pre_operands(x, phi, alpha, bias,
                                                                       n_streams, form)
    if dims[0] == 0:
        y, h_pre, h_post, h_res, ht, rstd = _pre_forward_outputs(x, n_streams, dims)
    else:
        p, key, scratch = _pre_forward_call(x, phi, alpha, bias, iters, eps, form, bcast, dims,
                                            dsv4, transposed, n_streams)
        y, h_pre, h_post, h_res, ht, rstd = host_replay.run(
            p, key, (x, phi, alpha, bias), scratch,
            lambda: _pre_forward_kernels(p, key[0], scratch, x, phi, alpha, bias, iters, eps,
                                         form, n_streams, dims, bcast),
            shared=_PRE_FP32_OUTPUTS)
    return (y, h_pre, h_post, h_res), (x, phi, alpha, bias, ht, rstd), bcast, dims


def _pre_native(x, phi, alpha, bias, iters, eps, link, n_streams, form, main_grads):
    """pre through its C++ autograd node (:mod:`~mhc_megatron.kernels.native_autograd`):
    ``(y, h_pre, h_post, h_res)``, or None where it does not apply (no extension, no recipe
    of this forward yet, an operand the op would copy, no tokens). A call like the last one
    on ``phi`` replays from its call site (:class:`~mhc_megatron.kernels.native_autograd.
    CallSite`), the operands checked in C++."""
    ext = native_autograd.extension()
    if ext is None or (link is not None and link.native is None) or not native_autograd.plain(
            x, phi, alpha, bias):
        return None
    # Megatron DDP's main_grad is a fixed view of its gradient buffer, so the node takes it at
    # forward; Megatron-FSDP's is allocated in backward (get_main_grad): its parameters keep
    # the Python function, which reads main_grad in backward
    if main_grads and any(hasattr(t, "__fsdp_param__") for t in (phi, alpha, bias)):
        return None
    mains = (_main_grads((phi, alpha, bias), (phi.requires_grad, alpha.requires_grad,
                                              bias.requires_grad)) if main_grads else None)
    args = (iters, eps, n_streams, form)
    native_link = None if link is None else link.native
    node_args = (native_link, list(mains or ()), (phi, alpha, bias) if mains else None)
    site = native_autograd.site_of(phi, args)
    if site is not None:
        outs = ext.pre_site_apply(site.pre, x, phi, alpha, bias, *node_args)
        if outs is not None:
            if link is not None:
                link.site = site
            site.mains = mains  # (what the module's calls from this site add to)
            return tuple(outs)
    xk, bcast, dims, phi_k, alpha_k, bias_k, dsv4, transposed = _pre_operands(
        x, phi, alpha, bias, n_streams, form)
    if xk is not x or phi_k is not phi or alpha_k is not alpha or bias_k is not bias \
            or dims[0] == 0:
        return None
    p, key, scratch = _pre_forward_call(x, phi, alpha, bias, iters, eps, form, bcast, dims,
                                        dsv4, transposed, n_streams)
    recipe = host_replay.recorded(p, key)
    if recipe is None:
        return None
    table = recipe.table or native_autograd.table(recipe, functools.partial(
        _pre_native_backward, dims, bcast, int(iters), n_streams, (dsv4, transposed,
                                                                    float(form.eps))))
    outs = tuple(ext.pre_apply(table, x, phi, alpha, bias, scratch, *node_args))
    if p.scratch.reuse and not torch.cuda.is_current_stream_capturing():  # (reused scratch)
        site = native_autograd.remember_pre(phi, args, table, scratch, (x, phi, alpha, bias),
                                            mains)
        if link is not None:
            link.site = site
    return outs


def _pre_native_backward(dims, bcast, iters, n_streams, form, x, phi, alpha, bias, ht, rstd,
                         h_pre, dy, dh_pre, dh_post, dh_res, g_combine, h_res_combine,
                         main_grads) -> tuple:
    """pre's backward for its C++ node, where the node has no recipe to replay: ``(dx, dphi,
    dalpha, dbias, recipe id or -1, scratch)`` (the node then replays that recipe with that
    scratch for gradients like these)."""
    grads, recipe, scratch = _pre_backward(
        (x, phi, alpha, bias, ht, rstd, h_pre), dims, bcast, iters, n_streams, form,
        None if g_combine is None else (g_combine, h_res_combine),
        tuple(main_grads) or None, dy, dh_pre, dh_post, dh_res)
    return (*grads, -1 if recipe is None else recipe.rid, list(scratch))


# pre forward's fp32 outputs (h_pre, h_post, h_res, ht, rstd): small, saved together and freed
# together (by the combine's backward and pre's), so the replay allocates them as one
_PRE_FP32_OUTPUTS = (1, 2, 3, 4, 5)


def _pre_forward_outputs(x, n_streams, dims) -> tuple:
    """pre's forward's tensors, uninitialised: ``(y, h_pre, h_post, h_res, ht, rstd)``."""
    T, n, C = dims
    dev, f32 = x.device, torch.float32
    return (torch.empty(aggregate_shape(x, n_streams, C), device=dev, dtype=x.dtype),
            torch.empty(T, n, device=dev, dtype=f32), torch.empty(T, n, device=dev, dtype=f32),
            torch.empty(T, n, n, device=dev, dtype=f32),
            torch.empty(T, _padded_m(n), device=dev, dtype=f32),
            torch.empty(T, device=dev, dtype=f32))


def _pre_forward_kernels(p, sig, scratch, x, phi, alpha, bias, iters, eps, form, n_streams,
                         dims, bcast) -> tuple:
    """pre forward's allocations and launches (T > 0), as :func:`host_replay.run
    <mhc_megatron.kernels.host_replay.run>` takes them: ``((y, h_pre, h_post, h_res, ht,
    rstd), ())``."""
    T, n, C = dims
    outs = y, h_pre, h_post, h_res, ht, rstd = _pre_forward_outputs(x, n_streams, dims)
    part, part_ss = scratch
    _PROJ.signed(p, sig, p.proj_grid, p.proj_meta, x, phi, part, part_ss, T, p.K, C, p.per)
    _MAPS_FWD.signed(p, sig, p.map_grid, p.map_meta, part, part_ss, alpha, bias, h_pre,
                     h_post, h_res, ht, rstd, x, y, T, p.K, C, p.splits, float(eps),
                     int(iters), float(form.eps))
    if not p.map_agg:  # (small inputs: the mapping kernel formed y)
        _launch_aggregate(x, dims, h_pre, y, bcast, sig)
    return outs, ()


class _PreFn(torch.autograd.Function):
    """``x`` is ``[T, n, C]`` (``n_streams`` None; possibly one broadcast row a token, read
    as is: :func:`~mhc_megatron.kernels.triton_common.streams_operand`) or the streams
    ``[..., n*C]``; ``y`` is ``[T, C]`` or ``[..., C]`` accordingly, the mappings are per
    token."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, iters, eps, link, n_streams=None, form=PAPER,
                main_grads=False):
        outs, saved, ctx.bcast, ctx.dims = _pre_forward(x, phi, alpha, bias, iters, eps,
                                                        n_streams, form)
        ctx.save_for_backward(*saved, outs[1])
        ctx.params = (phi, alpha, bias) if main_grads else None  # (the Parameter objects)
        ctx.iters = int(iters)
        ctx.n_streams = n_streams
        ctx.link = link
        ctx.form = (*form_flags(form), float(form.eps))
        ctx.set_materialize_grads(False)  # unused outputs get None: their work is skipped
        return outs

    @staticmethod
    def backward(ctx, dy, dh_pre, dh_post, dh_res):
        saved = ctx.saved_tensors  # x, phi, alpha, bias, ht, rstd, h_pre
        pending = ctx.link.take() if ctx.link is not None else None
        main_grads = None if ctx.params is None else _main_grads(ctx.params,
                                                                ctx.needs_input_grad[1:4])
        (dx, dphi, dalpha, dbias), _, _ = _pre_backward(
            saved, ctx.dims, ctx.bcast, ctx.iters, ctx.n_streams, ctx.form, pending, main_grads,
            dy, dh_pre, dh_post, dh_res)
        if main_grads is not None:
            for param in ctx.params:
                param.grad_added_to_main_grad = True
        return dx, dphi, dalpha, dbias, None, None, None, None, None, None


def _pre_backward(saved, dims, bcast, iters, n_streams, form, pending, main_grads, dy, dh_pre,
                  dh_post, dh_res) -> tuple:
    """pre's backward (its Python function's and its C++ node's where that has no recipe):
    ``((dx, dphi, dalpha, dbias), recipe, scratch)``, ``recipe`` the replayable recording it
    ran or made (:func:`~mhc_megatron.kernels.host_replay.recorded`) if its temporaries
    ``scratch`` are the plan's reused ones, else None. ``saved`` is
    ``(x, phi, alpha, bias, ht, rstd, h_pre)``, ``form`` ``(dsv4, transposed, eps)``,
    ``pending`` the combine's handed-over ``(g, h_res)`` or None, ``main_grads`` the
    parameters' ``main_grad`` buffers to add the gradients to, or None (:func:`_main_grads`)."""
    x, phi, alpha, bias, ht, rstd, h_pre = saved
    T, n, C = dims
    dev = x.device
    g_combine, h_res_combine = pending if pending is not None else (None, None)
    dsv4, transposed, form_eps = form
    p = plan(_PreBackwardPlan, T, n, C, x.dtype, forced_precision(), dh_pre is not None,
             g_combine is not None, bcast, dsv4, transposed)
    if T == 0:
        dx = x.new_zeros(x.shape)
        return ((dx, phi.new_zeros(p.m, p.K), alpha.new_zeros(3), bias.new_zeros(p.m)), None,
                ())
    dy = (torch.zeros(aggregate_shape(x, n_streams, C), device=dev, dtype=x.dtype)
          if dy is None else dy.contiguous())
    dh_post = torch.zeros(T, n, device=dev) if dh_post is None else contiguous_f32(dh_post)
    dh_res = torch.zeros(T, n, n, device=dev) if dh_res is None else contiguous_f32(dh_res)
    dh_pre = contiguous_f32(dh_pre) if dh_pre is not None else dh_post  # (unread if None)
    fold = g_combine is not None
    inputs = (x, dy, dh_pre, dh_post, dh_res, ht, rstd, alpha, bias, h_pre, phi,
              *((g_combine, h_res_combine) if fold else ()), *(main_grads or ()))
    sig = signature(*inputs[:11 + 2 * fold], extra=(iters,))
    grads_sig = sig if main_grads is None else signature_with_alignment(*main_grads)
    history = p.sinkhorn_history(iters)
    scratch = (*p.scratch.tensors(dev), *history.tensors(dev))
    # (the launches' other scalars: the Sinkhorn iterations, in sig, and the form's eps;
    # x's shape: dx's). The parameters' gradients (dphi, dalpha, dbias: handed to autograd
    # together, accumulated or freed together) take one allocation in the replay.
    key = (sig, grads_sig, form_eps, x.shape)
    grads = host_replay.run(
        p, key, inputs, scratch,
        lambda: _pre_backward_kernels(p, sig, grads_sig, scratch, inputs, fold, main_grads,
                                      iters, form_eps, dims=(T, n, C)),
        shared=_PRE_PARAM_GRADS)
    reused = p.scratch.reuse and history.reuse  # (else fresh temporaries each call)
    return grads, host_replay.recorded(p, key) if reused else None, scratch


# pre backward's parameter gradients in its returned (dx, dphi, dalpha, dbias)
_PRE_PARAM_GRADS = (1, 2, 3)

_apply_pre = applier(_PreFn, tensor_positions=(0, 1, 2, 3))


def _pre_backward_kernels(p, sig, grads_sig, scratch, inputs, fold, main_grads, iters,
                          form_eps, dims) -> tuple:
    """pre backward's allocations and launches (T > 0), as :func:`host_replay.run
    <mhc_megatron.kernels.host_replay.run>` takes them: ``((dx, dphi, dalpha, dbias),
    ())``. With ``main_grads`` the parameter gradients are added to those buffers and
    what autograd gets for phi, alpha and bias is unread."""
    x, dy, dh_pre, dh_post, dh_res, ht, rstd, alpha, bias, h_pre, phi = inputs[:11]
    T, _, C = dims
    g_combine, h_res_combine = inputs[11:13] if fold else (x, h_pre)  # (unread if no fold)
    dev = x.device
    dphi = torch.empty(p.m, p.K, device=dev, dtype=phi.dtype)
    dbias = torch.empty(p.m, device=dev, dtype=bias.dtype)
    dalpha = torch.empty(3, device=dev, dtype=alpha.dtype)
    dx = x.new_empty(x.shape)  # contiguous, also for a broadcast x
    dp, coef, dphi_part, red_part, part, hist = scratch  # dp: every column written
    _DHPRE.signed(p, sig, p.dh_grid, p.dh_meta, x, dy, part, T, C, p.dh_per)
    _MAPS_BWD.signed(p, sig, (p.map_programs,), p.map_meta, part, p.dh_splits, dh_pre,
                     dh_post, dh_res, ht, rstd, alpha, bias, red_part, dp, coef, hist, T, p.K,
                     iters, form_eps)
    _launch_dx_dphi(p, sig, x, dy, h_pre, dp, coef, phi, g_combine, h_res_combine, dx,
                    dphi_part, T, C, p.dx_per)
    if main_grads is None:
        grad_dtype, grads_out = None, (dphi, dbias, dalpha)
    else:  # (views into DDP's buffer: some start unaligned, hence grads_sig)
        phi_main, alpha_main, bias_main = main_grads
        grad_dtype, grads_out = phi.dtype, (phi_main, bias_main, alpha_main)
    _launch_param_grads(p, grads_sig, grad_dtype, dphi_part, red_part, *grads_out,
                        p.dx_splits, p.mp * p.K, p.m * p.K, p.map_programs)
    return (dx, dphi, dalpha, dbias), ()


def _main_grads(params, needs_grad) -> tuple | None:
    """The ``main_grad`` buffers of pre's parameters ``(phi, alpha, bias)`` where their
    gradients can be added to them in the kernel, as Megatron's linear layers do with
    ``gradient_accumulation_fusion``: each parameter needs a gradient and has a ``main_grad``
    of its shape (plain tensors, not DTensors; contiguous, fp32/bf16/fp16) and Megatron's
    ``grad_added_to_main_grad`` flag (Megatron's DDP sets it, and its gradient hook then skips
    the parameter's ``.grad``; Megatron-FSDP follows the same protocol), none asks for
    ``zero_out_wgrad``, and the three share a dtype. Else None: the gradients go to autograd."""
    if not all(needs_grad):
        return None
    grads = []
    for param in params:
        main = getattr(param, "main_grad", None)
        if (type(main) is not torch.Tensor or type(param.data) is not torch.Tensor  # (DTensors:
                or not hasattr(param, "grad_added_to_main_grad")       # sharded, not a buffer)
                or getattr(param, "zero_out_wgrad", False) or main.shape != param.shape
                or main.dtype not in GRAD_ROUND_CODES or not main.is_contiguous()
                or param.dtype != params[0].dtype or main.device != param.device):
            return None
        grads.append(main)
    return tuple(grads)


def pre(x, phi, alpha, bias, sinkhorn_iterations, eps, n=None, form=PAPER, main_grads=False):
    """Fused mappings + aggregate: ``(y, h_pre [T,n], h_post [T,n], h_res [T,n,n])`` for
    ``x [T, n, C]`` (``y [T, C]``) or, with ``n`` given, for the streams ``x [..., n*C]``
    (``y [..., C]``; no reshape outside the op, so no view nodes in the autograd graph).
    The mappings in ``form`` (a :class:`~mhc_megatron.kernels.reference.MappingForm`: the
    paper's, or DeepSeek-V4's; ``transposed``: ``h_res = M^T``). Without autograd (no grad
    mode, inference mode, or no input that requires grad: inference, evaluation) the kernels
    run without an autograd function around them
    (:func:`~mhc_megatron.kernels.triton_common.records_autograd`).

    ``main_grads`` (Megatron's ``gradient_accumulation_fusion``): in backward the gradients
    of ``phi``, ``alpha`` and ``bias`` are added to their ``main_grad`` buffers by the kernel
    that sums them, where the parameters carry Megatron's ``main_grad`` protocol
    (:func:`_main_grads`), instead of being handed to autograd for DDP's gradient hook to add:
    bit for bit the hook's result, three launches fewer a sublayer."""
    if not records_autograd(x, phi, alpha, bias):
        return _pre_forward(x, phi, alpha, bias, sinkhorn_iterations, eps, n, form)[0]
    link = DxLink(x) if x.requires_grad else None
    outs = _pre_native(x, phi, alpha, bias, sinkhorn_iterations, eps, link, n, form, main_grads)
    if outs is None:
        outs = _apply_pre(x, phi, alpha, bias, sinkhorn_iterations, eps, link, n, form,
                          main_grads)
    if link is not None:
        outs[3]._mhc_dx_link = link
    return outs


def aggregate(x, h_pre, n=None):
    """``y`` of :func:`pre` from ``x`` (``[T, n, C]``, or ``[..., n*C]`` with ``n``) and pre's
    ``h_pre [T, n]``, bit for bit (the same kernel launch); no autograd: ``mhc_recompute``
    replays it in backward."""
    x, bcast = streams_operand(x)
    T, n_streams, C = dims = token_dims(x, n)
    _check(x, n_streams)
    if records_autograd(x, h_pre):
        raise RuntimeError("triton_mhc.aggregate has no backward: it is the recompute's replay "
                           "of pre's aggregate. Fix: call it under torch.no_grad(), or use pre.")
    if T == 0:
        return torch.empty(aggregate_shape(x, n, C), device=x.device, dtype=x.dtype)
    h_pre = contiguous_f32(h_pre)
    sig = signature(x, h_pre)
    # (the aggregate's own plan; x's shape and layout: y's)
    (y,) = host_replay.run(plan(_AggregatePlan, T, n_streams, C, bcast),
                           (sig, x.shape, n is None), (x, h_pre), (),
                           lambda: _aggregate_kernels(x, dims, h_pre, bcast, sig, n, C))
    return y


def _aggregate_kernels(x, dims, h_pre, bcast, sig, n, C) -> tuple:
    """The aggregate's allocation and launch (T > 0), as :func:`host_replay.run
    <mhc_megatron.kernels.host_replay.run>` takes them: ``((y,), ())``."""
    y = torch.empty(aggregate_shape(x, n, C), device=x.device, dtype=x.dtype)
    _launch_aggregate(x, dims, h_pre, y, bcast, sig)
    return (y,), ()
