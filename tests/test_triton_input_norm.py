"""The input RMSNorm fused into the Triton pre op (``mhc_fuse_input_norm``) against the
PyTorch reference (``reference.pre`` then ``reference.input_norm``): forward and every
gradient, the norm weight's included, on odd shapes; broadcast streams; the recompute's
replay of ``y``; the fallbacks (another consumer of ``y``, a tensor that is not pre's ``y``).

On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py); on a CUDA machine compiled,
plus real sizes.
"""

from __future__ import annotations

import pytest
import torch

from mhc_megatron.kernels import reference as ref
from mhc_megatron.kernels import triton_mhc
from mhc_megatron.kernels.triton_input_norm import _InputNormFn

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-3 if CUDA else 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 4e-3}
NORM_EPS = 1e-5


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(t, n, c, dtype, seed, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    phi = (torch.randn(m, n * c, generator=g) * 0.5 / (n * c) ** 0.5).to(DEV)
    alpha = (torch.rand(3, generator=g) + 0.5).to(DEV)
    bias = torch.randn(m, generator=g).to(DEV)
    w = (torch.rand(c, generator=g) + 0.5).to(DEV, w_dtype)
    grads = [torch.randn(t, c, generator=g).to(DEV, dtype), torch.randn(t, n, generator=g).to(DEV),
             torch.randn(t, n, n, generator=g).to(DEV)]
    return x, phi, alpha, bias, w, grads


def _reference_pre(x, phi, alpha, bias, iters, eps, n=None, norm=None):
    return ref.pre(x, phi, alpha, bias, iters, eps)


def _run(ops_pre, ops_norm, x, phi, alpha, bias, w, grads, y_grad=None):
    """``yn`` (and the mappings) of pre + input norm, and the gradients of x, phi, alpha,
    bias, w for upstream ``grads`` = (d yn, d h_post, d h_res) (+ ``y_grad`` on ``y``)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, alpha, bias, w)]
    y, h_pre, h_post, h_res = ops_pre(*leaves[:4], 20, 1e-6, norm=(leaves[4], NORM_EPS))
    yn = ops_norm(y, leaves[4], NORM_EPS)
    outs, ups = [yn, h_post, h_res], list(grads)
    if y_grad is not None:
        outs.append(y)
        ups.append(y_grad)
    torch.autograd.backward(outs, ups)
    return [yn.detach(), y.detach(), h_pre.detach()], [leaf.grad for leaf in leaves]


CPU_SHAPES = [(5, 1, 7), (19, 2, 33), (17, 4, 24), (3, 8, 5), (21, 4, 130)]
GPU_SHAPES = CPU_SHAPES + [(4097, 4, 1000), (8191, 8, 257), (1000, 4, 4096), (4096, 4, 4096)]
NAMES = ("yn", "y", "h_pre", "dx", "dphi", "dalpha", "dbias", "dw")


def _assert_close(got, want, dtype, what=""):
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a).all(), name
        err = rel_err(a, b)
        assert err < TOL[dtype], f"{what}{name}: rel err {err:.2e} >= {TOL[dtype]}"


@pytest.mark.parametrize("t,n,c", GPU_SHAPES if CUDA else CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_with_input_norm_matches_reference(t, n, c, dtype):
    """``yn = RMSNorm(y) * w`` formed by pre's kernels, and the norm's backward folded into
    pre's (dH_pre and dx passes, ``w``'s gradient partials): equal to the reference's pre then
    RMSNorm, forward and all five gradients; ``y`` itself is pre's ``y`` bit for bit."""
    x, phi, alpha, bias, w, grads = _case(t, n, c, dtype, seed=t + 10 * n + c)
    outs, g = _run(triton_mhc.pre, triton_mhc.input_norm, x, phi, alpha, bias, w, grads)
    outs0, g0 = _run(_reference_pre, ref.input_norm, x, phi, alpha, bias, w, grads)
    assert outs[0].dtype == dtype and g[4].dtype == w.dtype
    runs = [outs + g, outs0 + g0]
    if dtype != torch.float32:  # and the math without 16-bit roundings (see below)
        runs.append(sum(_run(_reference_pre, ref.input_norm, x.float(), phi, alpha, bias, w,
                             [gr.float() for gr in grads]), []))
    if n == 1:
        # RMSNorm(h_pre * x) does not depend on a scalar h_pre > 0: H_pre's gradients (phi's
        # row 0, bias[0], alpha[0]) are 0 in exact math, rounding noise in any implementation
        for run in runs:
            run[4:7] = [run[4][1:], run[5][1:], run[6][1:]]
    if dtype == torch.float32:
        _assert_close(runs[0], runs[1], dtype)
        return
    # 16-bit x: RMSNorm(y) is invariant to a common scale of H_pre, so H_pre's gradient is
    # orthogonal to H_pre, a difference of two near-equal sums over C: its 16-bit rounding
    # noise (of y in the forward, of dy in the reference's backward) is a few per cent of
    # alpha_pre's gradient. Both implementations are held to the fp32 math: the fused one
    # within the tolerance or twice the reference's own error, whichever is larger.
    for name, a, b, oracle in zip(NAMES, *runs):
        assert torch.isfinite(a).all(), name
        bound = max(TOL[dtype], 2 * rel_err(b, oracle))
        assert rel_err(a, oracle) < bound, \
            f"{name}: rel err {rel_err(a, oracle):.2e} to the fp32 math >= {bound:.2e}"
    with torch.no_grad():
        plain_y = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6)[0]
    assert torch.equal(outs[1], plain_y), "the fused aggregate changed y's bits"


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_norm_weight_dtype_and_grad_of_unused_output(w_dtype):
    """A bf16 norm weight (a bf16 model's) gets a bf16 gradient; when only the mappings are
    used downstream (``yn`` gets no gradient), the weight's gradient is zero and x's is the
    mappings' alone, as in the reference."""
    x, phi, alpha, bias, w, grads = _case(17, 4, 24, torch.bfloat16, seed=3, w_dtype=w_dtype)
    _, g = _run(triton_mhc.pre, triton_mhc.input_norm, x, phi, alpha, bias, w, grads)
    _, g0 = _run(_reference_pre, ref.input_norm, x, phi, alpha, bias, w, grads)
    assert g[4].dtype == w_dtype and rel_err(g[4], g0[4]) < TOL[torch.bfloat16]
    for zero_dyn in (True,):
        leaves = [t.detach().clone().requires_grad_() for t in (x, phi, alpha, bias, w)]
        y, _, h_post, h_res = triton_mhc.pre(*leaves[:4], 20, 1e-6, norm=(leaves[4], NORM_EPS))
        triton_mhc.input_norm(y, leaves[4], NORM_EPS)  # unused
        torch.autograd.backward([h_post, h_res], grads[1:])
        ref_leaves = [t.detach().clone().requires_grad_() for t in (x, phi, alpha, bias)]
        _, _, rp, rr = ref.pre(*ref_leaves, 20, 1e-6)
        torch.autograd.backward([rp, rr], grads[1:])
        assert leaves[4].grad is None or torch.count_nonzero(leaves[4].grad) == 0
        assert rel_err(leaves[0].grad, ref_leaves[0].grad) < TOL[torch.bfloat16]


