"""The Triton ops' reused temporaries (``triton_common.Scratch``): one set per device and
stream, fresh where reuse would be unsafe or too large, and no state carried from one call
to the next (on CPU the kernels run under the interpreter; on CUDA compiled)."""

from __future__ import annotations

import pytest
import torch

from mhc_megatron.kernels import triton_common, triton_mhc
from mhc_megatron.kernels.triton_common import Scratch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def test_one_set_per_device_and_stream():
    scratch = Scratch(((3, 4), torch.float32), ((5,), torch.bfloat16))
    first = scratch.tensors(DEV)
    assert [t.shape for t in first] == [(3, 4), (5,)]
    assert [t.dtype for t in first] == [torch.float32, torch.bfloat16]
    assert all(a is b for a, b in zip(first, scratch.tensors(DEV)))  # reused
    if CUDA:
        with torch.cuda.stream(torch.cuda.Stream()):
            other = scratch.tensors(DEV)  # another stream: a set of its own
        assert all(a is not b for a, b in zip(first, other))


def test_fresh_above_the_limit(monkeypatch):
    monkeypatch.setattr(triton_common, "SCRATCH_LIMIT", 47)
    big = Scratch(((12,), torch.float32))  # 48 bytes
    assert big.tensors(DEV)[0] is not big.tensors(DEV)[0]
    assert Scratch(((11,), torch.float32)).reuse


def test_fresh_while_tracing(monkeypatch):
    scratch = Scratch(((2,), torch.float32))
    monkeypatch.setattr(triton_common, "_compiling", lambda: True)
    assert scratch.tensors(DEV)[0] is not scratch.tensors(DEV)[0]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (graph capture)")
def test_fresh_while_a_cuda_graph_is_captured():
    scratch = Scratch(((4,), torch.float32))
    eager = scratch.tensors(DEV)[0]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            captured = scratch.tensors(DEV)[0]
    assert captured is not eager and captured is not scratch.tensors(DEV)[0]


def test_the_least_recently_used_sets_go_past_the_budget(monkeypatch):
    monkeypatch.setattr(triton_common, "SCRATCH_BUDGET", 2 * 16)
    monkeypatch.setattr(triton_common, "_SCRATCH_HELD", type(triton_common._SCRATCH_HELD)())
    a, b, c = (Scratch(((4,), torch.float32)) for _ in range(3))  # 16 bytes a set
    first_a = a.tensors(DEV)[0]
    b.tensors(DEV)
    assert a.tensors(DEV)[0] is first_a  # both fit; a is now the most recent
    c.tensors(DEV)  # over the budget: b, the least recently used, goes
    assert a.tensors(DEV)[0] is first_a and not b._sets and c._sets
    assert sum(triton_common._SCRATCH_HELD.values()) <= 2 * 16


def _sublayer(t, n, c, seed):
    """pre + combine forward and backward: outputs and every gradient."""
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    x = torch.randn(t, n, c, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    phi = (0.1 * torch.randn(m, n * c, generator=g)).to(DEV).requires_grad_()
    alpha = torch.full((3,), 0.5, device=DEV, requires_grad=True)
    bias = torch.randn(m, generator=g).to(DEV).requires_grad_()
    y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6)
    out = triton_mhc.combine(x, y * 1.5, None, h_res, h_post)
    out.float().square().sum().backward()
    return [v.detach().clone() for v in (y, h_pre, h_post, h_res, out, x.grad, phi.grad,
                                         alpha.grad, bias.grad)]


def _poison_reused_sets():
    """NaN into every reused temporary: a kernel that read an element its op did not write
    first would carry it into the results."""
    for entry in triton_common.PLANS.values():
        sets = [getattr(entry, "scratch", None), *getattr(entry, "_history", {}).values()]
        for scratch in sets:  # (pre backward's Sinkhorn history: a set per iteration count)
            for tensors in getattr(scratch, "_sets", {}).values():
                for t in tensors:
                    t.fill_(float("nan"))


@pytest.mark.parametrize("shape", [(13, 4, 24), (70, 4, 300), (40, 8, 40)],
                         ids=["one-split", "splits", "n8"])
def test_reused_temporaries_carry_nothing_over(monkeypatch, shape):
    """The same calls with reused and with fresh temporaries, the reused ones filled with NaN
    before every call and shared with calls on other inputs of the same shape: the same bits.
    The shapes split the projection, dH_pre and the dx pass over several programs (and pad
    the mapping columns) as the plans do."""
    monkeypatch.setattr(triton_common, "SCRATCH_LIMIT", 0)  # fresh every call
    triton_common.PLANS.clear()
    fresh = [_sublayer(*shape, seed) for seed in (0, 1)]
    monkeypatch.setattr(triton_common, "SCRATCH_LIMIT", 64 << 20)
    triton_common.PLANS.clear()
    for seed in (0, 1, 0, 1):
        _poison_reused_sets()
        for want, got in zip(fresh[seed], _sublayer(*shape, seed)):
            assert torch.equal(want, got)
    assert any(getattr(getattr(p, "scratch", None), "_sets", None)
               for p in triton_common.PLANS.values())  # the sets were reused
    assert any(s._sets for p in triton_common.PLANS.values()
               for s in getattr(p, "_history", {}).values())  # the history's too
