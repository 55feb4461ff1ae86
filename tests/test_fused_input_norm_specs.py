"""``mhc_fuse_input_norm``: the specs that move each sublayer's input RMSNorm into its
hyper-connection module, the checkpoint keys of the moved weight, and the refusals.

The spec rewrite is checked for Megatron's local specs (dense, MoE, MLA) here and for its
Transformer Engine specs where TE is installed. The model tests build a small GPT with the local
spec unfused and fused: the fused model's ``norm_weight``s take the unfused model's norm weights
from its distributed checkpoint (same keys), and both give the same logits.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from helpers import HAVE_TE, batch, build_gpt, moe_overrides, tiny_config
from mhc_megatron.layers import HyperConnectionTransformerLayer
from mhc_megatron.layers.hyper_connection import HyperConnectionModule
from mhc_megatron.specs import (
    fuses_input_norm,
    get_gpt_decoder_block_with_mhc_spec,
    get_gpt_layer_with_mhc_local_spec,
    get_gpt_layer_with_mhc_te_spec,
    to_mhc_layer_spec,
    with_mhc_block_spec,
)

ATTN_KEY = "self_attention_hyper_connection.norm_weight"
MLP_KEY = "mlp_hyper_connection.norm_weight"
# Megatron's local (non-MLA) spec writes its norms under TE's keys (its own keys map)
LOCAL_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Megatron puts RoPE there


def _fused_config(**overrides):
    return tiny_config(normalization="RMSNorm", mhc_fuse_input_norm=True, **overrides)


def _mlp_submodules(spec):
    mlp = spec.submodules.mlp
    return mlp.submodules if isinstance(mlp, ModuleSpec) else mlp.keywords["submodules"]


def _assert_fused_hyper_connections(spec):
    for name in ("self_attention_hyper_connection", "mlp_hyper_connection"):
        hc = getattr(spec.submodules, name)
        assert isinstance(hc, ModuleSpec) and hc.module is HyperConnectionModule, name
        assert hc.params == {"fuse_input_norm": True}, name
    assert fuses_input_norm(spec)


# ---------------------------------------------------------------------------- spec rewrite


def test_unfused_spec_is_unchanged():
    spec = get_gpt_layer_with_mhc_local_spec()
    assert spec.submodules.self_attention_hyper_connection is HyperConnectionModule
    assert spec.submodules.input_layernorm is not IdentityOp and not fuses_input_norm(spec)
    assert spec.submodules.sharded_state_dict_keys_map == LOCAL_MAP


def test_dense_local_spec():
    """Separate norm modules -> IdentityOp; keys through the local spec's own map."""
    megatron_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    norm = megatron_spec.submodules.input_layernorm
    spec = to_mhc_layer_spec(megatron_spec, fuse_input_norm=True)
    sub = spec.submodules
    assert spec.module is HyperConnectionTransformerLayer
    assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp
    assert sub.self_attention is megatron_spec.submodules.self_attention  # linear_qkv unchanged
    _assert_fused_hyper_connections(spec)
    assert sub.sharded_state_dict_keys_map == {
        ATTN_KEY: "self_attention.linear_qkv.layer_norm_weight",
        MLP_KEY: "mlp.linear_fc1.layer_norm_weight", **LOCAL_MAP}
    assert list(sub.sharded_state_dict_keys_map)[:2] == [ATTN_KEY, MLP_KEY]  # first match wins
    # Megatron's spec object is left as it was (block specs share it between layers)
    assert megatron_spec.module is not HyperConnectionTransformerLayer
    assert megatron_spec.submodules.input_layernorm is norm
    assert megatron_spec.submodules.pre_mlp_layernorm is norm
    assert megatron_spec.submodules.sharded_state_dict_keys_map == LOCAL_MAP
    assert get_gpt_layer_with_mhc_local_spec(fuse_input_norm=True).submodules \
        .sharded_state_dict_keys_map == sub.sharded_state_dict_keys_map


