"""Gradient-accumulation fusion of the mapping parameters (Triton backend).

With Megatron's ``gradient_accumulation_fusion`` the Triton pre adds the gradients of
``phi``, ``alpha`` and ``bias`` to their ``main_grad`` buffers in the kernel that sums them
(``triton_pre.pre(main_grads=True)``), where Megatron's DDP would otherwise add each
parameter's ``.grad`` in its gradient hook (one launch per parameter). The result must be
the hook's, bit for bit: checked against the unfused op (its gradients added as Megatron's
hook adds them) and, in a model, against Megatron's own DDP with the fusion off.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py); on a CUDA machine compiled.
"""

from __future__ import annotations

import pytest
import torch

from helpers import batch, build_gpt, lm_loss, tiny_config
from mhc_megatron.kernels import triton_mhc
from mhc_megatron.layers.hyper_connection import HyperConnectionModule

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# The interpreter rounds fp32 to bf16 toward zero (numpy has no bf16), torch and compiled
# Triton to nearest even: a bf16 main_grad's sum (the kernel's rounding against torch's add_)
# is compared bit for bit on GPUs only.
BF16_SUM_NEEDS_GPU = pytest.mark.skipif(
    not CUDA, reason="bf16 main_grad: the Triton interpreter rounds fp32 to bf16 toward zero")


def _leaves(t, n, c, param_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    x = torch.randn(t, n, c, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    phi = (torch.randn(m, n * c, generator=g) * 0.5 / (n * c) ** 0.5).to(DEV, param_dtype)
    alpha = (torch.rand(3, generator=g) + 0.5).to(DEV, param_dtype)
    bias = torch.randn(m, generator=g).to(DEV, param_dtype)
    return x, [p.requires_grad_() for p in (phi, alpha, bias)]


def _backward(x, params, seed, main_grads):
    """pre, then a loss that reads all four outputs, backward."""
    y, h_pre, h_post, h_res = triton_mhc.pre(x, *params, 20, 1e-6, main_grads=main_grads)
    g = torch.Generator().manual_seed(seed)
    w = [0.01 * torch.randn(o.shape, generator=g).to(DEV) for o in (y, h_pre, h_post, h_res)]
    loss = sum((o.float() * wi).sum() for o, wi in zip((y, h_pre, h_post, h_res), w))
    loss.backward()


@pytest.mark.parametrize("param_dtype,main_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=BF16_SUM_NEEDS_GPU),
    (torch.float16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("t,n,c", [(17, 4, 24), (5, 2, 33)])
def test_fused_accumulation_equals_megatrons_hook(param_dtype, main_dtype, t, n, c):
    """Two backward passes into non-zero ``main_grad`` buffers: the fused kernel's sums equal
    ``main_grad.add_(param.grad)`` (Megatron's DDP hook) after the unfused op, bit for bit;
    x's gradient is the same; the parameters are flagged ``grad_added_to_main_grad``."""
    x, params = _leaves(t, n, c, param_dtype, 0)
    start = [torch.randn(p.shape, generator=torch.Generator().manual_seed(9)).to(DEV, main_dtype)
             for p in params]
    # unfused: autograd's gradients, added as Megatron's hook adds them
    expected = [s.clone() for s in start]
    for step in range(2):
        _backward(x, params, step, main_grads=False)
        for e, p in zip(expected, params):
            e.add_(p.grad)
            p.grad = None
    dx_unfused, x.grad = x.grad, None
    # fused
    for p, s in zip(params, start):
        p.main_grad = s.clone()
        p.grad_added_to_main_grad = False
    for step in range(2):
        _backward(x, params, step, main_grads=True)
        assert all(p.grad_added_to_main_grad for p in params)
        for p in params:
            p.grad = None  # (the hook's part: the returned gradient is not read)
    for name, e, p in zip(("phi", "alpha", "bias"), expected, params):
        assert p.main_grad.dtype == main_dtype
        assert torch.equal(p.main_grad, e), (name, (p.main_grad.double() - e.double()).abs().max())
    assert torch.equal(x.grad, dx_unfused)


class _TensorSubclass(torch.Tensor):
    pass


def test_without_megatrons_flag_the_gradients_go_to_autograd():
    """No ``grad_added_to_main_grad`` (no Megatron DDP), a ``zero_out_wgrad`` request, a
    ``main_grad`` of another shape, or one that is a tensor subclass (a DTensor's shards are
    not a buffer of the parameter's shape): the fusion is off and autograd gets the
    gradients, as without ``main_grads``; the ``main_grad`` buffers are untouched."""
    x, params = _leaves(9, 4, 16, torch.float32, 1)
    _backward(x, params, 0, main_grads=False)
    reference = [p.grad.clone() for p in params]
    for setup in ("no flag", "zero_out_wgrad", "shape", "tensor subclass"):
        for p in params:
            p.grad = None
            p.main_grad = torch.zeros(p.numel() + (setup == "shape"), device=DEV)
            if setup != "shape":
                p.main_grad = p.main_grad.view(p.shape)
            if setup == "tensor subclass":  # (as a DTensor main_grad would be)
                p.main_grad = p.main_grad.as_subclass(_TensorSubclass)
            if setup != "no flag":
                p.grad_added_to_main_grad = False
            p.zero_out_wgrad = setup == "zero_out_wgrad"
        _backward(x, params, 0, main_grads=True)
        for p, r in zip(params, reference):
            assert torch.equal(p.grad, r), setup
            assert not p.main_grad.any(), setup
            assert not getattr(p, "grad_added_to_main_grad", False), setup
        for p in params:
            for attr in ("main_grad", "grad_added_to_main_grad", "zero_out_wgrad"):
                if hasattr(p, attr):
                    delattr(p, attr)


@pytest.mark.parametrize("grad_reduce_in_fp32", [True, pytest.param(False,
                                                                     marks=BF16_SUM_NEEDS_GPU)])
def test_model_main_grads_under_megatrons_ddp_equal_the_unfused_ones(seeded,
                                                                      grad_reduce_in_fp32):
    """A bf16 mHC GPT (Triton kernels) in Megatron's DDP, two micro-batches accumulated: with
    ``gradient_accumulation_fusion`` on for the mHC modules every ``main_grad`` equals the run
    with it off, bit for bit, and the mapping parameters' gradients took the fused path.
    (Megatron's own linear layers need Apex for the flag, so it is turned on after the model
    is built: only the mHC modules read it at run time.)"""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = tiny_config(bf16=True, params_dtype=torch.bfloat16, mhc_kernel_backend="triton",
                         num_layers=1)
    model = build_gpt(config, device=DEV)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False),
        Float16Module(config, model))
    mapping = [p for m in model.modules() if isinstance(m, HyperConnectionModule)
               for p in (m.phi, m.alpha, m.bias)]
    assert len(mapping) == 3 * 2 * config.num_layers

    def main_grads(fused: bool) -> dict:
        config.gradient_accumulation_fusion = fused
        ddp.zero_grad_buffer()
        for seed in (0, 1):
            lm_loss(ddp, batch(seed=seed, device=DEV)).backward()
            assert all(p.grad_added_to_main_grad == fused for p in mapping)
        return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}

    try:
        unfused, fused = main_grads(False), main_grads(True)
    finally:
        config.gradient_accumulation_fusion = False
    assert sorted(unfused) == sorted(fused)
    different = [n for n in unfused if not torch.equal(unfused[n], fused[n])]
    assert not different, different
    assert any("hyper_connection" in n and fused[n].any() for n in fused)
