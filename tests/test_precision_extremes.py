"""Reductions over the stream axis stay finite where the exact result fits the activation dtype.

Every place that sums over the n streams (the decoder's final contraction, the aggregate
``y = sum_i H_pre[i] x_i``, the combine's ``df = sum_i H_post[i] g_i``, the gradient of
the stream expansion) must accumulate in fp32: with fp16 streams of 2e4 the sum of four
is 8e4 > 65504, and with streams of +-6e4 a partial sum in fp16 overflows although the
total is small. Each case is checked against float64 math on the same (rounded) inputs,
for both kernel backends (the Triton one runs in the interpreter on CPU).
"""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_config
from mhc_megatron.kernels import reference as ref
from mhc_megatron.kernels import select_ops
from mhc_megatron.layers.streams import expand_streams
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP16_MAX = torch.finfo(torch.float16).max  # 65504


def _balanced_signs(t, n, c, seed):
    """``[t, n, c]`` of +-1 with as many + as - over the stream axis (n even)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([1.0, -1.0]).repeat(n // 2)
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(t * c)])
    return base[perm].view(t, c, n).transpose(1, 2).contiguous()


def _extreme_streams(t, n, c, big, seed):
    """Streams ``big * sign + noise``: every partial sum over the streams is huge, the total small."""
    g = torch.Generator().manual_seed(seed + 1)
    x = big * _balanced_signs(t, n, c, seed) + 200 * torch.randn(t, n, c, generator=g)
    return x.clamp(-FP16_MAX, FP16_MAX)


def _final_norm(normalization, n, dtype):
    cfg = tiny_config(num_residual_streams=n, normalization=normalization,
                      params_dtype=dtype, fp16=dtype == torch.float16,
                      bf16=dtype == torch.bfloat16)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    norm = block.layer_norm(config=cfg, hidden_size=cfg.hidden_size, eps=1e-5)
    norm = norm.to(DEV, dtype)  # as in a model (Float16Module): CUDA norms refuse mixed dtypes
    with torch.no_grad():  # non-trivial affine parameters
        for p in norm.parameters():
            p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
    return cfg, norm


def _norm_float64(z, norm, normalization, eps):
    """norm(z) in float64 with ``norm``'s affine parameters; ``z`` is ``[..., C]``."""
    params = dict(norm.norm.named_parameters())
    weight = next(p for k, p in params.items() if k.endswith("weight")).double()
    if normalization == "RMSNorm":
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight
    bias = next(p for k, p in params.items() if k.endswith("bias")).double()
    mu = z.mean(-1, keepdim=True)
    var = (z - mu).pow(2).mean(-1, keepdim=True)
    return (z - mu) * torch.rsqrt(var + eps) * weight + bias


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,case", [(4, "all +2e4"), (4, "+-2e4"), (4, "random +-6e4"),
                                    (3, "random +-6e4"), (8, "all +2e4"), (2, "gaussian")])
def test_final_contraction_is_overflow_free(megatron_single_rank, normalization, dtype, n, case):
    cfg, norm = _final_norm(normalization, n, dtype)
    s, b, c = 3, 2, cfg.hidden_size
    g = torch.Generator().manual_seed(n)
    if case == "all +2e4":  # the sum n * 2e4 is past fp16's 65504
        x = torch.full((s, b, n, c), 2e4)
        x[..., ::3] += 1e3  # not constant over channels (a LayerNorm of a constant is 0)
    elif case == "+-2e4":
        x = 2e4 * torch.randint(0, 2, (s, b, 1, c), generator=g).float().mul(2).sub(1)
        x = x.expand(s, b, n, c).clone()
    elif case == "random +-6e4":
        x = 6e4 * torch.rand(s, b, n, c, generator=g).mul(2).sub(1)
    else:
        x = torch.randn(s, b, n, c, generator=g)
    x = x.to(DEV, dtype).view(s, b, n * c).requires_grad_()
    out = norm(x)
    assert out.dtype == dtype and torch.isfinite(out).all(), f"{case}: final norm not finite"

    x64 = x.detach().double().requires_grad_()
    want = _norm_float64(x64.view(s, b, n, c).sum(2), norm, normalization, eps=1e-5)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(out.double(), want, **tol)

    grad_out = torch.randn(s, b, c, generator=g).to(DEV)
    out.backward(grad_out.to(dtype))
    want.backward(grad_out.double())
    assert torch.isfinite(x.grad).all()
    scale = x64.grad.abs().max().item()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=5e-2, atol=5e-2 * scale)


