"""The sublayer's input RMSNorm fused into the Triton "pre" op (``mhc_fuse_input_norm``).

Unfused, a sublayer reads pre's aggregate ``y [T, C]`` back to normalise it (its own norm,
or Transformer Engine's ``LayerNormLinear``), and in backward the norm writes ``dy`` for
pre's backward to read twice. Fused:

* forward: ``_aggregate_norm_fwd`` writes ``y`` (kept for backward, as the norm would keep
  it) and ``yn = y * rstd * w`` from one read of the streams: a program owns a few whole
  token rows, forms ``y`` channel block by channel block (the same bits as
  ``_aggregate_fwd``, :func:`~mhc_megatron.kernels.triton_common._aggregate_tile`), sums
  the squares of ``y`` as stored (rounded to its dtype, as an unfused norm reads it), then
  scales the rows it just wrote (still in L2);
* backward: no ``dy`` exists. :class:`_InputNormFn`'s backward parks the gradient of
  ``yn`` and the saved ``y`` on the :class:`NormLink`; pre's backward
  (:mod:`~mhc_megatron.kernels.triton_pre`, ``NORM``) folds the RMSNorm backward
  ``dy = rstd * (w * dyn) - rstd^3 / C * sum(w * dyn * y) * y`` into its dH_pre pass
  (``sum(w * dyn * x_i)``, ``sum(y * x_i)`` and ``sum(w * dyn * y)`` a token, ``y`` formed
  from the streams in registers) and its dx pass (``dy`` from ``dyn``, ``y``, ``rstd`` and
  the per-token coefficient; the norm weight's gradient partials there too).

Split in two autograd functions (pre, then :class:`_InputNormFn`) so that ``mhc_recompute``
can record ``y`` between them: the norm's save of ``y`` then becomes a recompute
placeholder, as it was for the unfused norm.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels import reference
from mhc_megatron.kernels.launch import Launcher, Meta, cdiv, next_pow2
from mhc_megatron.kernels.triton_common import TILES, _aggregate_tile, plan, stream_strides


@triton.jit
def _aggregate_norm_fwd(x_ptr, hpre_ptr, w_ptr, y_ptr, yn_ptr, rstd_ptr, T, C, eps,
                        N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        X_BCAST: tl.constexpr):
    """``y = sum_i h_pre[i] x[i]``, ``rstd = (mean(y^2) + eps)^-1/2`` of ``y`` as stored,
    ``yn = y * rstd * w``; a program owns ``BT`` whole token rows (ascending: the projection
    before walked the tokens down)."""
    XT, XS = stream_strides(N, C, X_BCAST)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    ss = tl.zeros([BT], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        y = _aggregate_tile(x_ptr, hpre_ptr, t64, tmask, c, m2, XT, XS, N, BT, BC)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + t64[:, None] * C + c[None, :], y, mask=m2)
        yf = y.to(tl.float32)
        ss += tl.sum(yf * yf, axis=1)
    rstd = 1.0 / tl.sqrt(ss / C + eps)
    tl.store(rstd_ptr + t, rstd, mask=tmask)
    tl.debug_barrier()  # the y rows stored above are read back below in another thread layout
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m2 = tmask[:, None] & cmask[None, :]
        yf = tl.load(y_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        yn = (yf * rstd[:, None]) * w[None, :]
        tl.store(yn_ptr + t64[:, None] * C + c[None, :], yn.to(yn_ptr.dtype.element_ty),
                 mask=m2)


_AGG_NORM = Launcher(_aggregate_norm_fwd)


class _AggregateNormPlan:
    """Launch shape of ``_aggregate_norm_fwd`` for ``x [T, n, C]`` (``bcast``: one broadcast
    row a token)."""

    def __init__(self, T: int, n: int, C: int, bcast: bool):
        bt, n_channels, warps = TILES.agg_norm
        bc = max(16, min(n_channels // n, next_pow2(C)))
        self.grid = (cdiv(T, bt),)
        self.meta = Meta(N=n, BT=bt, BC=bc, X_BCAST=bcast, num_warps=warps)


def launch_aggregate_norm(x3: torch.Tensor, h_pre: torch.Tensor, w: torch.Tensor,
                          y: torch.Tensor, yn: torch.Tensor, rstd: torch.Tensor, eps: float,
                          bcast: bool) -> None:
    """``y``, ``yn`` (both ``[T, C]`` in x's dtype, any layout with ``T*C`` contiguous
    elements) and ``rstd [T]`` fp32 for ``x3 [T, n, C]`` and fp32 ``h_pre [T, n]`` (T > 0)."""
    T, n, C = x3.shape
    p = plan(_AggregateNormPlan, T, n, C, bcast)
    _AGG_NORM(p.grid, p.meta, x3, h_pre, w, y, yn, rstd, T, C, float(eps))


class NormLink:
    """What pre's forward hands to the norm, and the norm's backward hands back to pre's.

    Pre (with a norm weight) computes ``yn`` and ``rstd`` with ``y`` and parks them here
    (:meth:`park` ties the link to ``y`` as ``y._mhc_norm_link``); :func:`input_norm` on that same ``y``, unmodified, with the same
    weight and eps, returns the parked ``yn`` through :class:`_InputNormFn`, whose backward
    parks ``(dyn, y)`` in ``pending`` for pre's backward (which runs after it: ``y`` is pre's
    output). Anything else (another tensor, a changed weight or eps) is normalised by
    the reference's ``input_norm``, unfused, so results never depend on the link beyond
    rounding."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight
        self.eps = float(eps)
        self.y_ref = None
        self.y_version = None
        self.yn: torch.Tensor | None = None
        self.rstd: torch.Tensor | None = None
        self.claimed = False
        self.pending: tuple | None = None  # (dyn, y) from _InputNormFn.backward

    def park(self, y: torch.Tensor) -> None:
        """Tie the link to pre's output ``y`` (after pre's forward parked ``yn``)."""
        self.y_ref = weakref.ref(y)
        self.y_version = y._version
        y._mhc_norm_link = self

    def claim(self, y: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
        ok = (not self.claimed and self.yn is not None and self.y_ref is not None
              and self.y_ref() is y and y._version == self.y_version
              and weight is self.weight and float(eps) == self.eps)
        self.claimed = self.claimed or ok
        return ok


class _InputNormFn(torch.autograd.Function):
    """``yn`` of the fused pre for its ``y``; backward parks ``(dyn, y)`` on the link and
    returns no gradient for ``y`` or the weight: pre's backward forms both."""

    @staticmethod
    def forward(ctx, y, weight, link):
        ctx.save_for_backward(y)  # mhc_recompute: a placeholder when y was recorded
        ctx.link = link
        yn, link.yn = link.yn, None
        return yn

    @staticmethod
    def backward(ctx, dyn):
        (y,) = ctx.saved_tensors
        if dyn is not None:
            ctx.link.pending = (dyn.contiguous(), y)
        return None, None, None


def input_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(y) * weight``: the fused pre's parked result when ``y`` is that pre's output
    (see :class:`NormLink`), else the reference's :func:`~mhc_megatron.kernels.reference.input_norm`."""
    link = getattr(y, "_mhc_norm_link", None)
    if link is not None and link.claim(y, weight, eps):
        return _InputNormFn.apply(y, weight, link)
    return reference.input_norm(y, weight, eps)


def norm_backward_unfused(dyn: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy, dweight)`` of ``yn = y * rstd * w`` in PyTorch (fp32), for the rare backward
    where ``y`` has another consumer besides the norm (its gradient then arrives as well)."""
    C = y.shape[-1]
    yf = y.float().reshape(-1, C)
    dynf = dyn.float().reshape(-1, C)
    r = rstd.reshape(-1, 1)
    u = dynf * weight.float()
    a = (u * yf).sum(dim=-1, keepdim=True)
    dy = r * u - (r ** 3) * a / C * yf
    dw = (dynf * yf * r).sum(dim=0)
    return dy.view(y.shape), dw.to(weight.dtype)


@triton.jit
def _dhpre_norm_partial(x_ptr, dyn_ptr, w_ptr, hpre_ptr, rstd_ptr, b_ptr, e_ptr, a_ptr,
                        dw_ptr, T, C, C_PER_SPLIT, N: tl.constexpr, BT: tl.constexpr,
                        BC: tl.constexpr, X_BCAST: tl.constexpr):
    """Over the channels of C-split ``s``, with ``u = w * dyn`` and ``y`` formed from the
    streams (rounded to x's dtype, as pre stored it): ``b[s, t, i] = sum u x_i``,
    ``e[s, t, i] = sum y x_i``, ``a[s, t] = sum u y``. Pre's mappings backward turns them into
    ``dH_pre[i] = rstd * b_i - rstd^3 a / C * e_i``. And the norm weight's gradient over this
    program's tokens: ``dw[token block, c] = sum_t dyn * y * rstd`` (summed over the blocks
    in a fixed order by the caller)."""
    XT, XS = stream_strides(N, C, X_BCAST)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    split = tl.program_id(1)
    i = tl.arange(0, N)
    h = tl.load(hpre_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    rstd = tl.load(rstd_ptr + t64, mask=tmask, other=0.0)
    acc_b = tl.zeros([BT, N], dtype=tl.float32)
    acc_e = tl.zeros([BT, N], dtype=tl.float32)
    acc_a = tl.zeros([BT], dtype=tl.float32)
    c_start = split * C_PER_SPLIT
    for c0 in range(c_start, c_start + C_PER_SPLIT, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m2 = tmask[:, None] & cmask[None, :]
        x3 = tl.load(x_ptr + t64[:, None, None] * XT + i[None, :, None] * XS + c[None, None, :],
                     mask=m2[:, None, :], other=0.0).to(tl.float32)
        # y as pre stored it, up to the order of the n additions (a last-bit difference of
        # the rounded y in rare elements)
        y = tl.sum(h[:, :, None] * x3, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        dyn = tl.load(dyn_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        u = dyn * w[None, :]
        acc_b += tl.sum(x3 * u[:, None, :], axis=2)
        acc_e += tl.sum(x3 * y[:, None, :], axis=2)
        acc_a += tl.sum(u * y, axis=1)
        tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * C + c,
                 tl.sum(dyn * y * rstd[:, None], axis=0), mask=cmask)
    row = split.to(tl.int64) * T + t64
    tl.store(b_ptr + row[:, None] * N + i[None, :], acc_b, mask=tmask[:, None])
    tl.store(e_ptr + row[:, None] * N + i[None, :], acc_e, mask=tmask[:, None])
    tl.store(a_ptr + row, acc_a, mask=tmask)


DHPRE_NORM = Launcher(_dhpre_norm_partial)
