"""The fused Triton output head of DeepSeek-V4 (its ``hc_head``), forward and backward.

``output_head(x [T, n, C], phi [n, n*C], alpha [1], bias [n], rms_eps, eps) -> y [T, C]`` in
``x.dtype``, the math of :func:`mhc_megatron.kernels.reference.output_head`: per token, with
``v = vec(x)``, ``r = sqrt(mean(v^2) + rms_eps)``, ``Ht = (v @ phi^T) / r`` (``[n]``),
``w = sigmoid(alpha * Ht + bias) + eps`` and ``y = sum_i w_i x_i``. With ``n`` given, ``x``
is the streams ``[..., n*C]`` and ``y`` is ``[..., C]``.

The head is pre's first half with ``n`` projection rows instead of ``2n + n^2``, so it runs
pre's kernels where they fit: forward ``triton_pre_fwd._proj_partial`` (``M = n`` rows padded
to ``MP = 16``), ``_head_fwd`` (here: the partials summed, ``Ht [T, n]``, ``rstd [T]`` and
``w [T, n]`` fp32) and the aggregate (``triton_pre_fwd._launch_aggregate``, ``w`` as
``h_pre``); backward ``triton_pre_bwd._dhpre_partial`` (the ``dw`` partials), ``_head_bwd``
(here: ``dz``, its block sums for ``dbias``/``dalpha``, ``dP [T, MP]`` and the RMS
coefficient ``[T]``), ``triton_pre_bwd._pre_dx_dphi`` (``dx`` and the ``dphi`` partials) and
``triton_pre_bwd._param_grads`` (one alpha). No float atomics: bitwise identical run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels.launch import Launcher, Meta, cdiv
from mhc_megatron.kernels.reference import aggregate_shape, token_dims
from mhc_megatron.kernels.triton_common import (
    _INTERPRETED,
    TILES,
    _check,
    _dot_precision,
    _projection_splits_phi,
    _splits,
    forced_precision,
    plan,
    projection_rows,
    streams_operand,
    token_block,
)
from mhc_megatron.kernels.triton_pre_bwd import (
    _DHPRE,
    _BackwardShapes,
    _launch_dx_dphi,
    _launch_param_grads,
)
from mhc_megatron.kernels.triton_pre_fwd import _PROJ, _launch_aggregate

# The projection's n rows padded for tl.dot (n <= 8); the block sums' n bias columns and one
# alpha column fit in it too.
_HEAD_MP = 16


@triton.jit
def _head_fwd(part_ptr, ss_ptr, alpha_ptr, bias_ptr, w_ptr, ht_ptr, rstd_ptr, T, K, SPLITS,
              rms_eps, eps, N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr):
    """For a token block: the projection's split partials (``part [SPLITS, T, MP]``,
    ``ss [SPLITS, T]``) summed in order, then ``rstd [T]``, ``Ht [T, N]`` and
    ``w [T, N] = sigmoid(alpha * Ht + bias) + eps`` (fp32)."""
    t, tmask, t64 = token_block(T, BT)
    mcol = tl.arange(0, MP)
    acc, rstd = projection_rows(part_ptr, ss_ptr, t64, tmask, T, K, SPLITS, rms_eps, MP, BT)
    ht = acc * rstd[:, None]
    a = tl.load(alpha_ptr).to(tl.float32)
    b = tl.load(bias_ptr + mcol, mask=mcol < N, other=0.0).to(tl.float32)
    w = tl.sigmoid(a * ht + b[None, :]) + eps
    m2 = tmask[:, None] & (mcol < N)[None, :]
    tl.store(ht_ptr + t64[:, None] * N + mcol[None, :], ht, mask=m2)
    tl.store(w_ptr + t64[:, None] * N + mcol[None, :], w, mask=m2)
    tl.store(rstd_ptr + t, rstd, mask=tmask)


@triton.jit
def _head_bwd(part_ptr, SPLITS, ht_ptr, rstd_ptr, alpha_ptr, bias_ptr, red_ptr, dp_ptr, coef_ptr,
              T, K, N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr):
    """For a token block, from the ``dw`` partials ``part [SPLITS, T, N]``: the logit grads
    ``dz = dw * s (1 - s)`` (``s`` the sigmoid), ``dP [T, MP] = alpha dz rstd`` (zero padding
    columns), the RMS coefficient ``coef [T] = -sum(alpha dz Ht) rstd^2 / K`` for dx, and the
    block's sums ``red [program, MP]``: columns ``[0, N)`` ``sum_t dz`` (dbias), column ``N``
    ``sum_t dz . Ht`` (dalpha), zeros after."""
    t, tmask, t64 = token_block(T, BT)
    mcol = tl.arange(0, MP)
    m2 = tmask[:, None] & (mcol < N)[None, :]
    dw = tl.zeros([BT, MP], dtype=tl.float32)
    for s in range(SPLITS):
        dw += tl.load(part_ptr + (s * T + t64)[:, None] * N + mcol[None, :], mask=m2, other=0.0)
    ht = tl.load(ht_ptr + t64[:, None] * N + mcol[None, :], mask=m2, other=0.0)
    a = tl.load(alpha_ptr).to(tl.float32)
    b = tl.load(bias_ptr + mcol, mask=mcol < N, other=0.0).to(tl.float32)
    sg = tl.sigmoid(a * ht + b[None, :])
    dz = dw * sg * (1.0 - sg)  # 0 outside [0, N) and for masked tokens (dw loads as 0)
    d_alpha = tl.sum(tl.sum(dz * ht, axis=1), axis=0)
    red = tl.where(mcol < N, tl.sum(dz, axis=0), tl.where(mcol == N, d_alpha, 0.0))
    tl.store(red_ptr + tl.program_id(0).to(tl.int64) * MP + mcol, red)
    # Ht = P * rstd, rstd = (sum(x^2)/K + eps)^-1/2:
    #   dP = dHt * rstd;  dx += dP @ phi - (sum_m dHt_m Ht_m) * rstd^2 / K * x
    rstd = tl.load(rstd_ptr + t, mask=tmask, other=0.0)
    dht = dz * a
    tl.store(coef_ptr + t, -tl.sum(dht * ht, axis=1) * rstd * rstd / K, mask=tmask)
    tl.store(dp_ptr + t64[:, None] * MP + mcol[None, :], dht * rstd[:, None], mask=tmask[:, None])


# ------------------------------------------------------------------------------- host side
_HEAD_FWD, _HEAD_BWD = Launcher(_head_fwd), Launcher(_head_bwd)


class _HeadForwardPlan:
    """Launch shapes of the head's forward for ``x [T, n, C]`` (T > 0) of ``dtype``. The
    projection has ``MP = 16`` padded rows, pre's at n=1: it takes pre's n=1 tiles."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, forced: str | None,
                 bcast: bool):
        self.K = n * C
        bt, bk, warps, stages = TILES.proj[1]
        self.splits, self.per = _splits(cdiv(T, bt), self.K, bk)
        self.proj_grid = (cdiv(T, bt) * self.splits,)  # token_rows
        self.proj_meta = Meta(M=n, MP=_HEAD_MP, BT=bt, BK=bk, PREC=_dot_precision(dtype, forced),
                              SPLIT_PHI=_projection_splits_phi(dtype, forced),
                              INTERPRETED=_INTERPRETED, X_BCAST=bcast, num_warps=warps,
                              num_stages=stages)
        head_bt, head_warps = TILES.head
        self.head_grid = (cdiv(T, head_bt),)
        self.head_meta = Meta(N=n, MP=_HEAD_MP, BT=head_bt, num_warps=head_warps)


