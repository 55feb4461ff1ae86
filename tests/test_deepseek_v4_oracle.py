"""DeepSeek-V4's mHC conventions against an independent implementation: Hugging Face
transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4DecoderLayer`` (plain PyTorch;
transformers is a test-only dependency, in the ``test`` extra).

Our hyper-connection with ``mhc_mapping_form="deepseek_v4"`` and ``mhc_res_transposed=True``
holds the same parameters under other names (HF ``fn`` = our ``phi``, ``base`` = ``bias``,
``scale`` = ``alpha``: same shapes and row order), so the weights are copied as they are. The
mappings, the aggregate (HF's ``collapsed``) and the combine (HF's decoder layer:
``post * out + comb^T @ h``) must agree for fp64 and fp32 streams to fp32 rounding (HF's
mapping math is fp32 in both), forward and gradients (autograd on both sides).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the oracle is Hugging Face transformers (pip install -e .[test])")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
)

from helpers import tiny_config  # noqa: E402
from mhc_megatron.layers import HyperConnectionModule  # noqa: E402

B, S = 3, 5
# HF computes the mappings in fp32 whatever the streams' dtype (``.float()`` on the streams and
# on ``fn``); ours in fp64 for fp64 streams. So both dtypes compare at fp32 rounding of the
# mapping math (fp64 streams take the activations' own rounding out of the comparison):
# elementwise within RTOL, or within RTOL of the tensor's largest entry (a gradient summed
# over tokens can cancel to a small entry that keeps the rounding of its large terms).
RTOL = 2e-6


def _close(mine, other, name=""):
    torch.testing.assert_close(mine, other.to(mine.dtype), rtol=RTOL,
                               atol=RTOL * float(other.abs().max()),
                               msg=lambda m: f"{name}: {m}")


def _hf_config(n: int, c: int, iterations: int = 20, eps: float = 1e-6):
    return DeepseekV4Config(hidden_size=c, hc_mult=n, hc_sinkhorn_iters=iterations, hc_eps=eps,
                            rms_norm_eps=eps, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=1, vocab_size=64, intermediate_size=2 * c,
                            moe_intermediate_size=c, n_routed_experts=4, num_experts_per_tok=2)


def _our_config(n: int, c: int, dtype, iterations: int = 20, eps: float = 1e-6, **overrides):
    return tiny_config(hidden_size=c, num_residual_streams=n, params_dtype=dtype,
                       mhc_mapping_form="deepseek_v4", mhc_res_transposed=True,
                       mhc_mapping_eps=eps, mhc_rms_eps=eps, mhc_sinkhorn_iterations=iterations,
                       layernorm_epsilon=eps, normalization="RMSNorm", **overrides)


def _random_hc(n: int, c: int, dtype, seed: int):
    """HF's hyper-connection with random parameters of realistic size (``fn`` ~ N(0, 0.02),
    ``base`` ~ N(0, 1), ``scale`` ~ U(0.5, 1.5)), and ours with the same values."""
    g = torch.Generator().manual_seed(seed)
    theirs = hf.DeepseekV4HyperConnection(_hf_config(n, c)).to(dtype)
    ours = HyperConnectionModule(_our_config(n, c, dtype)).to(dtype)
    with torch.no_grad():
        theirs.fn.copy_(0.02 * torch.randn(theirs.fn.shape, generator=g, dtype=torch.float64))
        theirs.base.copy_(torch.randn(theirs.base.shape, generator=g, dtype=torch.float64))
        theirs.scale.copy_(0.5 + torch.rand(3, generator=g, dtype=torch.float64))
        ours.phi.copy_(theirs.fn)
        ours.bias.copy_(theirs.base)
        ours.alpha.copy_(theirs.scale)
    return theirs, ours


def _grads(tensors) -> list:
    return [t.grad for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n,c", [(4, 32), (2, 24), (3, 40)])
def test_hyper_connection_equals_hugging_face(seeded, dtype, n, c):
    """Mappings, aggregate and combine, forward and every gradient (streams, sublayer
    output, fn/phi, base/bias, scale/alpha), against HF's module and decoder-layer formula."""
    theirs, ours = _random_hc(n, c, dtype, seed=n * 100 + c)
    g = torch.Generator().manual_seed(7)
    h = torch.randn(B, S, n, c, generator=g, dtype=torch.float64).to(dtype)
    f = torch.randn(B, S, c, generator=g, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(B, S, n, c, generator=g, dtype=torch.float64).to(dtype)
    grad_y = torch.randn(B, S, c, generator=g, dtype=torch.float64).to(dtype)

    h_t, f_t = h.clone().requires_grad_(), f.clone().requires_grad_()
    post, comb, collapsed = theirs(h_t)
    out_t = post.unsqueeze(-1) * f_t.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), h_t)
    ((out_t * grad_out).sum() + (collapsed * grad_y).sum()).backward()

    h_o, f_o = h.clone().requires_grad_(), f.clone().requires_grad_()
    streams = h_o.reshape(B, S, n * c)  # [s, b, n*C] with s = B, b = S
    y, mappings = ours.pre(streams)
    out_o = ours.combine(streams, (f_o, None), mappings, 0.0, training=False).view(B, S, n, c)
    ((out_o * grad_out).sum() + (y * grad_y).sum()).backward()

    _close(y, collapsed, "aggregate")
    _close(mappings.h_post.view(B, S, n), post, "post")
    # our h_res is the matrix the streams are mixed with: HF's comb transposed
    _close(mappings.h_res.view(B, S, n, n), comb.transpose(-1, -2), "comb")
    _close(out_o, out_t, "combine")
    for name, mine, other in zip(("streams", "f", "fn", "base", "scale"),
                                 _grads([h_o, f_o, ours.phi, ours.bias, ours.alpha]),
                                 _grads([h_t, f_t, theirs.fn, theirs.base, theirs.scale])):
        _close(mine, other, f"grad of {name}")


