"""Fused Triton kernels for the mHC operations, forward and backward.

Same math and layouts as :mod:`mhc_megatron.kernels.reference` (which they are tested
against): ``x [T, n, C]`` stream-major and contiguous, ``phi [m, n*C]``, ``alpha [3]``,
``bias [m]`` (``m = 2n + n^2``), mappings fp32. Supported: ``n`` in {1, 2, 4, 8}, any ``T``
and ``C``, activations fp32 / bf16 / fp16, parameters of any float dtype (math in fp32).
Non-contiguous inputs are made contiguous first (one copy).

Kernels (no float atomics anywhere: every reduction split across programs writes fp32
partials that are summed in a fixed order, so results are bitwise identical run to run):

* forward "pre": ``_proj_partial`` (projection ``x @ phi^T`` with ``tl.dot`` and the sum of
  squares, on a (token block x K split) grid), ``_mappings_fwd`` (per token: sum of the
  partials, RMS, sigmoids, log-domain Sinkhorn in registers), ``_aggregate_fwd``
  (``y = sum_i H_pre[i] x[i]`` on a (token x channel) grid).
* ``_combine_fwd``: ``x' = H_res x + H_post (f + bias)``.
* ``_combine_bwd``: ``dx``, ``df``, ``dH_post``, ``dH_res`` for a token block, looping over C.
* backward "pre": ``_dhpre_partial`` (``dH_pre`` partials over C splits), ``_mappings_bwd``
  (sigmoid and Sinkhorn backward, exact: the iterations are replayed once from the logits
  into an fp32 scratch and walked back; writes per token block the sums of the logit
  gradients for ``dalpha``/``dbias``, and ``dP`` and the RMS term) and ``_pre_dx_dphi``
  (one more pass over x: ``dx`` and the ``dphi`` partials together).

x feeds both "pre" and "combine": when combine's mappings come from our pre on the same x,
combine's dx (written by its backward) is added inside pre's dx kernel, so autograd gets one
x-gradient per sublayer instead of adding two x-sized tensors (see
:mod:`mhc_megatron.kernels.handoff`).

Dots run on tensor cores with fp32 accumulation. The projection: bf16 x as is against phi
split into bf16 hi + lo halves (~16 mantissa bits of phi); fp16 x widened and TF32 (exact for
x, phi rounded to TF32); fp32 x with 3xTF32. The backward dots use TF32 (16-bit x) or 3xTF32
(fp32 x). ``MHC_TRITON_DOT_PRECISION`` (``tf32``, ``tf32x3``, ``ieee``) overrides them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels.handoff import DxLink

SUPPORTED_STREAMS = (1, 2, 4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    """TF32 products are exact for bf16/fp16 activations (<= 11 mantissa bits; only the fp32
    operand is rounded); fp32 activations get 3xTF32, close to full fp32 accuracy."""
    default = "tf32" if dtype in (torch.bfloat16, torch.float16) else "tf32x3"
    return os.environ.get("MHC_TRITON_DOT_PRECISION", default)


def _projection_splits_phi(dtype: torch.dtype) -> bool:
    """bf16 x: the projection runs on bf16 tensor cores with phi as hi + lo bf16 halves
    (~16 mantissa bits, more than TF32's 11, and x needs no widening). Not for fp16 (phi's
    small entries would lose bits in fp16's subnormal range) nor when the precision is
    forced through ``MHC_TRITON_DOT_PRECISION``."""
    return dtype == torch.bfloat16 and "MHC_TRITON_DOT_PRECISION" not in os.environ


def _padded_m(n: int) -> int:
    return max(16, triton.next_power_of_2(2 * n + n * n))


# ------------------------------------------------------------------------------ helpers
@triton.jit
def _log_normalize(L, AXIS: tl.constexpr):
    """L - logsumexp(L, AXIS) (fp32)."""
    mx = tl.expand_dims(tl.max(L, axis=AXIS), AXIS)
    lse = mx + tl.log(tl.expand_dims(tl.sum(tl.exp(L - mx), axis=AXIS), AXIS))
    return L - lse


@triton.jit
def _sinkhorn_log(L, iters):
    """``iters`` row-then-column log-normalisations of ``L [BT, N, N]``."""
    for _ in range(iters):
        L = _log_normalize(L, 2)
        L = _log_normalize(L, 1)
    return L


@triton.jit
def _mapping_logits(ht_ptr, alpha_ptr, bias_ptr, t64, tmask, N: tl.constexpr, MP: tl.constexpr):
    """Load Ht for a token block and return the pre/post/res logits (fp32)."""
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    row = ht_ptr + t64 * MP
    ht_pre = tl.load(row[:, None] + i[None, :], mask=tmask[:, None], other=0.0)
    ht_post = tl.load(row[:, None] + N + i[None, :], mask=tmask[:, None], other=0.0)
    ht_res = tl.load(row[:, None, None] + 2 * N + ij[None, :, :], mask=tmask[:, None, None],
                     other=0.0)
    z_pre = a_pre * ht_pre + tl.load(bias_ptr + i).to(tl.float32)[None, :]
    z_post = a_post * ht_post + tl.load(bias_ptr + N + i).to(tl.float32)[None, :]
    z_res = a_res * ht_res + tl.load(bias_ptr + 2 * N + ij).to(tl.float32)[None, :, :]
    return z_pre, z_post, z_res, ht_pre, ht_post, ht_res, a_pre, a_post, a_res


# ------------------------------------------------------------------------------ forward
@triton.jit
def _proj_partial(x_ptr, phi_ptr, part_ptr, ss_ptr, T, K, K_PER_SPLIT,
                  M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr, SPLIT_PHI: tl.constexpr, INTERPRETED: tl.constexpr):
    """part[s, t, :] = x[t, K-split s] @ phi[:, K-split s]^T; ss[s, t] = sum of x^2 there.

    SPLIT_PHI (16-bit x): x feeds the tensor cores as it is and phi as two 16-bit halves
    (hi + lo, ~16 mantissa bits), accumulated in fp32. Otherwise x is widened to fp32 and
    the dot runs at ``PREC``."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    split = tl.program_id(1)
    tmask = t < T
    t64 = t.to(tl.int64)
    mcol = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        xt = tl.load(x_ptr + t64[:, None] * K + k[None, :],
                     mask=tmask[:, None] & kmask[None, :], other=0.0)
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
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
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
def _aggregate_fwd(x_ptr, hpre_ptr, y_ptr, T, C,
                   N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """y[t, c] = sum_i h_pre[t, i] x[t, i, c] on a (token, channel) grid."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tmask = t < T
    m2 = tmask[:, None] & (c < C)[None, :]
    t64 = t.to(tl.int64)
    i = tl.arange(0, N)
    h_pre = tl.load(hpre_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    x3 = tl.load(x_ptr + t64[:, None, None] * (N * C) + i[None, :, None] * C + c[None, None, :],
                 mask=m2[:, None, :], other=0.0).to(tl.float32)
    y = tl.sum(x3 * h_pre[:, :, None], axis=1)
    tl.store(y_ptr + t64[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _combine_fwd(x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr, out_ptr, T, C,
                 HAS_BIAS: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tmask = t < T
    m2 = tmask[:, None] & (c < C)[None, :]
    t64 = t.to(tl.int64)
    K = N * C
    i = tl.arange(0, N)
    f = tl.load(f_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        f += tl.load(fbias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
    h_post = tl.load(hpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    acc = h_post[:, :, None] * f[:, None, :]
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + t64[:, None] * K + j * C + c[None, :], mask=m2, other=0.0)
        h_col = tl.load(hres_ptr + t64[:, None] * (N * N) + i[None, :] * N + j,
                        mask=tmask[:, None], other=0.0)
        acc += h_col[:, :, None] * xj.to(tl.float32)[:, None, :]
    tl.store(out_ptr + t64[:, None, None] * K + i[None, :, None] * C + c[None, None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m2[:, None, :])


# ----------------------------------------------------------------------------- backward
@triton.jit
def _combine_bwd(g_ptr, x_ptr, f_ptr, fbias_ptr, hres_ptr, hpost_ptr,
                 dx_ptr, df_ptr, dhres_ptr, dhpost_ptr, T, C,
                 HAS_BIAS: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    K = N * C
    i = tl.arange(0, N)
    h_post = tl.load(hpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    d_post = tl.zeros([BT, N], dtype=tl.float32)
    d_res = tl.zeros([BT, N, N], dtype=tl.float32)
    for c0 in range(0, C, BC):
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
            xj = tl.load(x_ptr + t64[:, None] * K + j * C + c[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            col = tl.sum(g3 * xj[:, None, :], axis=2)  # dH_res[:, :, j] contribution
            d_res += tl.where(i[None, None, :] == j, col[:, :, None], 0.0)
            h_col = tl.load(hres_ptr + t64[:, None] * (N * N) + i[None, :] * N + j,
                            mask=tmask[:, None], other=0.0)
            dxj = tl.sum(h_col[:, :, None] * g3, axis=1)
            tl.store(dx_ptr + t64[:, None] * K + j * C + c[None, :],
                     dxj.to(dx_ptr.dtype.element_ty), mask=m2)
    ij = i[:, None] * N + i[None, :]
    tl.store(dhpost_ptr + t64[:, None] * N + i[None, :], d_post, mask=tmask[:, None])
    tl.store(dhres_ptr + t64[:, None, None] * (N * N) + ij[None, :, :], d_res,
             mask=tmask[:, None, None])


@triton.jit
def _dhpre_partial(x_ptr, dy_ptr, part_ptr, T, C, C_PER_SPLIT,
                   N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """part[s, t, i] = sum over channels of C-split s of dy[t, c] x[t, i, c]."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    split = tl.program_id(1)
    tmask = t < T
    t64 = t.to(tl.int64)
    i = tl.arange(0, N)
    acc = tl.zeros([BT, N], dtype=tl.float32)
    c_start = split * C_PER_SPLIT
    for c0 in range(c_start, c_start + C_PER_SPLIT, BC):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        x3 = tl.load(x_ptr + t64[:, None, None] * (N * C) + i[None, :, None] * C + c[None, None, :],
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

    The Sinkhorn iterations are replayed once from the logits, each row-normalised state
    ``L_mid`` going to the scratch ``hist [iters, T, N*N]`` (fp32, written and read back
    by the same program), then walked in reverse."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
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

    # Sinkhorn backward. Forward step L' = L - lse(L, axis) has dL = dL' - exp(L') * sum(dL', axis).
    d_res = tl.load(dhres_ptr + t64[:, None, None] * (N * N) + ij[None, :, :],
                    mask=tmask[:, None, None], other=0.0)
    L = z_res
    for k in range(iters):
        L = _log_normalize(L, 2)
        row = t64 + k * T  # int64
        tl.store(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :], L,
                 mask=tmask[:, None, None])
        L = _log_normalize(L, 1)
    tl.debug_barrier()
    G = d_res * tl.exp(L)
    for kk in range(iters):
        row = t64 + (iters - 1 - kk) * T
        L_mid = tl.load(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :],
                        mask=tmask[:, None, None], other=0.0)
        L_out = _log_normalize(L_mid, 1)
        G = G - tl.exp(L_out) * tl.expand_dims(tl.sum(G, axis=1), 1)
        G = G - tl.exp(L_mid) * tl.expand_dims(tl.sum(G, axis=2), 2)
    dz_res = G

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
def _pre_dx_dphi(x_ptr, dy_ptr, hpre_ptr, dp_ptr, coef_ptr, phi_ptr, acc_ptr, dx_ptr, dphi_ptr,
                 T, C, TOKENS_PER_SPLIT, HAS_ACC: tl.constexpr, N: tl.constexpr,
                 M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 PREC: tl.constexpr):
    """One pass over x for both x and phi gradients of "pre".

    Program (stream s, channel block, token split) walks its tokens:
    ``dx[t, s, c] = (dP @ phi)[t, s*C+c] + coef[t] x[t, s, c] + h_pre[t, s] dy[t, c]
    (+ acc[t, s, c], the combine's dx, when HAS_ACC)`` and accumulates
    ``dphi_part[split, :, s*C+c] = sum_t dP[t, :]^T x[t, s, c]``. The stream index varies
    fastest in the launch order, so the N programs sharing a dy tile run together (L2)."""
    s = tl.program_id(0) % N
    c = (tl.program_id(0) // N) * BC + tl.arange(0, BC)
    split = tl.program_id(1)
    cmask = c < C
    K = N * C
    k = s * C + c
    mcol = tl.arange(0, MP)
    ph = tl.load(phi_ptr + mcol[:, None].to(tl.int64) * K + k[None, :],
                 mask=(mcol[:, None] < M) & cmask[None, :], other=0.0).to(tl.float32)
    dphi = tl.zeros([MP, BC], dtype=tl.float32)
    t_start = split * TOKENS_PER_SPLIT
    for t0 in range(t_start, t_start + TOKENS_PER_SPLIT, BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        m2 = tmask[:, None] & cmask[None, :]
        dp = tl.load(dp_ptr + t64[:, None] * MP + mcol[None, :], mask=tmask[:, None], other=0.0)
        coef = tl.load(coef_ptr + t, mask=tmask, other=0.0)
        h_s = tl.load(hpre_ptr + t64 * N + s, mask=tmask, other=0.0)
        dy = tl.load(dy_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        offs = t64[:, None] * K + k[None, :]
        xs = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        dxs = tl.dot(dp, ph, input_precision=PREC) + coef[:, None] * xs + h_s[:, None] * dy
        if HAS_ACC:
            dxs += tl.load(acc_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dxs.to(dx_ptr.dtype.element_ty), mask=m2)
        dphi = tl.dot(tl.trans(dp), xs, dphi, input_precision=PREC)
    tl.store(dphi_ptr + split.to(tl.int64) * MP * K + mcol[:, None] * K + k[None, :], dphi,
             mask=cmask[None, :])


# ----------------------------------------------------------------------- autograd glue
@dataclass
class KernelTiles:
    """Tile sizes and launch shapes; n=4 values from ``benchmarks/tune_tiles.py`` on an H100
    (M=16384, C=4096, bf16; table in benchmarks/RESULTS.md).

    The projection streams phi once per token block (L2), so blocks of 64 tokens keep phi's
    traffic below x's; n=8 pads the mapping to 128 columns and needs smaller tiles to fit
    shared memory. Reductions over K / C / T are split across programs (fp32 partials,
    summed in a fixed order) so that about ``target_programs`` programs are in flight."""

    proj: dict = field(default_factory=lambda: {  # n: (tokens, K step, warps, stages)
        1: (64, 64, 8, 3), 2: (64, 64, 8, 3), 4: (64, 128, 4, 3), 8: (16, 32, 4, 2)})
    target_programs: int = 512
    map_tokens: int = 64                    # per-token mapping math (Sinkhorn): tokens/program
    sweep: tuple = (8, 1024, 8)             # aggregate, dH_pre: (tokens, n*channels, warps)
    combine_fwd: tuple = (2, 512, 4)        # (tokens, channels, warps)
    combine_bwd: tuple = (8, 128, 4)        # (tokens, channels per step, warps)
    dx: tuple = (64, 64, 4)                 # fused dx + dphi: (tokens per step, channels, warps)


TILES = KernelTiles()


def _sweep_bc(n: int, C: int) -> int:
    """Channels per program of the [tokens, n, channels] sweeps."""
    return max(16, min(TILES.sweep[1] // n, triton.next_power_of_2(C)))


def _splits(blocks: int, length: int, step: int) -> tuple[int, int]:
    """(splits, length per split, a multiple of ``step``) for ``blocks * splits`` programs
    ~ ``TILES.target_programs``."""
    want = max(1, min(triton.cdiv(TILES.target_programs, max(blocks, 1)),
                      triton.cdiv(length, step)))
    per = triton.cdiv(triton.cdiv(length, want), step) * step
    return triton.cdiv(length, per), per


def _check(x: torch.Tensor, n: int) -> None:
    if n not in SUPPORTED_STREAMS:
        raise ValueError(f"Triton mHC kernels support n in {SUPPORTED_STREAMS}, got n={n}. "
                         "Fix: use mhc_kernel_backend='reference' (or 'auto') for this n.")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Triton mHC kernels support {SUPPORTED_DTYPES}, got {x.dtype}. "
                         "Fix: use mhc_kernel_backend='reference' (or 'auto') for this dtype.")


def _launch_aggregate(x: torch.Tensor, h_pre: torch.Tensor, y: torch.Tensor) -> None:
    """``y [T, C] = sum_i h_pre[:, i] x[:, i]`` for contiguous ``x [T, n, C]``, fp32
    ``h_pre [T, n]`` (T > 0): the one launch of the aggregate, shared by pre's forward and
    :func:`aggregate`, so that both give the same bits."""
    T, n, C = x.shape
    bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
    _aggregate_fwd[(triton.cdiv(T, bt), triton.cdiv(C, bc))](
        x, h_pre, y, T, C, N=n, BT=bt, BC=bc, num_warps=warps)


class _PreFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, alpha, bias, iters, eps, link):
        T, n, C = x.shape
        _check(x, n)
        x = x.contiguous()
        phi, alpha, bias = phi.contiguous(), alpha.contiguous(), bias.contiguous()
        m, mp, K = 2 * n + n * n, _padded_m(n), n * C
        dev, f32 = x.device, torch.float32
        y = torch.empty(T, C, device=dev, dtype=x.dtype)
        h_pre = torch.empty(T, n, device=dev, dtype=f32)
        h_post = torch.empty(T, n, device=dev, dtype=f32)
        h_res = torch.empty(T, n, n, device=dev, dtype=f32)
        ht = torch.empty(T, mp, device=dev, dtype=f32)
        rstd = torch.empty(T, device=dev, dtype=f32)
        if T > 0:
            bt, bk, warps, stages = TILES.proj[n]
            splits, per = _splits(triton.cdiv(T, bt), K, bk)
            part = torch.empty(splits, T, mp, device=dev, dtype=f32)
            part_ss = torch.empty(splits, T, device=dev, dtype=f32)
            _proj_partial[(triton.cdiv(T, bt), splits)](
                x, phi, part, part_ss, T, K, per, M=m, MP=mp, BT=bt, BK=bk,
                PREC=_dot_precision(x.dtype), SPLIT_PHI=_projection_splits_phi(x.dtype),
                INTERPRETED=_INTERPRETED,
                num_warps=warps, num_stages=stages)
            _mappings_fwd[(triton.cdiv(T, TILES.map_tokens),)](
                part, part_ss, alpha, bias, h_pre, h_post, h_res, ht, rstd, T, K, splits,
                float(eps), int(iters), N=n, MP=mp, BT=TILES.map_tokens, num_warps=4)
            _launch_aggregate(x, h_pre, y)
        ctx.save_for_backward(x, phi, alpha, bias, ht, rstd, h_pre)
        ctx.iters = int(iters)
        ctx.link = link
        ctx.set_materialize_grads(False)  # unused outputs get None: their work is skipped
        return y, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dy, dh_pre, dh_post, dh_res):
        x, phi, alpha, bias, ht, rstd, h_pre = ctx.saved_tensors
        T, n, C = x.shape
        m, mp, K = 2 * n + n * n, _padded_m(n), n * C
        dev, f32 = x.device, torch.float32
        dx_combine = None
        if ctx.link is not None:
            dx_combine, ctx.link.pending = ctx.link.pending, None
        dy = torch.zeros(T, C, device=dev, dtype=x.dtype) if dy is None else dy.contiguous()
        dh_post = torch.zeros(T, n, device=dev) if dh_post is None else dh_post.float().contiguous()
        dh_res = (torch.zeros(T, n, n, device=dev) if dh_res is None
                  else dh_res.float().contiguous())
        dx = torch.empty_like(x)
        dp = torch.empty(T, mp, device=dev, dtype=f32)  # every column written
        coef = torch.empty(T, device=dev, dtype=f32)
        prec = _dot_precision(x.dtype)
        bt_dx, bc_dx, warps_dx = TILES.dx
        bc_dx = min(bc_dx, max(16, triton.next_power_of_2(C)))
        dx_blocks = n * triton.cdiv(C, bc_dx)
        dx_splits, dx_per = _splits(dx_blocks, max(T, 1), bt_dx)
        map_programs = max(triton.cdiv(T, TILES.map_tokens), 1)
        # written in full by the kernels below when T > 0
        make = torch.empty if T > 0 else torch.zeros
        dphi_part = make(dx_splits, mp, K, device=dev, dtype=f32)
        red_part = make(map_programs, mp, device=dev, dtype=f32)
        if T > 0:
            bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
            splits, per = _splits(triton.cdiv(T, bt), C, bc)
            part = torch.empty(splits, T, n, device=dev, dtype=f32)
            _dhpre_partial[(triton.cdiv(T, bt), splits)](
                x, dy, part, T, C, per, N=n, BT=bt, BC=bc, num_warps=warps)
            hist = torch.empty(max(ctx.iters, 1), T, n * n, device=dev, dtype=f32)
            _mappings_bwd[(map_programs,)](
                part, splits, dh_pre.float().contiguous() if dh_pre is not None else dh_post,
                dh_post, dh_res, ht, rstd, alpha, bias, red_part, dp, coef, hist, T, K, ctx.iters,
                HAS_DHPRE=dh_pre is not None, N=n, MP=mp, BT=TILES.map_tokens, num_warps=4)
            del hist
            _pre_dx_dphi[(dx_blocks, dx_splits)](
                x, dy, h_pre, dp, coef, phi, dx_combine if dx_combine is not None else x, dx,
                dphi_part, T, C, dx_per, HAS_ACC=dx_combine is not None, N=n, M=m, MP=mp,
                BT=bt_dx, BC=bc_dx, PREC=prec, num_warps=warps_dx)
        elif dx_combine is not None:
            dx = dx_combine
        dphi = dphi_part.sum(0)[:m].to(phi.dtype)
        red = red_part.sum(0)  # [bias grads (m) | alpha grads (3) | padding]
        dbias, dalpha = red[:m].to(bias.dtype), red[m:m + 3].to(alpha.dtype)
        return dx, dphi, dalpha, dbias, None, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f, f_bias, h_res, h_post, link):
        T, n, C = x.shape
        _check(x, n)
        x, f = x.contiguous(), f.contiguous()
        ctx.mapping_dtypes = (h_res.dtype, h_post.dtype)  # grads are returned in these
        h_res, h_post = h_res.float().contiguous(), h_post.float().contiguous()
        out = torch.empty_like(x)
        bt, bc, warps = TILES.combine_fwd
        bc = min(bc, triton.next_power_of_2(C))
        if T > 0:
            _combine_fwd[(triton.cdiv(T, bt), triton.cdiv(C, bc))](
                x, f, f_bias if f_bias is not None else f, h_res, h_post, out, T, C,
                HAS_BIAS=f_bias is not None, N=n, BT=bt, BC=bc, num_warps=warps)
        ctx.save_for_backward(x, f, f_bias, h_res, h_post)
        ctx.link = link
        return out

    @staticmethod
    def backward(ctx, g):
        x, f, f_bias, h_res, h_post = ctx.saved_tensors
        T, n, C = x.shape
        g = g.contiguous()
        dx = torch.empty_like(x)
        df = torch.empty_like(f)
        dh_res = torch.empty(T, n, n, device=x.device, dtype=torch.float32)
        dh_post = torch.empty(T, n, device=x.device, dtype=torch.float32)
        bt, bc, warps = TILES.combine_bwd
        if T > 0:
            _combine_bwd[(triton.cdiv(T, bt),)](
                g, x, f, f_bias if f_bias is not None else f, h_res, h_post, dx, df, dh_res,
                dh_post, T, C, HAS_BIAS=f_bias is not None, N=n, BT=bt,
                BC=min(bc, triton.next_power_of_2(C)), num_warps=warps)
        dbias = None
        if f_bias is not None and ctx.needs_input_grad[2]:
            # bf16/fp16 sums accumulate in fp32 inside torch's reduction: no fp32 copy of df
            dbias = df.sum(0, dtype=torch.float32 if f_bias.dtype == torch.float32 else None)
            dbias = dbias.to(f_bias.dtype)
        if ctx.link is not None:
            ctx.link.pending, dx = dx, None  # pre's backward adds it (see DxLink)
        res_dtype, post_dtype = ctx.mapping_dtypes
        return dx, df, dbias, dh_res.to(res_dtype), dh_post.to(post_dtype), None


def pre(x, phi, alpha, bias, sinkhorn_iterations, eps):
    """Fused mappings + aggregate: ``(y [T,C], h_pre [T,n], h_post [T,n], h_res [T,n,n])``."""
    link = DxLink(x) if torch.is_grad_enabled() and x.requires_grad else None
    outs = _PreFn.apply(x, phi, alpha, bias, sinkhorn_iterations, eps, link)
    if link is not None:
        outs[3]._mhc_dx_link = link
    return outs


def aggregate(x, h_pre):
    """``y [T, C]`` of :func:`pre` from ``x [T, n, C]`` and pre's ``h_pre [T, n]``, bit for
    bit (the same kernel launch); no autograd: ``mhc_recompute`` replays it in backward."""
    T, n, C = x.shape
    _check(x, n)
    if torch.is_grad_enabled() and (x.requires_grad or h_pre.requires_grad):
        raise RuntimeError("triton_mhc.aggregate has no backward: it is the recompute's replay "
                           "of pre's aggregate. Fix: call it under torch.no_grad(), or use pre.")
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    if T > 0:
        _launch_aggregate(x.contiguous(), h_pre.float().contiguous(), y)
    return y


def combine(x, f, f_bias, h_res, h_post):
    """Fused expand-combine ``H_res x + H_post (f + f_bias)`` -> ``[T, n, C]`` in ``x.dtype``.

    If ``h_res`` comes from :func:`pre` on this same ``x``, the two ``dx`` are summed inside
    pre's backward kernel instead of by autograd (see :class:`DxLink`)."""
    link = getattr(h_res, "_mhc_dx_link", None)
    if link is not None and not (torch.is_grad_enabled() and link.claim(x)):
        link = None
    return _CombineFn.apply(x, f, f_bias, h_res, h_post, link)