def test_moe_local_spec():
    """MoE: the pre-MLP norm is a separate module (the experts' linears have none). Megatron's
    local spec maps it to the dense TE key even for MoE layers, and so do we."""
    spec = get_gpt_layer_with_mhc_local_spec(num_experts=4, fuse_input_norm=True)
    sub = spec.submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert sub.mlp.func is MoELayer  # the MoE builder itself is Megatron's
    assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp
    _assert_fused_hyper_connections(spec)
    keys = sub.sharded_state_dict_keys_map
    assert keys[ATTN_KEY] == "self_attention.linear_qkv.layer_norm_weight"
    assert keys[MLP_KEY] == "mlp.linear_fc1.layer_norm_weight"


@pytest.mark.parametrize("num_experts", [None, 4])
def test_mla_local_spec(num_experts):
    """MLA: input_layernorm is the attention's input norm; its q/kv layernorms stay."""
    megatron_spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, multi_latent_attention=True, qk_layernorm=True,
        normalization="RMSNorm")
    spec = to_mhc_layer_spec(megatron_spec, fuse_input_norm=True)
    sub = spec.submodules
    assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp
    attn = sub.self_attention.submodules
    assert attn is megatron_spec.submodules.self_attention.submodules
    assert attn.q_layernorm is not IdentityOp and attn.kv_layernorm is not IdentityOp
    _assert_fused_hyper_connections(spec)
    assert sub.sharded_state_dict_keys_map == {ATTN_KEY: "input_layernorm.weight",
                                               MLP_KEY: "pre_mlp_layernorm.weight"}


def test_fusing_is_idempotent_and_never_undone():
    unfused = get_gpt_layer_with_mhc_local_spec()
    fused = to_mhc_layer_spec(unfused, fuse_input_norm=True)  # an mHC spec can be fused
    assert fuses_input_norm(fused) and not fuses_input_norm(unfused)
    assert unfused.submodules.input_layernorm is not IdentityOp  # not modified
    assert to_mhc_layer_spec(fused, fuse_input_norm=True) is fused
    assert to_mhc_layer_spec(fused) is fused


def test_block_specs_follow_the_config(megatron_single_rank):
    """get_gpt_decoder_block_with_mhc_spec fuses with mhc_fuse_input_norm, and only with mHC
    on (without mHC the layers are Megatron's own, which need their norms)."""
    cfg = _fused_config(num_layers=4, moe_layer_freq=[1, 0, 0, 1], **moe_overrides())
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    assert all(fuses_input_norm(s) for s in block.layer_specs)
    off = get_gpt_decoder_block_with_mhc_spec(
        _fused_config(enable_hyper_connections=False), use_transformer_engine=False)
    assert not any(fuses_input_norm(s) for s in off.layer_specs)
    plain = gpt_layer_specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    fused = with_mhc_block_spec(plain, fuse_input_norm=True)
    assert all(fuses_input_norm(s) for s in fused.layer_specs)
    assert not any(fuses_input_norm(s) for s in with_mhc_block_spec(plain).layer_specs)
    assert all(s.module is not HyperConnectionTransformerLayer for s in plain.layer_specs)


def test_mtp_inner_layer_is_fused_with_the_decoder(megatron_single_rank):
    from mhc_megatron.specs import get_gpt_mtp_block_with_mhc_spec

    cfg = _fused_config(mtp_num_layers=1)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_with_mhc_spec(cfg, block, use_transformer_engine=False)
    inner = mtp.layer_specs[0].submodules.mtp_model_layer
    assert inner.module is HyperConnectionTransformerLayer and fuses_input_norm(inner)


class TELayerNormColumnParallelLinear:  # the name of TE's norm-fused linear, not the class
    pass


class KitchenLayerNormColumnParallelLinear:
    pass


def _te_layer_norm_linear():
    """TE's norm-fused linear with TE, else the stand-in of that name."""
    if not HAVE_TE:
        return TELayerNormColumnParallelLinear
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear as cls

    return cls


