"""The spec helpers: layer classes, MoE patterns, final norm, clear errors."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from helpers import HAVE_TE, SEQ, batch, build_gpt, tiny_config
from mhc_megatron.layers import (
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
    StreamContractingNorm,
)
from mhc_megatron.specs import (
    get_gpt_decoder_block_with_mhc_spec,
    get_gpt_layer_with_mhc_local_spec,
    get_gpt_layer_with_mhc_te_spec,
    to_mhc_layer_spec,
)



def test_local_layer_spec():
    spec = get_gpt_layer_with_mhc_local_spec(num_experts=4)
    assert spec.module is HyperConnectionTransformerLayer
    assert isinstance(spec.submodules, HyperConnectionTransformerLayerSubmodules)
    assert to_mhc_layer_spec(spec) is spec  # idempotent


@pytest.mark.skipif(HAVE_TE, reason="checks the error raised when Transformer Engine is missing")
def test_te_spec_without_te_is_a_clear_error():
    with pytest.raises(ImportError, match=r"needs transformer_engine.*Fix: on a CUDA machine, "
                       r"install it with `pip install --no-build-isolation "
                       r"\"transformer_engine\[pytorch\]\"`.*NGC PyTorch container") as err:
        get_gpt_layer_with_mhc_te_spec()
    assert "mhc-megatron[te]" not in str(err.value)  # not on the package index
    with pytest.raises(ImportError, match="transformer_engine"):
        get_gpt_decoder_block_with_mhc_spec(tiny_config(), use_transformer_engine=True)


@pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine")
def test_te_spec_with_te():
    spec = get_gpt_layer_with_mhc_te_spec()
    assert spec.module is HyperConnectionTransformerLayer


def test_block_spec_follows_moe_layer_freq(megatron_single_rank):
    cfg = tiny_config(num_layers=4, num_moe_experts=4, moe_layer_freq=[1, 0, 0, 1],
                      moe_ffn_hidden_size=32, add_bias_linear=False)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    assert [s.module for s in block.layer_specs] == [HyperConnectionTransformerLayer] * 4
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe_flags = []
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        target = getattr(mlp, "module", getattr(mlp, "func", mlp))
        moe_flags.append(isinstance(target, type) and issubclass(target, MoELayer))
    assert moe_flags == [True, False, False, True]
    norm = block.layer_norm(config=cfg, hidden_size=cfg.hidden_size, eps=1e-5)
    assert isinstance(norm, StreamContractingNorm) and norm.n == cfg.num_residual_streams


def test_final_norm_contracts_by_sum_and_checks_width(megatron_single_rank):
    cfg = tiny_config(num_residual_streams=3)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    norm = block.layer_norm(config=cfg, hidden_size=cfg.hidden_size, eps=1e-5)
    assert norm.eps == 1e-5 and norm.norm.eps == pytest.approx(1e-5 / 9)  # eps / n^2 on the mean
    x = torch.randn(5, 2, 3 * cfg.hidden_size) * 1e-3  # small enough for eps to matter
    weight, bias = torch.rand(cfg.hidden_size) + 0.5, torch.randn(cfg.hidden_size)
    with torch.no_grad():
        norm.norm.weight.copy_(weight)
        norm.norm.bias.copy_(bias)
    expect = torch.nn.functional.layer_norm(x.view(5, 2, 3, cfg.hidden_size).sum(2),
                                            (cfg.hidden_size,), weight, bias, eps=1e-5)
    torch.testing.assert_close(norm(x), expect)
    with pytest.raises(ValueError, match="final norm expects the residual streams"):
        norm(torch.randn(5, 2, cfg.hidden_size))
    plain = block.layer_norm(config=tiny_config(enable_hyper_connections=False),
                             hidden_size=cfg.hidden_size, eps=1e-5)
    y = torch.randn(5, 2, cfg.hidden_size)
    torch.testing.assert_close(plain(y), plain.norm(y))


def test_unknown_layer_class_is_refused():
    class OtherLayer(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="only megatron.core TransformerLayer specs"):
        to_mhc_layer_spec(ModuleSpec(module=OtherLayer))


def test_cross_attention_is_refused(megatron_single_rank):
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_with_mhc_local_spec()
    spec.submodules.cross_attention = spec.submodules.self_attention
    with pytest.raises(ValueError, match="cross_attention is not supported"):
        build_module(spec, config=tiny_config(), layer_number=1)


def test_plain_layer_spec_is_megatron_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert get_gpt_layer_local_spec().module is TransformerLayer


def test_layer_spec_passed_as_model_spec_is_refused_at_build(seeded):
    """GPTModel turns a layer spec into a block with Megatron's plain final norm."""
    cfg = tiny_config()
    with pytest.raises(ValueError, match=r"a layer spec was given where a block spec is needed.*"
                       r"Fix: pass the decoder \*block\* spec, e\.g\. GPTModel\(config, "
                       r"get_gpt_decoder_block_with_mhc_spec\(config"):
        build_gpt(cfg, spec=get_gpt_layer_with_mhc_local_spec())


def test_hand_made_blocks_are_accepted(seeded, device):
    """Our layers in a block of the user's own making: contracting final norm, or none."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    cfg = tiny_config()
    layer = get_gpt_layer_with_mhc_local_spec()
    own = TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers,
                                     layer_norm=StreamContractingNorm.wrapping(WrappedTorchNorm))
    model = build_gpt(cfg, device, spec=own)
    assert isinstance(model.decoder.final_layernorm, StreamContractingNorm)
    ids, pos, mask, labels = batch(device=device)
    assert torch.isfinite(model(ids, pos, mask, labels=labels)).all()
    plain_norm = TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers,
                                            layer_norm=WrappedTorchNorm)
    block = TransformerBlock(cfg, plain_norm, post_layer_norm=False).to(device)  # -> streams
    x = torch.randn(SEQ, 2, cfg.hidden_size, device=device)
    assert block(x, attention_mask=mask).shape == (SEQ, 2, 4 * cfg.hidden_size)


def test_block_spec_with_plain_config_warns(seeded):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True)
    with pytest.warns(UserWarning, match="no hyper-connections. Fix: build the config with "
                      "mhc_megatron.config.MHCTransformerConfig"):
        build_gpt(cfg)


def test_sequence_parallel_with_torch_norms_is_a_clear_error_at_build(seeded):
    """Megatron's local norm refuses sequence parallelism with a bare assertion; an mHC layer
    built from the local spec by hand (no megatron.training) says what to do instead."""
    from megatron.core.transformer.spec_utils import build_module

    cfg = tiny_config()
    cfg.sequence_parallel = True  # as with TP > 1 (the config refuses SP at TP=1 when built)
    with pytest.raises(ValueError, match=r"sequence_parallel \(--sequence-parallel\) needs norms "
                       r"that support it.*WrappedTorchNorm.*Fix: install Transformer Engine"):
        build_module(get_gpt_layer_with_mhc_local_spec(normalization="RMSNorm"), config=cfg,
                     layer_number=1)