def test_y_with_another_consumer_takes_the_unfused_norm_backward():
    """If ``y`` also feeds something else, its gradient arrives at pre's backward with the
    norm's: the norm's backward then runs unfused (PyTorch) and the two are added."""
    x, phi, alpha, bias, w, grads = _case(19, 2, 33, torch.float32, seed=5)
    y_grad = torch.randn(19, 33, generator=torch.Generator().manual_seed(9)).to(DEV)
    outs, g = _run(triton_mhc.pre, triton_mhc.input_norm, x, phi, alpha, bias, w, grads, y_grad)
    outs0, g0 = _run(_reference_pre, ref.input_norm, x, phi, alpha, bias, w, grads, y_grad)
    _assert_close(outs + g, outs0 + g0, torch.float32)


def test_input_norm_of_another_tensor_is_the_reference():
    """``input_norm`` of a tensor that is not a fused pre's ``y`` (a view of it, or pre's ``y``
    with another weight) is the reference RMSNorm with autograd, never the parked result."""
    x, phi, alpha, bias, w, _ = _case(17, 4, 24, torch.float32, seed=7)
    w.requires_grad_()
    y, *_ = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, norm=(w, NORM_EPS))
    other_w = w * 2
    for yy, ww in ((y.view(17, 4, 6).view(17, 24), w), (y, other_w)):
        got = triton_mhc.input_norm(yy, ww, NORM_EPS)
        assert type(got.grad_fn).__name__ != _InputNormFn.__name__ + "Backward"
        assert rel_err(got, ref.input_norm(yy, ww, NORM_EPS)) < 1e-6
    # the parked result is still there for pre's own y and weight
    fused = triton_mhc.input_norm(y, w, NORM_EPS)
    assert type(fused.grad_fn).__name__ == _InputNormFn.__name__ + "Backward"
    assert torch.allclose(fused, ref.input_norm(y, w, NORM_EPS), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,n,c,dtype", [(17, 4, 24, torch.float32), (21, 2, 130, torch.bfloat16)]
                         + ([(4097, 4, 1024, torch.bfloat16)] if CUDA else []))
