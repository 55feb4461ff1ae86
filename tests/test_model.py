"""GPTModel built from the mHC block spec: fwd/bwd, grads, training, checkpoints."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    SEQ,
    SPEC_FAMILIES,
    VOCAB,
    assert_loads_to,
    batch,
    build_gpt,
    lm_loss,
    moe_overrides,
    tiny_config,
)
from mhc_megatron.config import MHCMLATransformerConfig
from mhc_megatron.layers import HyperConnectionTransformerLayer, StreamContractingNorm
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
from mhc_testing.attention import SDPACoreAttention

MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)


def _config(kind: str, **kw):
    if kind == "dense":
        return tiny_config(**kw)
    if kind == "moe":
        return tiny_config(**moe_overrides(), **kw)
    if kind == "mla_moe":
        base = vars(tiny_config()).copy()
        keep = {k: base[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                     "ffn_hidden_size", "use_cpu_initialization", "params_dtype",
                                     "hidden_dropout", "attention_dropout",
                                     "enable_hyper_connections", "mhc_kernel_backend")}
        return MHCMLATransformerConfig(**{**keep, **MLA, **moe_overrides(), **kw})
    raise ValueError(kind)


def _build(kind, device, spec_family="local", **kw):
    cfg = _config(kind, **kw)
    te = spec_family == "te"
    spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=te)
    if cfg.multi_latent_attention and not te:  # with TE, MLA runs TE's own attention
        # Megatron's local DotProductAttention cannot serve MLA (k/v head dims differ).
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return cfg, build_gpt(cfg, device, spec=spec)


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("kind", ["dense", "moe", "mla_moe"])
def test_forward_backward_every_parameter_gets_a_grad(seeded, device, kind, spec_family):
    cfg, model = _build(kind, device, spec_family)
    layers = model.decoder.layers
    assert all(isinstance(layer, HyperConnectionTransformerLayer) for layer in layers)
    assert isinstance(model.decoder.final_layernorm, StreamContractingNorm)
    if kind != "dense":
        assert all(layer.is_moe_layer for layer in layers)
    loss = lm_loss(model, batch(device=device))
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
    for name, p in model.named_parameters():
        if "hyper_connection" in name:
            assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("kind", ["dense", "moe", "mla_moe"])
def test_loss_decreases_with_training(seeded, device, kind, spec_family):
    cfg, model = _build(kind, device, spec_family)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batch(batch_size=4, device=device, seed=1)
    hc_before = {n: p.detach().clone() for n, p in model.named_parameters() if "hyper" in n}
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = lm_loss(model, data)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    for n, p in model.named_parameters():
        if n in hc_before:
            assert not torch.equal(p.detach(), hc_before[n]), f"{n} did not train"


def test_streams_shape_through_the_decoder(seeded, device):
    cfg, model = _build("dense", device)
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(o[0].shape))
             for layer in model.decoder.layers]
    lm_loss(model, batch(device=device))
    for h in hooks:
        h.remove()
    assert seen == [(SEQ, 2, cfg.num_residual_streams * cfg.hidden_size)] * cfg.num_layers


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("kind", ["dense", "mla_moe"])
@pytest.mark.parametrize("mhc_params_dtype", [torch.float32, None])
def test_bf16_model(seeded, device, kind, spec_family, mhc_params_dtype):
    """Megatron's Float16Module makes weights and activations bf16; the mapping parameters
    (and their grads) stay in mhc_params_dtype (fp32 by default), or follow params_dtype."""
    from megatron.core.transformer.module import Float16Module

    cfg, model = _build(kind, device, spec_family, bf16=True, params_dtype=torch.bfloat16,
                        mhc_params_dtype=mhc_params_dtype)
    model = Float16Module(cfg, model)
    loss = lm_loss(model, batch(device=device))
    loss.backward()
    assert torch.isfinite(loss)
    hc_dtype = mhc_params_dtype or torch.bfloat16
    for name, p in model.named_parameters():
        want = hc_dtype if "hyper_connection" in name else torch.bfloat16
        assert p.dtype == want and p.grad.dtype == want, (name, p.dtype, p.grad.dtype)
        assert torch.isfinite(p.grad).all(), name
    model.to(device)  # a device move keeps the pinned dtype
    assert model.module.decoder.layers[1].mlp_hyper_connection.phi.dtype == hc_dtype


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
def test_dist_checkpoint_round_trip(seeded, device, tmp_path, spec_family):
    from megatron.core import dist_checkpointing

    cfg, model = _build("moe", device, spec_family)
    data = batch(device=device, seed=3)
    model.eval()
    with torch.no_grad():
        expected = model(*data[:3])
    sharded = model.sharded_state_dict()
    assert any("hyper_connection" in k for k in sharded)
    dist_checkpointing.save(sharded, str(tmp_path))

    torch.manual_seed(999)
    _, fresh = _build("moe", device, spec_family)
    assert_loads_to(fresh.eval(), tmp_path, data, expected)


def test_plain_state_dict_round_trip(seeded, device):
    cfg, model = _build("dense", device)
    data = batch(device=device, seed=4)
    model.eval()
    torch.manual_seed(5)
    _, other = _build("dense", device)
    other.load_state_dict(model.state_dict())
    other.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(*data[:3]), model(*data[:3]), rtol=0, atol=0)


def test_vocab_and_layers_are_as_configured(seeded, device):
    cfg, model = _build("dense", device)
    assert model.vocab_size == VOCAB and len(model.decoder.layers) == cfg.num_layers


@pytest.mark.parametrize("static,diag", [("zero", 0.95), ("residual", 0.5)])
def test_static_mapping_init_reaches_every_layer(seeded, static, diag):
    """The config's initial static mapping is what every hyper-connection's bias holds."""
    from mhc_megatron.layers.hyper_connection import initial_mapping_bias

    model = build_gpt(tiny_config(mhc_init_static_mapping=static, mhc_init_res_diagonal=diag))
    expect = initial_mapping_bias(4, static, diag)
    biases = [m.bias for n, m in model.named_modules() if n.endswith("hyper_connection")]
    assert len(biases) == 4 and all(torch.equal(b.detach(), expect) for b in biases)
