"""HyperConnectionTransformerLayer wiring against Megatron's TransformerLayer and the
reference math."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from helpers import SPEC_FAMILIES, tiny_config
from mhc_megatron.kernels import reference as ref
from mhc_megatron.layers import HyperConnectionModule, HyperConnectionTransformerLayer
from mhc_megatron.specs import get_gpt_layer_with_mhc_local_spec, get_gpt_layer_with_mhc_te_spec
from mhc_testing.cpu import setup_cpu_megatron

S, B = 8, 2


def _mask(device, s=S):
    return torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]


def _layer(config, layer_number, device, mhc=True, spec_family="local"):
    if spec_family == "te":
        spec = get_gpt_layer_with_mhc_te_spec() if mhc else get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_with_mhc_local_spec() if mhc else get_gpt_layer_local_spec()
    return build_module(spec, config=config, layer_number=layer_number).to(device)


def _force_unit_mappings(layer):
    """alpha = 0, H_pre = sigmoid(40) == 1.0 in fp32, H_post = 2*sigmoid(0) = 1 (n = 1)."""
    with torch.no_grad():
        for hc in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
            assert hc.n == 1
            hc.alpha.zero_()
            hc.bias[0] = 40.0
            hc.bias[1] = 0.0


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("layer_number", [1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_n1_unit_mappings_equal_plain_layer(seeded, device, layer_number, dropout, spec_family):
    """n=1 with unit mappings == Megatron's own layer of the same spec family (local or TE)."""
    cfg = tiny_config(num_residual_streams=1, hidden_dropout=dropout, attention_dropout=dropout)
    mhc = _layer(cfg, layer_number, device, spec_family=spec_family)
    plain = _layer(cfg, layer_number, device, mhc=False, spec_family=spec_family)
    assert type(plain).__name__ == "TransformerLayer"
    missing, unexpected = plain.load_state_dict(mhc.state_dict(), strict=False)
    assert not missing and all("hyper_connection" in k for k in unexpected) and unexpected
    _force_unit_mappings(mhc)
    mhc.train()
    plain.train()

    x = torch.randn(S, B, cfg.hidden_size, device=device)
    x_mhc = x.clone().requires_grad_()
    x_plain = x.clone().requires_grad_()
    # Same RNG state (incl. Megatron's CUDA RNG tracker on GPU) -> same dropout masks.
    setup_cpu_megatron(seed=7)
    out_mhc, _ = mhc(x_mhc, attention_mask=_mask(device))
    setup_cpu_megatron(seed=7)
    out_plain, _ = plain(x_plain, attention_mask=_mask(device))
    torch.testing.assert_close(out_mhc, out_plain, rtol=1e-6, atol=1e-6)

    g = torch.randn_like(out_plain)
    out_mhc.backward(g)
    out_plain.backward(g)
    torch.testing.assert_close(x_mhc.grad, x_plain.grad, rtol=1e-5, atol=1e-6)
    plain_params = dict(plain.named_parameters())
    for name, p in mhc.named_parameters():
        if "hyper_connection" in name:
            continue
        torch.testing.assert_close(p.grad, plain_params[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("n,layer_number,add_bias", [(4, 2, True), (4, 1, False), (3, 2, False)])
def test_layer_equals_reference_composition(seeded, device, n, layer_number, add_bias,
                                            spec_family):
    """Layer output == reference ops composed by hand around the layer's own submodules.

    With the TE spec the input norm is fused into ``linear_qkv`` (``input_layernorm`` is an
    identity), so the same composition covers it.
    """
    cfg = tiny_config(num_residual_streams=n, add_bias_linear=add_bias)
    layer = _layer(cfg, layer_number, device, spec_family=spec_family).eval()
    c = cfg.hidden_size
    width = c if layer_number == 1 else n * c
    x = torch.randn(S, B, width, device=device)
    out, _ = layer(x, attention_mask=_mask(device))

    streams = x.unsqueeze(2).expand(S, B, n, c).reshape(S, B, n * c) if layer_number == 1 else x

    def sublayer(streams, hc, run):
        flat = streams.reshape(-1, n, c)
        h_pre, h_post, h_res = ref.compute_mappings(
            flat, hc.phi, hc.alpha, hc.bias, cfg.mhc_sinkhorn_iterations, cfg.mhc_rms_eps)
        y = ref.aggregate(flat, h_pre).view(S, B, c)
        f, f_bias = run(y)
        return ref.expand_combine(flat, f.reshape(-1, c), f_bias, h_res, h_post).view(S, B, n * c)

    with torch.no_grad():
        mid = sublayer(streams, layer.self_attention_hyper_connection,
                       lambda y: layer.self_attention(layer.input_layernorm(y),
                                                      attention_mask=_mask(device)))
        expect = sublayer(mid, layer.mlp_hyper_connection,
                          lambda y: layer.mlp(layer.pre_mlp_layernorm(y)))
    assert out.shape == (S, B, n * c)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_disabled_is_megatron_layer(seeded, device):
    cfg = tiny_config(enable_hyper_connections=False)
    layer = _layer(cfg, 2, device)
    assert not any("hyper_connection" in k for k in layer.state_dict())
    plain = _layer(cfg, 2, device, mhc=False)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(S, B, cfg.hidden_size, device=device)
    mask = _mask(device)
    torch.testing.assert_close(layer(x, attention_mask=mask)[0], plain(x, attention_mask=mask)[0])


def test_plain_transformer_config_builds_a_plain_layer_with_a_warning(seeded, device):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True)
    with pytest.warns(UserWarning, match=r"plain TransformerConfig: it runs as Megatron's "
                      r"TransformerLayer, with no hyper-connections\. Fix: .*MHCTransformerConfig"
                      r"\(enable_hyper_connections=True"):
        layer = _layer(cfg, 1, device)
    assert isinstance(layer, HyperConnectionTransformerLayer) and not layer.mhc_enabled


def test_mhc_config_switched_off_says_so_once(seeded, device, caplog, monkeypatch):
    from mhc_megatron.layers import transformer_layer

    monkeypatch.setattr(transformer_layer, "_said_mhc_off", False)
    cfg = tiny_config(enable_hyper_connections=False)
    with caplog.at_level("INFO", logger="mhc_megatron"):
        for number in (1, 2):
            _layer(cfg, number, device)
    said = [r.getMessage() for r in caplog.records if "enable_hyper_connections=False" in r.getMessage()]
    assert len(said) == 1 and "build Megatron's plain layers" in said[0]


def test_wrong_stream_width_is_a_clear_error(seeded, device):
    cfg = tiny_config()
    mask = _mask(device)
    with pytest.raises(ValueError, match=r"residual streams \[s, b, n\*C\].*decoder block spec"):
        _layer(cfg, 2, device)(torch.randn(S, B, cfg.hidden_size, device=device), attention_mask=mask)
    with pytest.raises(ValueError, match=r"layer 1 of an mHC decoder expects the embeddings "
                       r"\[s, b, 32\].*got \(8, 2, 128\)\. Fix: feed layer 1 hidden states of "
                       r"width hidden_size=32"):
        _layer(cfg, 1, device)(torch.randn(S, B, 4 * cfg.hidden_size, device=device),
                               attention_mask=mask)


@pytest.mark.parametrize("sp", [False, True])
def test_mapping_params_tagged_for_sequence_parallel(seeded, sp):
    cfg = tiny_config(sequence_parallel=sp, tensor_model_parallel_size=2)
    hc = HyperConnectionModule(cfg)
    m = ref.num_mapping_coefficients(cfg.num_residual_streams)
    assert hc.phi.shape == (m, cfg.num_residual_streams * cfg.hidden_size)
    assert hc.alpha.shape == (3,) and hc.bias.shape == (m,)
    for p in hc.parameters():
        assert p.sequence_parallel is sp
    torch.testing.assert_close(hc.alpha, torch.full((3,), cfg.mhc_init_gating_factor))


def test_every_layer_has_same_parameter_shapes(seeded):
    """sharded_state_dict stacks layers per name: layer 1 must not own extra parameters."""
    cfg = tiny_config()
    shapes = [{k: tuple(p.shape) for k, p in _layer(cfg, i, "cpu").named_parameters()}
              for i in (1, 2)]
    assert shapes[0] == shapes[1]
