"""The ops' ``Function.apply`` without torch's Python wrapper
(mhc_megatron.kernels.autograd_apply): the same outputs, gradients and autograd graph as
``cls.apply``; a tensor that escaped a functorch transform is unwrapped as torch's wrapper
unwraps it; under functorch transforms, and for functions with ``setup_context``, the class's
own ``apply`` runs; on by itself only where torch's ``apply`` is that wrapper."""

from __future__ import annotations

import pytest
import torch

from mhc_megatron.kernels import autograd_apply


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, factor, tag=None):
        ctx.save_for_backward(x, w)
        ctx.factor = factor
        return x * w * factor, (x + w).sum()

    @staticmethod
    def backward(ctx, g, g_sum):
        x, w = ctx.saved_tensors
        g_sum = 0 if g_sum is None else g_sum
        return (g * w * ctx.factor + g_sum, g * x * ctx.factor + g_sum, None, None)


@pytest.fixture
def direct(monkeypatch):
    """The direct apply, whatever this torch's own ``apply`` is."""
    monkeypatch.setattr(autograd_apply, "WRAPPER_SKIPPED", True)
    return autograd_apply.applier(_Scale, tensor_positions=(0, 1))


def test_the_direct_apply_equals_the_class_apply(direct):
    assert direct != _Scale.apply
    got, want = [], []
    for apply, out in ((direct, got), (_Scale.apply, want)):
        x = torch.arange(6.0).view(2, 3).requires_grad_()
        w = torch.linspace(-1, 1, 3).requires_grad_()
        y, s = apply(x, w, 1.5, "tag")
        (y.square().sum() + 2 * s).backward()
        out += [y.detach(), s.detach(), x.grad, w.grad, type(y.grad_fn).__name__]
    for a, b in zip(got, want):
        assert a == b if isinstance(a, str) else torch.equal(a, b)
    assert got[-1] == "_ScaleBackward"


def test_a_tensor_that_escaped_a_transform_is_unwrapped(direct):
    escaped = []

    def f(t):
        escaped.append(t)
        return t.sum()

    torch.func.grad(f)(torch.ones(3))
    dead = escaped[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    w = torch.full((3,), 2.0)
    y, _ = direct(dead, w, 1.0)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(y)
    assert torch.equal(y, _Scale.apply(dead, w, 1.0)[0])


def test_under_a_transform_the_class_apply_runs(direct):
    """torch's own apply, with its own error: this function has no setup_context."""

    def via(apply):
        return lambda t: apply(t, torch.ones(3), 1.0)[0].sum()

    with pytest.raises(RuntimeError, match="setup_context") as ours:
        torch.func.grad(via(direct))(torch.ones(3))
    with pytest.raises(RuntimeError, match="setup_context") as torchs:
        torch.func.grad(via(_Scale.apply))(torch.ones(3))
    assert str(ours.value) == str(torchs.value)


def test_functions_with_setup_context_keep_the_class_apply(monkeypatch):
    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    monkeypatch.setattr(autograd_apply, "WRAPPER_SKIPPED", True)
    assert autograd_apply.applier(WithSetup, (0,)) == WithSetup.apply


def test_on_only_where_torchs_apply_is_the_python_wrapper(monkeypatch):
    is_python = getattr(torch.autograd.Function.apply, "__func__", None) is not None
    assert autograd_apply._is_python_wrapper() == is_python
    monkeypatch.setattr(autograd_apply, "WRAPPER_SKIPPED", False)
    assert autograd_apply.applier(_Scale, (0, 1)) == _Scale.apply
