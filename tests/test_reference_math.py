"""The PyTorch reference ops against an independent per-token NumPy float64 implementation,
plus gradcheck, Sinkhorn properties and low-precision robustness."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mhc_megatron.kernels import reference as ref
from mhc_megatron.layers.hyper_connection import initial_mapping_bias


def _naive_token(v, phi, alpha, b, n, iters, eps):
    """Eqs. 14-19 for one token, straight from the paper, NumPy float64, no log domain."""
    r = math.sqrt(np.mean(v * v) + eps)
    ht = phi @ v / r
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    pre = sig(alpha[0] * ht[:n] + b[:n])
    post = 2.0 * sig(alpha[1] * ht[n:2 * n] + b[n:2 * n])
    m = np.exp(alpha[2] * ht[2 * n:] + b[2 * n:]).reshape(n, n)
    for _ in range(iters):
        m = m / m.sum(axis=1, keepdims=True)
        m = m / m.sum(axis=0, keepdims=True)
    return pre, post, m


def _random_problem(t, n, c, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    m = ref.num_mapping_coefficients(n)
    x = (torch.randn(t, n, c, generator=g) * scale).to(dtype)
    phi = torch.randn(m, n * c, generator=g) * 0.2
    alpha = torch.rand(3, generator=g) + 0.5
    bias = torch.randn(m, generator=g)
    return x, phi, alpha, bias


@pytest.mark.parametrize("t,n,c", [(5, 4, 24), (3, 1, 7), (7, 2, 13), (2, 8, 5), (4, 3, 11)])
def test_mappings_match_naive_per_token(t, n, c):
    x, phi, alpha, bias = _random_problem(t, n, c, seed=t * 100 + n)
    h_pre, h_post, h_res = ref.compute_mappings(x, phi, alpha, bias, 20, 1e-6)
    for i in range(t):
        pre, post, res = _naive_token(
            x[i].double().flatten().numpy(), phi.double().numpy(), alpha.double().numpy(),
            bias.double().numpy(), n, 20, 1e-6)
        np.testing.assert_allclose(h_pre[i].numpy(), pre, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h_post[i].numpy(), post, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h_res[i].numpy(), res, rtol=1e-4, atol=1e-6)


def test_aggregate_and_combine_match_naive():
    t, n, c = 6, 4, 9
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, n, c, generator=g)
    f = torch.randn(t, c, generator=g)
    fb = torch.randn(c, generator=g)
    h_pre = torch.rand(t, n, generator=g)
    h_post = 2 * torch.rand(t, n, generator=g)
    h_res = torch.rand(t, n, n, generator=g)
    y = ref.aggregate(x, h_pre)
    out = ref.expand_combine(x, f, fb, h_res, h_post)
    for k in range(t):
        xk = x[k].double().numpy()
        np.testing.assert_allclose(y[k].numpy(), h_pre[k].double().numpy() @ xk, rtol=1e-5, atol=1e-6)
        expect = h_res[k].double().numpy() @ xk + np.outer(
            h_post[k].double().numpy(), (f[k] + fb).double().numpy())
        np.testing.assert_allclose(out[k].numpy(), expect, rtol=1e-5, atol=1e-5)
    # No bias is the same as a zero bias.
    torch.testing.assert_close(ref.expand_combine(x, f, None, h_res, h_post),
                               ref.expand_combine(x, f, torch.zeros(c), h_res, h_post))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_sinkhorn_doubly_stochastic(n, scale):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(64, n, n, generator=g) * scale
    h = ref.sinkhorn(logits, 20)
    assert torch.isfinite(h).all() and (h >= 0).all()
    cols = h.sum(dim=-2)
    rows = h.sum(dim=-1)
    torch.testing.assert_close(cols, torch.ones_like(cols), atol=1e-5, rtol=0)
    if scale == 1.0:
        # Moderate logits (the regime of trained mappings): 20 iterations converge the rows.
        assert (rows - 1).abs().max() < 1e-4
    # Rows always converge as iterations grow (slowly for very peaked logits).
    errors = [(ref.sinkhorn(logits, k).sum(-1) - 1).abs().max().item() for k in (20, 100, 1000)]
    assert errors[0] >= errors[1] >= errors[2] and errors[2] < 2e-3


def test_sinkhorn_large_logits_stay_finite():
    logits = torch.tensor([[[200.0, -300.0], [150.0, 90.0]]])
    h = ref.sinkhorn(logits, 20)
    assert torch.isfinite(h).all()
    torch.testing.assert_close(h.sum(-2), torch.ones(1, 2), atol=1e-6, rtol=0)


def test_gradcheck_mappings_float64():
    x, phi, alpha, bias = _random_problem(3, 2, 3, dtype=torch.float64, seed=1)
    args = [a.double().requires_grad_() for a in (x, phi, alpha, bias)]

    def fn(x, phi, alpha, bias):
        return ref.compute_mappings(x, phi, alpha, bias, 5, 1e-6)

    assert torch.autograd.gradcheck(fn, args)


def test_gradcheck_aggregate_and_combine_float64():
    g = torch.Generator().manual_seed(2)
    t, n, c = 3, 3, 4
    x = torch.randn(t, n, c, generator=g, dtype=torch.float64, requires_grad=True)
    f = torch.randn(t, c, generator=g, dtype=torch.float64, requires_grad=True)
    fb = torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True)
    h_pre = torch.rand(t, n, generator=g, dtype=torch.float64, requires_grad=True)
    h_post = torch.rand(t, n, generator=g, dtype=torch.float64, requires_grad=True)
    h_res = torch.rand(t, n, n, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ref.aggregate, (x, h_pre))
    assert torch.autograd.gradcheck(ref.expand_combine, (x, f, fb, h_res, h_post))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_large_values_do_not_overflow(dtype):
    # (1.5e4)^2 overflows fp16 (max 65504), so the RMS must be taken in fp32; the
    # aggregate (at most n * 1.5e4 = 6e4) still fits.
    x, phi, alpha, bias = _random_problem(4, 4, 16, seed=5)
    x = (x.sign() * 1.5e4).to(dtype)
    h_pre, h_post, h_res = ref.compute_mappings(x, phi, alpha, bias, 20, 1e-6)
    expect = ref.compute_mappings(x.double(), phi.double(), alpha.double(), bias.double(), 20, 1e-6)
    for got, want in zip((h_pre, h_post, h_res), expect):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    y = ref.aggregate(x, h_pre)
    assert y.dtype == dtype and torch.isfinite(y.float()).all()


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_initial_bias_is_near_standard_residual(n):
    b = initial_mapping_bias(n)
    zero_ht = torch.zeros(1, ref.num_mapping_coefficients(n))
    h_pre, h_post, h_res = ref.mappings_from_projection(zero_ht, torch.ones(3), b, n, 20)
    expect_pre = 1.0 / n if n > 1 else 1.0
    torch.testing.assert_close(h_pre, torch.full((1, n), expect_pre), atol=5e-4, rtol=0)
    torch.testing.assert_close(h_post, torch.ones(1, n))
    diag = torch.diagonal(h_res[0])
    expect_diag = 0.95 if n > 1 else 1.0
    torch.testing.assert_close(diag, torch.full((n,), expect_diag), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("diag", ["uniform", 0.5, 0.8, 0.99])
def test_initial_bias_sets_the_configured_res_diagonal(n, diag):
    """``mhc_init_res_diagonal``: H_res at step 0 has exactly that diagonal (1/n: uniform),
    still doubly stochastic; H_pre and H_post as with the default."""
    d = 1.0 / n if diag == "uniform" else diag
    if d < 1.0 / n:
        pytest.skip("below 1/n is refused by the config")
    zero_ht = torch.zeros(1, ref.num_mapping_coefficients(n))
    _, h_post, h_res = ref.mappings_from_projection(
        zero_ht, torch.ones(3), initial_mapping_bias(n, "residual", d), n, 20)
    torch.testing.assert_close(torch.diagonal(h_res[0]), torch.full((n,), d), atol=1e-5, rtol=0)
    off = h_res[0][~torch.eye(n, dtype=torch.bool)]
    torch.testing.assert_close(off, torch.full_like(off, (1 - d) / (n - 1)), atol=1e-5, rtol=0)
    torch.testing.assert_close(h_res[0].sum(0), torch.ones(n), atol=1e-5, rtol=0)
    torch.testing.assert_close(h_post, torch.ones(1, n))


@pytest.mark.parametrize("n", [1, 4])
def test_zero_static_mapping_is_megatron_lms(n):
    """``mhc_init_static_mapping="zero"``: H_pre = 1/2, H_post = 1, H_res = 1/n."""
    b = initial_mapping_bias(n, "zero")
    assert torch.equal(b, torch.zeros(ref.num_mapping_coefficients(n)))
    zero_ht = torch.zeros(1, ref.num_mapping_coefficients(n))
    h_pre, h_post, h_res = ref.mappings_from_projection(zero_ht, torch.ones(3), b, n, 20)
    torch.testing.assert_close(h_pre, torch.full((1, n), 0.5))
    torch.testing.assert_close(h_post, torch.ones(1, n))
    torch.testing.assert_close(h_res, torch.full((1, n, n), 1.0 / n), atol=1e-6, rtol=0)


@pytest.mark.parametrize("static", ["residual", "zero"])
def test_h_res_gets_almost_no_gradient_while_the_streams_are_equal(static):
    """Why H_res hardly moves early in training: while all n streams are equal
    (layer 1 expands h into n copies, and H_post = 1 adds the same output to each), every
    doubly stochastic H_res maps them to themselves, so dL/dH_res has equal columns, which the
    exact doubly-stochastic projection removes. With the zero (uniform) initialisation the
    H_res logits (bias[2n:]) then get no gradient up to rounding; with the residual one
    (diagonal 0.95) only what 20 unrolled Sinkhorn iterations leave, < 1e-3 of H_post's
    gradient. Once the streams differ, H_res gets much larger gradients."""
    n, c, t = 4, 16, 8
    torch.manual_seed(0)
    phi = torch.randn(ref.num_mapping_coefficients(n), n * c, dtype=torch.float64) * 0.02
    alpha = torch.full((3,), 0.01, dtype=torch.float64)
    f = torch.randn(t, c, dtype=torch.float64)
    target = torch.randn(t, n, c, dtype=torch.float64)

    def post_and_res_grads(x):
        bias = initial_mapping_bias(n, static).double().requires_grad_()
        _, _, h_post, h_res = ref.pre(x, phi, alpha, bias, 20, 1e-6)
        out = ref.expand_combine(x, f, None, h_res, h_post)
        ((out - target) ** 2).sum().backward()
        return bias.grad[n:2 * n].norm().item(), bias.grad[2 * n:].norm().item()

    h = torch.randn(t, 1, c, dtype=torch.float64)
    post_g, res_equal = post_and_res_grads(h.expand(t, n, c).contiguous())
    bound = 1e-10 if static == "zero" else 1e-3
    assert post_g > 1e-2 and res_equal < bound * post_g, (post_g, res_equal)
    post_g, res_distinct = post_and_res_grads(h + 0.3 * torch.randn(t, n, c, dtype=torch.float64))
    assert res_distinct > 1e-2 * post_g and res_distinct > 5 * res_equal, (res_distinct, res_equal)


DSV4 = ref.MappingForm("deepseek_v4", eps=1e-6)


def test_deepseek_v4_sinkhorn_is_its_definition():
    """The DeepSeek-V4 Sinkhorn, written out once more by hand from its definition (row
    softmax + eps, a column normalisation, then iterations - 1 row and column normalisations,
    each dividing by sum + eps), in fp64; it ends on a column normalisation, so its columns
    sum to 1 up to eps."""
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
    eps = 1e-6
    m = logits.exp() / logits.exp().sum(-1, keepdim=True) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(19):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    got = ref.sinkhorn_deepseek_v4(logits, 20, eps)
    torch.testing.assert_close(got, m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-2), torch.ones(6, 4, dtype=torch.float64), atol=1e-5,
                               rtol=0)


def test_deepseek_v4_form_and_transposition():
    """``deepseek_v4``: H_pre is the paper's sigmoid + eps, H_post the paper's; ``transposed``
    returns the Sinkhorn matrix transposed (what the combine then mixes with)."""
    x, phi, alpha, bias = (t.double() for t in _random_problem(5, 4, 8, seed=3))
    paper = ref.compute_mappings(x, phi, alpha, bias, 20, 1e-6)
    ds = ref.compute_mappings(x, phi, alpha, bias, 20, 1e-6, DSV4)
    ds_t = ref.compute_mappings(x, phi, alpha, bias, 20, 1e-6,
                                ref.MappingForm("deepseek_v4", eps=1e-6, transposed=True))
    torch.testing.assert_close(ds[0], paper[0] + 1e-6)
    torch.testing.assert_close(ds[1], paper[1])
    torch.testing.assert_close(ds_t[2], ds[2].transpose(-1, -2))
    assert not torch.allclose(ds[2], ds[2].transpose(-1, -2))  # not symmetric: the order matters
    paper_t = ref.compute_mappings(x, phi, alpha, bias, 20, 1e-6, ref.MappingForm(transposed=True))
    torch.testing.assert_close(paper_t[2], paper[2].transpose(-1, -2))


def test_gradcheck_deepseek_v4_mappings_float64():
    x, phi, alpha, bias = _random_problem(3, 2, 3, dtype=torch.float64, seed=1)
    args = [a.double().requires_grad_() for a in (x, phi, alpha, bias)]
    form = ref.MappingForm("deepseek_v4", eps=1e-6, transposed=True)

    def fn(x, phi, alpha, bias):
        return ref.compute_mappings(x, phi, alpha, bias, 5, 1e-6, form)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("shape,n", [((5, 3, 4 * 8), 4), ((7, 2 * 3), 2), ((1, 1, 1, 8), 8),
                                     ((0, 2, 4 * 6), 4), ((6, 4, 5), None), ((3, 1), 1)])
def test_token_dims_are_the_token_views_shape(shape, n):
    """The fused ops read the streams through their own pointer with the token dims
    ``(T, n, C)`` of ``as_tokens``' view, never forming it."""
    x = torch.zeros(shape)
    assert ref.token_dims(x, n) == tuple(ref.as_tokens(x, n).shape)


def test_token_dims_refuse_streams_that_n_does_not_divide():
    for shape, n in (((4, 10), 4), ((4, 0), 4), ((4, 8), 0)):
        with pytest.raises(ValueError, match="divisible by n"):
            ref.token_dims(torch.zeros(shape), n)