def test_megatron_norm_alone_is_finite_on_one_extreme_stream(megatron_single_rank):
    """The baseline the contraction is held to: Megatron's own norm on one +2e4 stream."""
    cfg, norm = _final_norm("RMSNorm", 4, torch.float16)
    x = torch.full((3, 2, cfg.hidden_size), 2e4, device=DEV, dtype=torch.float16)
    assert torch.isfinite(norm.norm(x)).all()


def test_stream_expansion_gradient_accumulates_in_fp32():
    t, n, c = 6, 4, 10
    h = torch.zeros(t, 1, c, device=DEV, dtype=torch.float16, requires_grad=True)
    g = _extreme_streams(t, n, c, 6e4, seed=1)  # [t, n, c]
    out = expand_streams(h, n)  # [t, 1, n*c]
    out.backward(g.to(DEV, torch.float16).reshape(t, 1, n * c))
    want = g.to(torch.float16).double().sum(1)  # exact sum of the rounded gradients
    assert torch.isfinite(h.grad).all()
    torch.testing.assert_close(h.grad.view(t, c).double().cpu(), want, rtol=1e-3, atol=0.5)


def _saturated_mapping_params(n, c):
    """alpha = 0 and biases that give H_pre = 1, H_post = 2, H_res = 1/n for every token."""
    m = ref.num_mapping_coefficients(n)
    bias = torch.zeros(m)
    bias[: 2 * n] = 30.0  # sigmoid(30) == 1 in fp32
    return torch.zeros(m, n * c), torch.zeros(3), bias


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_aggregate_and_combine_accumulate_in_fp32(backend, n):
    """y = sum_i x_i and df = 2 sum_i g_i, each from fp16 terms of +-6e4 / +-3e4."""
    t, c = 7, 24
    x = _extreme_streams(t, n, c, 6e4, seed=n).to(torch.float16)
    f = (3e4 * torch.rand(t, c, generator=torch.Generator().manual_seed(7)).mul(2).sub(1))
    f = f.to(torch.float16)
    g_out = _extreme_streams(t, n, c, 3e4, seed=10 + n).clamp(-3.2e4, 3.2e4).to(torch.float16)
    g_y = torch.randn(t, c, generator=torch.Generator().manual_seed(8)).to(torch.float16)
    phi, alpha, bias = _saturated_mapping_params(n, c)

    def run(dtype, ops, device):
        leaves = [a.to(device, dtype, copy=True).requires_grad_() for a in (x, f)]
        xx, ff = leaves
        mapping = [a.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
                   for a in (phi, alpha, bias)]
        y, h_pre, h_post, h_res = ops.pre(xx, *mapping, 20, 1e-6)
        out = ops.combine(xx, ff, None, h_res, h_post)
        torch.autograd.backward([y, out], [g_y.to(device, dtype), g_out.to(device, dtype)])
        return [r.detach() for r in (y, out, xx.grad, ff.grad)]

    got = run(torch.float16, select_ops(backend, x.to(DEV)), DEV)
    want = run(torch.float64, select_ops("reference", x), "cpu")
    for name, a, b in zip(("y", "x'", "dx", "df"), got, want):
        assert a.dtype == torch.float16 and torch.isfinite(a).all(), f"{backend}: {name} overflowed"
        assert b.abs().max() < FP16_MAX, f"{name}: the exact result must fit fp16"
        torch.testing.assert_close(a.double().cpu(), b, rtol=2e-3, atol=1.0, msg=name)