def test_paper_form_differs_from_deepseek_v4(seeded):
    """The conventions matter: the paper's form (and H_res untransposed) with the same weights
    does not give HF's result, so the test above checks the DeepSeek-V4 conventions."""
    n, c = 4, 32
    theirs, ours = _random_hc(n, c, torch.float64, seed=1)
    paper = HyperConnectionModule(tiny_config(hidden_size=c, num_residual_streams=n,
                                              params_dtype=torch.float64)).double()
    paper.load_state_dict(ours.state_dict())
    h = torch.randn(B, S, n, c, dtype=torch.float64)
    post, comb, collapsed = theirs(h)
    y, mappings = paper.pre(h.reshape(B, S, n * c))
    assert not torch.allclose(y, collapsed, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(mappings.h_res.view(B, S, n, n), comb.transpose(-1, -2),
                              rtol=1e-6, atol=1e-9)


class _StandIn(torch.nn.Module):
    """A sublayer both sides run: ``tanh(x W)`` (attention) or ``silu(x W)`` (MLP), with
    Megatron's call signatures (``(out, bias)``) or Hugging Face's."""

    def __init__(self, weight: torch.Tensor, act, hf_style: str | None = None, **megatron_kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.act, self.hf_style = act, hf_style

    def forward(self, x, *args, **kwargs):
        out = self.act(x @ self.weight)
        if self.hf_style == "attention":
            return out, None
        if self.hf_style == "mlp":
            return out
        return out, None


def test_decoder_layer_residual_path_equals_hugging_face(seeded):
    """A decoder layer: HF's ``DeepseekV4DecoderLayer`` and our
    ``HyperConnectionTransformerLayer`` (Megatron's layer, local RMSNorm) with both sides'
    attention and MLP replaced by the same functions and the same norm and hyper-connection
    weights: the output streams and every gradient agree (fp64)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from mhc_megatron.specs import get_gpt_layer_with_mhc_local_spec

    n, c, dtype = 4, 32, torch.float64
    g = torch.Generator().manual_seed(11)
    w_attn = torch.randn(c, c, generator=g, dtype=dtype) / c**0.5
    w_mlp = torch.randn(c, c, generator=g, dtype=dtype) / c**0.5

    theirs = hf.DeepseekV4DecoderLayer(_hf_config(n, c), 0).to(dtype)
    theirs.self_attn = _StandIn(w_attn, torch.tanh, "attention")
    theirs.mlp = _StandIn(w_mlp, torch.nn.functional.silu, "mlp")

    cfg = _our_config(n, c, dtype, add_bias_linear=False)
    spec = get_gpt_layer_with_mhc_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention = ModuleSpec(module=_StandIn,
                                                params={"weight": w_attn, "act": torch.tanh})
    spec.submodules.mlp = ModuleSpec(module=_StandIn, params={
        "weight": w_mlp, "act": torch.nn.functional.silu})
    ours = build_module(spec, config=cfg, layer_number=2).to(dtype)

    with torch.no_grad():
        for mine, other in ((ours.self_attention_hyper_connection, theirs.attn_hc),
                            (ours.mlp_hyper_connection, theirs.ffn_hc)):
            other.fn.copy_(0.02 * torch.randn(other.fn.shape, generator=g, dtype=dtype))
            other.base.copy_(torch.randn(other.base.shape, generator=g, dtype=dtype))
            other.scale.copy_(0.5 + torch.rand(3, generator=g, dtype=dtype))
            mine.phi.copy_(other.fn)
            mine.bias.copy_(other.base)
            mine.alpha.copy_(other.scale)
        for mine, other in ((ours.input_layernorm, theirs.input_layernorm),
                            (ours.pre_mlp_layernorm, theirs.post_attention_layernorm)):
            other.weight.copy_(1 + 0.1 * torch.randn(c, generator=g, dtype=dtype))
            mine.weight.copy_(other.weight)

    h = torch.randn(B, S, n, c, generator=g, dtype=dtype)
    grad = torch.randn(B, S, n, c, generator=g, dtype=dtype)
    h_t, h_o = h.clone().requires_grad_(), h.clone().requires_grad_()
    out_t = theirs(h_t)
    (out_t * grad).sum().backward()
    out_o, _ = ours(h_o.view(B, S, n * c), attention_mask=None)
    (out_o.view(B, S, n, c) * grad).sum().backward()

    _close(out_o.view(B, S, n, c), out_t, "output streams")
    _close(h_o.grad, h_t.grad, "grad of the streams")
    pairs = {"attention": (ours.self_attention.weight, theirs.self_attn.weight),
             "mlp": (ours.mlp.weight, theirs.mlp.weight),
             "input norm": (ours.input_layernorm.weight, theirs.input_layernorm.weight),
             "mlp norm": (ours.pre_mlp_layernorm.weight, theirs.post_attention_layernorm.weight)}
    for sub, mine, other in (("attn", ours.self_attention_hyper_connection, theirs.attn_hc),
                             ("ffn", ours.mlp_hyper_connection, theirs.ffn_hc)):
        pairs.update({f"{sub} fn": (mine.phi, other.fn), f"{sub} base": (mine.bias, other.base),
                      f"{sub} scale": (mine.alpha, other.scale)})
    for name, (mine, other) in pairs.items():
        _close(mine.grad, other.grad, f"grad of {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n,c", [(4, 32), (3, 40)])
def test_output_head_and_final_norm_equal_hugging_face(seeded, dtype, n, c):
    """``mhc_output_head``: our final norm (the learned head, then Megatron's RMSNorm) ==
    HF's ``DeepseekV4HyperHead`` then its model norm, forward and every gradient (streams,
    ``hc_fn``/``phi``, ``hc_base``/``bias``, ``hc_scale``/``alpha``, the norm weight)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mhc_megatron.layers import StreamContractingNorm

    g = torch.Generator().manual_seed(n + c)
    hf_cfg = _hf_config(n, c)
    head = hf.DeepseekV4HyperHead(hf_cfg).to(dtype)
    hf_norm = hf.DeepseekV4RMSNorm(c, eps=hf_cfg.rms_norm_eps).to(dtype)
    ours = StreamContractingNorm(WrappedTorchNorm, config=_our_config(n, c, dtype,
                                                                      mhc_output_head=True),
                                 hidden_size=c, eps=hf_cfg.rms_norm_eps).to(dtype)
    with torch.no_grad():
        head.hc_fn.copy_(0.05 * torch.randn(head.hc_fn.shape, generator=g, dtype=torch.float64))
        head.hc_base.copy_(torch.randn(n, generator=g, dtype=torch.float64))
        head.hc_scale.copy_(0.5 + torch.rand(1, generator=g, dtype=torch.float64))
        hf_norm.weight.copy_(1 + 0.1 * torch.randn(c, generator=g, dtype=torch.float64))
        ours.head.phi.copy_(head.hc_fn)
        ours.head.bias.copy_(head.hc_base)
        ours.head.alpha.copy_(head.hc_scale)
        ours.norm.weight.copy_(hf_norm.weight)
    h = torch.randn(B, S, n, c, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(B, S, c, generator=g, dtype=torch.float64).to(dtype)
    h_t, h_o = h.clone().requires_grad_(), h.clone().requires_grad_()
    out_t = hf_norm(head(h_t))
    (out_t * grad).sum().backward()
    out_o = ours(h_o.view(B, S, n * c))
    (out_o * grad).sum().backward()
    _close(out_o, out_t, "head + norm")
    for name, mine, other in (("streams", h_o, h_t), ("fn", ours.head.phi, head.hc_fn),
                              ("base", ours.head.bias, head.hc_base),
                              ("scale", ours.head.alpha, head.hc_scale),
                              ("norm", ours.norm.weight, hf_norm.weight)):
        _close(mine.grad, other.grad, f"grad of {name}")