def test_broadcast_streams_with_input_norm_equal_their_copy(t, n, c, dtype):
    """Global layer 1 (n equal streams as a stride-0 view): the fused norm reads the view as
    it is and gives what the materialised copy gives, forward and gradients."""
    g = torch.Generator().manual_seed(t + n)
    h = torch.randn(t, c, generator=g).to(DEV, dtype)
    _, phi, alpha, bias, w, grads = _case(t, n, c, dtype, seed=t)
    runs = {}
    for mode in ("broadcast", "copy"):
        hl = h.detach().clone().requires_grad_()
        params = [p.detach().clone().requires_grad_() for p in (phi, alpha, bias, w)]
        x = hl.view(t, 1, c).expand(t, n, c)
        if mode == "copy":
            x = x.contiguous()
        y, _, h_post, h_res = triton_mhc.pre(x, *params[:3], 20, 1e-6, norm=(params[3], NORM_EPS))
        yn = triton_mhc.input_norm(y, params[3], NORM_EPS)
        torch.autograd.backward([yn, h_post, h_res], grads)
        runs[mode] = [yn, hl.grad, *[p.grad for p in params]]
    for name, a, b in zip(("yn", "dh", "dphi", "dalpha", "dbias", "dw"), runs["broadcast"],
                          runs["copy"]):
        assert rel_err(a, b) < (1e-5 if dtype == torch.float32 else TOL[dtype] / 4), name


def test_streams_layout_and_empty_tokens():
    """The streams as the layers carry them (``[s, b, n*C]`` with ``n``) give the token
    layout's results; zero tokens give empty outputs and zero gradients."""
    x, phi, alpha, bias, w, grads = _case(12, 4, 24, torch.float32, seed=11)
    outs, g = _run(triton_mhc.pre, triton_mhc.input_norm, x, phi, alpha, bias, w, grads)
    xs = x.reshape(3, 4, 4 * 24)
    leaves = [t.detach().clone().requires_grad_() for t in (xs, phi, alpha, bias, w)]
    y, _, h_post, h_res = triton_mhc.pre(*leaves[:4], 20, 1e-6, n=4, norm=(leaves[4], NORM_EPS))
    yn = triton_mhc.input_norm(y, leaves[4], NORM_EPS)
    assert yn.shape == (3, 4, 24)
    torch.autograd.backward([yn, h_post, h_res], [grads[0].view(3, 4, 24), *grads[1:]])
    assert torch.equal(yn.reshape(12, 24), outs[0])
    for a, b in zip([leaves[0].grad.reshape(12, 4, 24), *[lf.grad for lf in leaves[1:]]], g):
        assert torch.equal(a, b)
    empty = [t.detach().clone().requires_grad_() for t in (x[:0], phi, alpha, bias, w)]
    y, _, h_post, h_res = triton_mhc.pre(*empty[:4], 20, 1e-6, norm=(empty[4], NORM_EPS))
    yn = triton_mhc.input_norm(y, empty[4], NORM_EPS)
    assert yn.shape == (0, 24)
    (yn.sum() + h_post.sum() + h_res.sum()).backward()
    assert torch.count_nonzero(empty[4].grad) == 0 and empty[0].grad.shape == (0, 4, 24)
