"""PyTorch reference of the mHC math (arXiv 2512.24880, eqs. 14-19); fp32 inside.

This is the single source of truth every fused kernel is tested against. Arithmetic is
fp32 for fp32/bf16/fp16 inputs (fp64 for fp64 inputs, so gradcheck is meaningful). All functions
work on flattened tokens; ``T`` is the token count (``s*b``), ``n`` the number of residual
streams, ``C`` the hidden size and ``m = 2n + n^2`` the number of mapping coefficients.

Layouts (stream-major, as carried between layers as ``[s, b, n*C]``):

* ``x``:      ``[T, n, C]``, stream ``i`` is ``x[:, i]``, activation dtype.
* ``phi``:    ``[m, n*C]``; rows ``0:n`` -> H_pre, ``n:2n`` -> H_post, ``2n:`` -> H_res
  (row-major ``n x n``, ``H_res[i, j]`` at row ``2n + i*n + j``).
* ``alpha``:  ``[3]`` gating scalars (pre, post, res); ``bias``: ``[m]``.
* ``h_pre``, ``h_post``: ``[T, n]`` fp32; ``h_res``: ``[T, n, n]`` fp32.

Math per token, with ``v = vec(x)`` in R^{nC}:

    r      = sqrt(mean(v^2) + eps)
    Ht     = (v @ phi^T) / r
    H_pre  = sigmoid(alpha_pre * Ht[0:n] + bias[0:n])
    H_post = 2 * sigmoid(alpha_post * Ht[n:2n] + bias[n:2n])
    H_res  = SinkhornKnopp(alpha_res * Ht[2n:] + bias[2n:])       (doubly stochastic)
    y      = sum_i H_pre[i] * x[i]                                  (aggregate)
    x'[i]  = sum_j H_res[i, j] * x[j] + H_post[i] * (f + f_bias)    (expand-combine)

That is the paper's form of the mappings (:data:`PAPER`). DeepSeek-V4's form
(:class:`MappingForm` ``"deepseek_v4"``, with its ``eps``) differs in the activations, with
``L = alpha_res * Ht[2n:] + bias[2n:]`` as ``[n, n]``:

    H_pre  = sigmoid(alpha_pre * Ht[0:n] + bias[0:n]) + eps
    M      = softmax(L, over each row) + eps; M /= (column sums + eps);
             then t_max - 1 times: M /= (row sums + eps); M /= (column sums + eps)

and ``transposed`` mixes the streams with ``M^T`` (``x'[i] = sum_j M[j, i] x[j]``, DeepSeek-V4's
``comb^T @ h``): the mappings then return ``h_res = M^T``, so the combine is the same op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class MappingForm:
    """How the per-token logits become the mappings (module docstring): ``name`` "paper"
    (arXiv 2512.24880) or "deepseek_v4" (DeepSeek-V4's activations and Sinkhorn, with
    ``eps``); ``transposed``: the streams are mixed with the transpose of the Sinkhorn matrix
    (DeepSeek-V4), i.e. ``h_res`` is returned transposed."""

    name: Literal["paper", "deepseek_v4"] = "paper"
    eps: float = 1e-6
    transposed: bool = False


PAPER = MappingForm()


def _acc(t: Tensor) -> Tensor:
    """``t`` in the accumulation dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def as_tokens(x: Tensor, n: int | None) -> Tensor:
    """``x`` as ``[T, n, C]``: itself when ``n`` is None (already so), else the streams
    ``[..., n*C]`` reshaped (a view when they are contiguous; the fused ops take it inside
    their autograd functions, so the graph gets no view node)."""
    return x if n is None else x.reshape(-1, n, x.shape[-1] // n)


def token_dims(x: Tensor, n: int | None) -> tuple[int, int, int]:
    """``as_tokens(x, n).shape``, ``(T, n, C)``, without forming the view (the fused ops pass
    the streams' own pointer to their kernels). Raises where ``as_tokens`` could not reshape:
    a last dimension that ``n`` streams do not divide."""
    if n is None:
        return tuple(x.shape)
    width = x.shape[-1]
    if n <= 0 or width % n or width == 0:
        raise ValueError(f"the streams [..., n*C] need a last dimension divisible by n={n}, got "
                         f"{tuple(x.shape)}. Fix: pass the streams [..., {n}*C] of n={n}.")
    return math.prod(x.shape[:-1]), n, width // n


def aggregate_shape(x: Tensor, n: int | None, C: int) -> tuple[int, ...]:
    """The shape of the aggregate ``y`` (``C`` channels a token) in ``x``'s layout:
    ``[T, C]`` for ``x [T, n, C]`` (``n`` None), ``[..., C]`` for the streams ``[..., n*C]``."""
    return (*x.shape[:-2 if n is None else -1], C)


def num_mapping_coefficients(n: int) -> int:
    """m = 2n + n^2: n pre, n post and n*n residual-mixing coefficients per token."""
    return 2 * n + n * n


def project_and_rms(x: Tensor, phi: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """One pass over ``x [T, n, C]``: ``Ht = (vec(x) @ phi^T) / r`` and ``r`` (both fp32).

    Returns ``(ht [T, m], r [T])``. The projection is computed before dividing by r
    (eqs. 14-15), so a fused kernel can produce both from one read of x.
    """
    v = _acc(x.reshape(x.shape[0], -1))
    r = torch.sqrt(v.pow(2).mean(dim=-1) + eps)
    ht = (v @ _acc(phi).to(v.dtype).t()) / r.unsqueeze(-1)
    return ht, r


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """Log-domain Sinkhorn-Knopp: ``[T, n, n]`` logits -> doubly stochastic ``[T, n, n]``.

    Starts from ``M0 = exp(logits)`` and alternates row then column normalisation
    ``iterations`` times, in fp32 with logsumexp. Columns are normalised last, so they sum
    to 1 up to rounding; rows converge to 1 as ``iterations`` grows.
    """
    log_m = _acc(logits)
    for _ in range(iterations):
        log_m = log_m - torch.logsumexp(log_m, dim=-1, keepdim=True)
        log_m = log_m - torch.logsumexp(log_m, dim=-2, keepdim=True)
    return log_m.exp()


def sinkhorn_deepseek_v4(logits: Tensor, iterations: int, eps: float) -> Tensor:
    """DeepSeek-V4's Sinkhorn: ``[T, n, n]`` logits -> ``M`` (module docstring), fp32 (fp64
    for fp64 logits): a row softmax plus ``eps``, a column normalisation, then
    ``iterations - 1`` row and column normalisations, each dividing by ``sum + eps``."""
    m = torch.softmax(_acc(logits), dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def mappings_from_projection(
    ht: Tensor, alpha: Tensor, bias: Tensor, n: int, sinkhorn_iterations: int,
    form: MappingForm = PAPER,
) -> tuple[Tensor, Tensor, Tensor]:
    """Scale + activations: ``ht [T, m]`` -> ``(h_pre [T,n], h_post [T,n], h_res [T,n,n])``
    in ``form`` (module docstring)."""
    alpha = _acc(alpha)
    bias = _acc(bias)
    pre = torch.sigmoid(alpha[0] * ht[:, :n] + bias[:n])
    post = 2.0 * torch.sigmoid(alpha[1] * ht[:, n : 2 * n] + bias[n : 2 * n])
    res_logits = (alpha[2] * ht[:, 2 * n :] + bias[2 * n :]).view(-1, n, n)
    if form.name == "deepseek_v4":
        pre = pre + form.eps
        res = sinkhorn_deepseek_v4(res_logits, sinkhorn_iterations, form.eps)
    else:
        res = sinkhorn(res_logits, sinkhorn_iterations)
    return pre, post, res.transpose(-1, -2) if form.transposed else res


def compute_mappings(
    x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, sinkhorn_iterations: int, eps: float,
    form: MappingForm = PAPER,
) -> tuple[Tensor, Tensor, Tensor]:
    """The dynamic mappings of eqs. 14-19 (in ``form``) for ``x [T, n, C]`` (see module
    docstring)."""
    ht, _ = project_and_rms(x, phi, eps)
    return mappings_from_projection(ht, alpha, bias, x.shape[1], sinkhorn_iterations, form)


def pre(
    x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, sinkhorn_iterations: int, eps: float,
    form: MappingForm = PAPER,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mappings then aggregate: ``(y [T, C], h_pre [T, n], h_post [T, n], h_res [T, n, n])``."""
    h_pre, h_post, h_res = compute_mappings(x, phi, alpha, bias, sinkhorn_iterations, eps, form)
    return aggregate(x, h_pre), h_pre, h_post, h_res


def output_head(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, rms_eps: float,
                eps: float) -> Tensor:
    """DeepSeek-V4's learned contraction of the streams (its ``hc_head``): ``[T, n, C]`` ->
    ``[T, C]`` in ``x.dtype``, ``sum_i w_i x_i`` with per-token weights
    ``w = sigmoid(alpha * (vec(x) @ phi^T) / r + bias) + eps`` (``phi [n, n*C]``,
    ``alpha [1]``, ``bias [n]``, ``r`` the RMS of ``vec(x)`` with ``rms_eps``), in fp32."""
    ht, _ = project_and_rms(x, phi, rms_eps)
    w = torch.sigmoid(_acc(alpha) * ht + _acc(bias)) + eps
    return aggregate(x, w)


def aggregate(x: Tensor, h_pre: Tensor) -> Tensor:
    """``y = sum_i h_pre[:, i] * x[:, i]``: ``[T, n, C]`` -> ``[T, C]`` in ``x.dtype``."""
    y = torch.einsum("tn,tnc->tc", _acc(h_pre), _acc(x))
    return y.to(x.dtype)


def expand_combine(
    x: Tensor, f: Tensor, f_bias: Tensor | None, h_res: Tensor, h_post: Tensor
) -> Tensor:
    """``x'[i] = sum_j h_res[i,j] x[j] + h_post[i] (f + f_bias)``: -> ``[T, n, C]``, ``x.dtype``.

    ``f`` is the sublayer output ``[T, C]`` and ``f_bias`` its optional ``[C]`` bias (the
    un-fused bias of Megatron's linear layers); dropout, if any, is applied by the caller.
    """
    branch = _acc(f) if f_bias is None else _acc(f) + _acc(f_bias)
    mixed = torch.einsum("tij,tjc->tic", _acc(h_res), _acc(x))
    out = mixed + _acc(h_post).unsqueeze(-1) * branch.unsqueeze(1)
    return out.to(x.dtype)