def _with_attention_linear(spec, linear, input_layernorm=IdentityOp):
    import dataclasses

    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                   linear_qkv=linear))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=attn, input_layernorm=input_layernorm))


@pytest.mark.skipif(HAVE_TE, reason="without TE, TE's norm-fused linear is found by name")
def test_te_norm_linear_is_found_by_name_without_te():
    """The TE branch of the rewrite on CPU: linear_qkv of that name -> TEColumnParallelLinear
    (Megatron's name; a stand-in without TE), the key TE's layer writes."""
    from megatron.core.extensions import transformer_engine as te_ext

    spec = _with_attention_linear(gpt_layer_specs.get_gpt_layer_local_spec(),
                                  TELayerNormColumnParallelLinear)
    fused = to_mhc_layer_spec(spec, fuse_input_norm=True)
    assert fused.submodules.self_attention.submodules.linear_qkv is te_ext.TEColumnParallelLinear
    assert spec.submodules.self_attention.submodules.linear_qkv is \
        TELayerNormColumnParallelLinear  # not modified
    assert fused.submodules.sharded_state_dict_keys_map[ATTN_KEY] == \
        "self_attention.linear_qkv.layer_norm_weight"


@pytest.mark.skipif(HAVE_TE, reason="without TE, TE's norm-fused linear is found by name")
def test_mla_fused_down_projection_key_goes_through_the_spec_map():
    """As Megatron's TE spec with mla_down_proj_fusion: the norm sits in linear_qkv_down_proj
    and the spec maps its key to input_layernorm's, so the moved weight gets that key."""
    import dataclasses

    from megatron.core.extensions import transformer_engine as te_ext

    mla = gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True)
    attn = mla.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, linear_qkv_down_proj=TELayerNormColumnParallelLinear))
    spec = dataclasses.replace(mla, submodules=dataclasses.replace(
        mla.submodules, self_attention=attn, input_layernorm=IdentityOp,
        sharded_state_dict_keys_map={
            "self_attention.linear_qkv_down_proj.layer_norm_": "input_layernorm."}))
    fused = to_mhc_layer_spec(spec, fuse_input_norm=True)
    assert fused.submodules.self_attention.submodules.linear_qkv_down_proj is \
        te_ext.TEColumnParallelLinear
    assert fused.submodules.sharded_state_dict_keys_map[ATTN_KEY] == "input_layernorm.weight"


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("case", ["no_norm", "two_norms", "other_norm_linear"])
def test_spec_without_a_single_movable_norm_is_refused(case):
    local = gpt_layer_specs.get_gpt_layer_local_spec()
    if case == "no_norm":
        spec, match = _with_attention_linear(local, local.submodules.self_attention.submodules
                                             .linear_qkv), "has no input norm"
    elif case == "two_norms":  # TE's norm-fused linear (or its stand-in) and a norm module
        spec = _with_attention_linear(local, _te_layer_norm_linear(),
                                      input_layernorm=local.submodules.input_layernorm)
        match = "has two input norms"
    else:
        spec = _with_attention_linear(local, KitchenLayerNormColumnParallelLinear)
        match = "KitchenLayerNormColumnParallelLinear, a linear layer with the input norm"
    with pytest.raises(ValueError, match=rf"fuse_input_norm: .*{match}.*Fix: use "
                       r"fuse_input_norm=False"):
        to_mhc_layer_spec(spec, fuse_input_norm=True)
    assert not fuses_input_norm(to_mhc_layer_spec(spec))  # unfused: accepted as before