class _HeadBackwardPlan(_BackwardShapes):
    """Launch shapes of the head's backward for ``x [T, n, C]`` of ``dtype``: pre's
    (:class:`~mhc_megatron.kernels.triton_pre_bwd._BackwardShapes`) with ``M = n`` projection
    rows and one alpha, and ``_head_bwd``'s."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, forced: str | None,
                 bcast: bool):
        head_bt, head_warps = TILES.head
        self._shapes(T, n, C, n, _HEAD_MP, max(cdiv(T, head_bt), 1), dtype, forced, False,
                     bcast, 1)
        self.head_meta = Meta(N=n, MP=_HEAD_MP, BT=head_bt, num_warps=head_warps)


def _check_head_params(phi, alpha, bias, n: int, C: int) -> None:
    if tuple(phi.shape) != (n, n * C) or alpha.numel() != 1 or tuple(bias.shape) != (n,):
        raise ValueError(
            f"the output head needs phi [n, n*C] = [{n}, {n * C}], alpha [1] and bias [{n}], "
            f"got phi {tuple(phi.shape)}, alpha {tuple(alpha.shape)}, bias {tuple(bias.shape)}. "
            "Fix: pass the head's own parameters (StreamOutputHead), not a sublayer's.")


class _HeadFn(torch.autograd.Function):
    """``x`` is ``[T, n, C]`` (``n_streams`` None; possibly one broadcast row a token, read
    as is: :func:`~mhc_megatron.kernels.triton_common.streams_operand`) or the streams
    ``[..., n*C]``; ``y`` is ``[T, C]`` or ``[..., C]`` accordingly."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, rms_eps, eps, n_streams=None):
        x, bcast = streams_operand(x)
        T, n, C = dims = token_dims(x, n_streams)
        _check(x, n)
        _check_head_params(phi, alpha, bias, n, C)
        phi, alpha, bias = phi.contiguous(), alpha.contiguous(), bias.contiguous()
        dev, f32 = x.device, torch.float32
        y = torch.empty(aggregate_shape(x, n_streams, C), device=dev, dtype=x.dtype)
        w = torch.empty(T, n, device=dev, dtype=f32)
        ht = torch.empty(T, n, device=dev, dtype=f32)
        rstd = torch.empty(T, device=dev, dtype=f32)
        if T > 0:
            p = plan(_HeadForwardPlan, T, n, C, x.dtype, forced_precision(), bcast)
            part = torch.empty(p.splits, T, _HEAD_MP, device=dev, dtype=f32)
            part_ss = torch.empty(p.splits, T, device=dev, dtype=f32)
            _PROJ(p.proj_grid, p.proj_meta, x, phi, part, part_ss, T, p.K, C, p.per)
            _HEAD_FWD(p.head_grid, p.head_meta, part, part_ss, alpha, bias, w, ht, rstd, T, p.K,
                      p.splits, float(rms_eps), float(eps))
            _launch_aggregate(x, dims, w, y, bcast, None)
        ctx.save_for_backward(x, phi, alpha, bias, ht, rstd, w)
        ctx.bcast, ctx.dims = bcast, dims
        return y

    @staticmethod
    def backward(ctx, dy):
        x, phi, alpha, bias, ht, rstd, w = ctx.saved_tensors
        T, n, C = ctx.dims
        dev, f32 = x.device, torch.float32
        p = plan(_HeadBackwardPlan, T, n, C, x.dtype, forced_precision(), ctx.bcast)
        dphi = torch.empty(n, p.K, device=dev, dtype=phi.dtype)
        dbias = torch.empty(n, device=dev, dtype=bias.dtype)
        dalpha = torch.empty(alpha.shape, device=dev, dtype=alpha.dtype)
        if T == 0:
            dx = x.new_zeros(x.shape)
            return dx, dphi.zero_(), dalpha.zero_(), dbias.zero_(), None, None, None
        dy = dy.contiguous()
        dx = x.new_empty(x.shape)  # contiguous, also for a broadcast x
        dp = torch.empty(T, p.mp, device=dev, dtype=f32)
        coef = torch.empty(T, device=dev, dtype=f32)
        dphi_part = torch.empty(p.dx_splits, p.mp, p.K, device=dev, dtype=f32)
        red_part = torch.empty(p.map_programs, p.mp, device=dev, dtype=f32)
        part = torch.empty(p.dh_splits, T, n, device=dev, dtype=f32)
        _DHPRE(p.dh_grid, p.dh_meta, x, dy, part, T, C, p.dh_per)
        _HEAD_BWD((p.map_programs,), p.head_meta, part, p.dh_splits, ht, rstd, alpha, bias,
                  red_part, dp, coef, T, p.K)
        _launch_dx_dphi(p, None, x, dy, w, dp, coef, phi, x, w,  # (g, h_res unread: HAS_G off)
                        dx, dphi_part, T, C, p.dx_per)
        _launch_param_grads(p, None, None, dphi_part, red_part, dphi, dbias, dalpha,
                            p.dx_splits, p.mp * p.K, p.m * p.K, p.map_programs)
        return dx, dphi, dalpha, dbias, None, None, None


def output_head(x, phi, alpha, bias, rms_eps, eps, n=None):
    """DeepSeek-V4's learned contraction of the streams, fused: ``y = sum_i w_i x_i`` with
    ``w = sigmoid(alpha * (vec(x) @ phi^T) / r + bias) + eps`` (module docstring) for
    ``x [T, n, C]`` (``y [T, C]``) or, with ``n`` given, the streams ``x [..., n*C]``
    (``y [..., C]``; no reshape outside the op); ``phi [n, n*C]``, ``alpha [1]``, ``bias [n]``
    (any float dtype, math in fp32; their gradients in their dtypes); ``y`` in ``x.dtype``."""
    return _HeadFn.apply(x, phi, alpha, bias, rms_eps, eps, n)