def test_te_fused_mlp_is_refused():
    """TE's op-fuser MLP (use_te_op_fuser) takes its norm from its linear_fc1 (found by class
    name, so this runs without TE too)."""
    import dataclasses
    import functools

    from megatron.core.transformer.mlp import MLPSubmodules

    class TEFusedMLP:
        @classmethod
        def as_mlp_submodule(cls, **kwargs):
            raise AssertionError("not built here")

    local = gpt_layer_specs.get_gpt_layer_local_spec()
    mlp = functools.partial(TEFusedMLP.as_mlp_submodule, submodules=MLPSubmodules(
        linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=None))
    spec = dataclasses.replace(local, submodules=dataclasses.replace(local.submodules, mlp=mlp))
    with pytest.raises(ValueError, match=r"fuse_input_norm: the MLP is Transformer Engine's "
                       r"TEFusedMLP .*Fix: build the spec with use_te_op_fuser=False"):
        to_mhc_layer_spec(spec, fuse_input_norm=True)


FIX = (r"Fix: build the spec with get_gpt_decoder_block_with_mhc_spec\(config, \.\.\.\) or "
       r"to_mhc_layer_spec\(spec, fuse_input_norm=True\)")


def test_fused_config_with_unfused_spec_is_refused(seeded):
    """The sublayers would normalise twice: refused when the layer is built."""
    unfused = get_gpt_decoder_block_with_mhc_spec(tiny_config(normalization="RMSNorm"),
                                                  use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"mhc_fuse_input_norm=True .* still has the "
                       r"sublayers' own input norms \(input_layernorm, pre_mlp_layernorm\), so "
                       r"they would normalise twice.*" + FIX):
        build_gpt(_fused_config(), spec=unfused)


def test_fused_config_with_unfused_hyper_connections_is_refused(seeded):
    """A spec without input norms whose hyper-connection modules were not built with
    fuse_input_norm=True: their norm weights would miss Megatron's checkpoint keys."""
    import dataclasses

    cfg = _fused_config()
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    block.layer_specs = [dataclasses.replace(s, submodules=dataclasses.replace(
        s.submodules, self_attention_hyper_connection=HyperConnectionModule))
        for s in block.layer_specs]
    with pytest.raises(ValueError, match=r"builds self_attention_hyper_connection without "
                       r"fuse_input_norm=True, so the checkpoint keys .*" + FIX):
        build_gpt(cfg, spec=block)


def test_fused_spec_without_mhc_is_refused(seeded):
    """With mHC off no hyper-connection module is built, so no input norm would run."""
    cfg = _fused_config()
    fused = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"built with fuse_input_norm=True .*without an input "
                       r"norm. Fix: "):
        build_gpt(_fused_config(enable_hyper_connections=False), spec=fused)


# ---------------------------------------------------------------------------- TE specs


def test_te_specs():
    """Dense: TE's norm-fused linears lose the norm; MoE and MLA: the separate norm modules
    go; MLA with mla_down_proj_fusion: the fused down projection loses it."""
    pytest.importorskip("transformer_engine")
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear as TELNLinear,
    )

    dense = get_gpt_layer_with_mhc_te_spec(fuse_input_norm=True)
    assert dense.submodules.self_attention.submodules.linear_qkv is TEColumnParallelLinear
    assert _mlp_submodules(dense).linear_fc1 is TEColumnParallelLinear
    _assert_fused_hyper_connections(dense)
    keys = dense.submodules.sharded_state_dict_keys_map
    assert keys[ATTN_KEY] == "self_attention.linear_qkv.layer_norm_weight"
    assert keys[MLP_KEY] == "mlp.linear_fc1.layer_norm_weight"
    megatron_dense = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    assert megatron_dense.submodules.self_attention.submodules.linear_qkv is TELNLinear

    moe = get_gpt_layer_with_mhc_te_spec(num_experts=4, fuse_input_norm=True)
    assert moe.submodules.self_attention.submodules.linear_qkv is TEColumnParallelLinear
    assert moe.submodules.pre_mlp_layernorm is IdentityOp
    assert moe.submodules.sharded_state_dict_keys_map[MLP_KEY] == "pre_mlp_layernorm.weight"

    mla = get_gpt_layer_with_mhc_te_spec(multi_latent_attention=True, fuse_input_norm=True)
    assert mla.submodules.input_layernorm is IdentityOp
    assert _mlp_submodules(mla).linear_fc1 is TEColumnParallelLinear
    assert mla.submodules.sharded_state_dict_keys_map[ATTN_KEY] == "input_layernorm.weight"

    down = get_gpt_layer_with_mhc_te_spec(multi_latent_attention=True,
                                          mla_down_proj_fusion=True, fuse_input_norm=True)
    assert down.submodules.self_attention.submodules.linear_qkv_down_proj is \
        TEColumnParallelLinear
    # Megatron maps the down projection's norm to input_layernorm's key
    assert down.submodules.sharded_state_dict_keys_map[ATTN_KEY] == "input_layernorm.weight"

    with pytest.raises(ValueError, match="TEFusedMLP .*Fix: build the spec with "
                       "use_te_op_fuser=False"):
        get_gpt_layer_with_mhc_te_spec(use_te_op_fuser=True, fuse_input_norm=True)


# ---------------------------------------------------------------------------- models


def _sharded_keys(model) -> set[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.key for v in nested_values(model.sharded_state_dict())}


def _unfused_and_fused(kind: str):
    """The same tiny GPT (same seed, local spec) unfused and fused; the unfused one with
    non-trivial input-norm weights, so that moving them is seen."""
    from mhc_megatron.testing.cpu import setup_cpu_megatron

    extra = moe_overrides() if kind == "moe" else {}
    setup_cpu_megatron(seed=1234)
    unfused = build_gpt(tiny_config(normalization="RMSNorm", **extra), DEV)
    setup_cpu_megatron(seed=1234)
    fused = build_gpt(_fused_config(**extra), DEV)
    with torch.no_grad():
        for name, p in unfused.named_parameters():
            if "layernorm" in name and "final" not in name:
                p.copy_(torch.rand_like(p) + 0.5)
    return unfused, fused


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_checkpoint_moves_norm_weights_between_unfused_and_fused(seeded, tmp_path, kind):
    """Megatron's distributed checkpoint of the unfused model loads into the fused one: the
    same keys, and each norm_weight takes its sublayer's norm weight."""
    from megatron.core import dist_checkpointing

    unfused, fused = _unfused_and_fused(kind)
    assert _sharded_keys(unfused) == _sharded_keys(fused)
    dist_checkpointing.save(unfused.sharded_state_dict(), str(tmp_path))
    fused.load_state_dict(dist_checkpointing.load(fused.sharded_state_dict(), str(tmp_path)))
    for i, layer in enumerate(fused.decoder.layers):
        source = unfused.decoder.layers[i]
        assert isinstance(layer.input_layernorm, IdentityOp)
        torch.testing.assert_close(layer.self_attention_hyper_connection.norm_weight,
                                   source.input_layernorm.weight, rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp_hyper_connection.norm_weight,
                                   source.pre_mlp_layernorm.weight, rtol=0, atol=0)
    unfused_params = dict(unfused.named_parameters())
    for name, p in fused.named_parameters():  # everything else is the unfused model's
        if "norm_weight" not in name:
            torch.testing.assert_close(p, unfused_params[name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fused_forward_matches_unfused(seeded, tmp_path, kind):
    """The fused model, with the unfused model's weights, gives its logits (fp32, reference
    kernels): the norm in the mHC pre is the sublayer's RMSNorm."""
    from megatron.core import dist_checkpointing

    unfused, fused = _unfused_and_fused(kind)
    dist_checkpointing.save(unfused.sharded_state_dict(), str(tmp_path))
    fused.load_state_dict(dist_checkpointing.load(fused.sharded_state_dict(), str(tmp_path)))
    ids, pos, mask, _ = batch(seed=7, device=DEV)
    unfused.eval()
    fused.eval()
    with torch.no_grad():
        expected = unfused(ids, pos, mask)
        got = fused(ids, pos, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
