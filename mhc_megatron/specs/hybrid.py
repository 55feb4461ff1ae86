"""HybridStack specs with mHC for Megatron-Core's ``HybridModel``.

``HybridModel(config, get_hybrid_stack_with_mhc_spec(config, use_transformer_engine=...),
vocab_size, max_sequence_length, hybrid_layer_pattern="*-*-", ...)``: every layer of the
pattern (one residual sublayer each) gets its own hyper-connection, the stack's first layer
expands the embeddings into the n streams ``[s, b, n*C]`` and its final norm contracts them
(:mod:`mhc_megatron.layers.hybrid`). Pipeline stages (``|``), virtual stages and
multi-token prediction (``/``) work as in Megatron.

* ``use_transformer_engine=True``: Megatron's own ``hybrid_stack_spec`` (TE modules) with the
  layer classes swapped for their mHC subclasses and the MTP layers' norms contracting.
* ``use_transformer_engine=False``: the same layers from Megatron's local modules (the ones of
  ``get_gpt_layer_local_spec``: attention, MLA, MLP, MoE, with the config's normalization;
  Mamba and GDN with Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` and the same
  norm), so a hybrid mHC model builds without Transformer Engine (Megatron's own
  ``HybridStack`` always builds a ``TENorm``). DeepSeek sparse attention (``D``) has no local
  spec: it is refused with a clear error.

A GPT layer's two sublayers are two hybrid layers with the same submodules and parameter
names, so the GPT mHC model with L layers is the hybrid mHC model with pattern ``"*-" * L``
(``*E`` for MoE layers, ``+-`` for MLA); :mod:`mhc_megatron.checkpoint.gpt_to_hybrid` maps
its checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from mhc_megatron.layers.hybrid import (
    HybridHyperConnectionLayer,
    HyperConnectionMambaLayer,
    HyperConnectionMambaLayerSubmodules,
    HyperConnectionMLPLayer,
    HyperConnectionMoETransformerLayer,
    MHCHybridStack,
    MHCHybridStackSubmodules,
)
from mhc_megatron.layers.streams import StreamContractingNorm
from mhc_megatron.layers.transformer_layer import HyperConnectionTransformerLayerSubmodules
from mhc_megatron.specs.gpt import _require_transformer_engine

# Megatron's layer class -> its mHC subclass (most derived first).
_MHC_LAYER_CLASSES = (
    (MoETransformerLayer, HyperConnectionMoETransformerLayer),
    (MLPLayer, HyperConnectionMLPLayer),
    (TransformerLayer, HybridHyperConnectionLayer),
    (MambaLayer, HyperConnectionMambaLayer),
)
_LAYER_FIELDS = ("mamba_layer", "gdn_layer", "attention_layer", "dsa_layer", "mla_layer",
                 "mlp_layer", "moe_layer")


def to_mhc_hybrid_layer_spec(layer_spec):
    """A hybrid stack's layer spec (Megatron's ``TransformerLayer``, ``MLPLayer``,
    ``MoETransformerLayer`` or ``MambaLayer``) -> the same layer with its hyper-connection.
    ``IdentityOp`` (a symbol the spec does not build) stays as it is."""
    if layer_spec is IdentityOp or not isinstance(layer_spec, ModuleSpec):
        return layer_spec
    module = layer_spec.module
    for _, mhc_class in _MHC_LAYER_CLASSES:
        if module is mhc_class:
            return layer_spec
    for megatron_class, mhc_class in _MHC_LAYER_CLASSES:
        if module is megatron_class:
            break
    else:
        raise ValueError(
            f"to_mhc_hybrid_layer_spec: cannot add hyper-connections to {module!r}; the hybrid "
            "stack's layers must be Megatron's TransformerLayer, MLPLayer, MoETransformerLayer "
            "or MambaLayer. Fix: start from Megatron's hybrid_stack_spec or "
            "get_hybrid_stack_with_mhc_spec.")
    mamba = mhc_class is HyperConnectionMambaLayer
    submodules_class = (HyperConnectionMambaLayerSubmodules if mamba
                        else HyperConnectionTransformerLayerSubmodules)
    fields = {f.name: getattr(layer_spec.submodules, f.name)
              for f in dataclasses.fields(layer_spec.submodules)}
    return ModuleSpec(module=mhc_class, params=dict(layer_spec.params),
                      submodules=submodules_class(**fields))


def _mhc_mtp_block_spec(mtp_block_spec):
    """Megatron's hybrid MTP block spec with each MTP layer's final norm contracting the
    streams of its inner stack."""
    if mtp_block_spec is None:
        return None
    layer_specs = []
    for layer_spec in mtp_block_spec.submodules.layer_specs:
        sub = layer_spec.submodules
        if not StreamContractingNorm.is_builder(sub.layer_norm):
            sub = dataclasses.replace(
                sub, layer_norm=StreamContractingNorm.wrapping(sub.layer_norm))
        layer_specs.append(dataclasses.replace(layer_spec, submodules=sub))
    return dataclasses.replace(
        mtp_block_spec,
        submodules=dataclasses.replace(mtp_block_spec.submodules, layer_specs=layer_specs))


def to_mhc_hybrid_stack_spec(stack_spec: ModuleSpec, final_norm=None) -> ModuleSpec:
    """Any Megatron ``HybridStack`` spec -> :class:`MHCHybridStack` with mHC layers.

    ``final_norm``: the norm class the stack's stream-contracting final norm wraps (None:
    the spec's own ``final_norm`` if it has one, else ``TENorm`` as Megatron's stack).
    """
    if not (isinstance(stack_spec.module, type) and issubclass(stack_spec.module, HybridStack)):
        raise ValueError(
            f"to_mhc_hybrid_stack_spec: expected a HybridStack spec, got {stack_spec.module!r}. "
            "Fix: pass Megatron's hybrid_stack_spec (megatron.core.models.hybrid."
            "hybrid_layer_specs) or a spec built like it.")
    sub = stack_spec.submodules
    fields = {name: to_mhc_hybrid_layer_spec(getattr(sub, name)) for name in _LAYER_FIELDS}
    if final_norm is None:
        final_norm = getattr(sub, "final_norm", None)
    return ModuleSpec(
        module=MHCHybridStack, params=dict(stack_spec.params),
        submodules=MHCHybridStackSubmodules(
            **fields, mtp_block_spec=_mhc_mtp_block_spec(sub.mtp_block_spec),
            final_norm=final_norm))


def _only(submodules: TransformerLayerSubmodules, *names: str, keys_map_prefix: str):
    """``submodules`` with only the fields ``names`` (the rest Megatron's defaults, i.e. the
    sublayer absent) and the entries of its state-dict keys map for that sublayer."""
    keys_map = {k: v for k, v in submodules.sharded_state_dict_keys_map.items()
                if k.startswith(keys_map_prefix)}
    return TransformerLayerSubmodules(**{n: getattr(submodules, n) for n in names},
                                      sharded_state_dict_keys_map=keys_map)


def get_hybrid_stack_local_spec(config: TransformerConfig) -> ModuleSpec:
    """A ``HybridStack`` spec of Megatron's local modules, without mHC (pass it to
    :func:`to_mhc_hybrid_stack_spec`; Megatron's ``HybridStack`` itself needs TE for its
    final norm, so build it as ``MHCHybridStack``, which with mHC off is Megatron's stack).

    Each layer takes the submodules of ``get_gpt_layer_local_spec`` for ``config`` (norm from
    ``config.normalization``, ``qk_layernorm``, MoE with ``num_moe_experts`` /
    ``moe_grouped_gemm``), so its parameters are named as a GPT layer's.
    """
    common = dict(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    dense = get_gpt_layer_local_submodules(**common, qk_l2_norm=config.qk_l2_norm)
    mla = get_gpt_layer_local_submodules(**common, multi_latent_attention=True)
    moe = (get_gpt_layer_local_submodules(**common, num_experts=config.num_moe_experts,
                                          moe_grouped_gemm=config.moe_grouped_gemm)
           if config.num_moe_experts else None)
    norm = dense.input_layernorm
    attention = ("input_layernorm", "self_attention", "self_attn_bda")
    mlp = ("pre_mlp_layernorm", "mlp", "mlp_bda")
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules

    return ModuleSpec(
        module=HybridStack,
        submodules=MHCHybridStackSubmodules(
            mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
                norm=norm,
                mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
                mamba_bda=get_bias_dropout_add)),
            gdn_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                    in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear)),
                self_attn_bda=get_bias_dropout_add)),
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=_only(
                dense, *attention, keys_map_prefix="input_layernorm")),
            mla_layer=ModuleSpec(module=TransformerLayer, submodules=_only(
                mla, *attention, keys_map_prefix="input_layernorm")),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=_only(
                dense, *mlp, keys_map_prefix="pre_mlp_layernorm")),
            moe_layer=(ModuleSpec(module=MoETransformerLayer, submodules=_only(
                moe, *mlp, keys_map_prefix="pre_mlp_layernorm")) if moe else IdentityOp),
            mtp_block_spec=ModuleSpec(
                module=MultiTokenPredictionBlock,
                submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[ModuleSpec(
                    module=MultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear,
                        mtp_model_layer=None, layer_norm=norm))])),
            final_norm=norm,
        ),
    )


def get_hybrid_stack_with_mhc_spec(config: Optional[TransformerConfig] = None,
                                   use_transformer_engine: bool = True) -> ModuleSpec:
    """The ``hybrid_stack_spec`` for ``HybridModel`` with mHC in every layer.

    ``use_transformer_engine=True``: Megatron's ``hybrid_stack_spec`` (TE modules; ``config``
    unused) with mHC. ``False``: :func:`get_hybrid_stack_local_spec` for ``config`` (needed)
    with mHC. With ``enable_hyper_connections=False`` the model is Megatron's hybrid model.
    """
    if use_transformer_engine:
        _require_transformer_engine()
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        return to_mhc_hybrid_stack_spec(hybrid_stack_spec)
    if config is None:
        raise ValueError(
            "get_hybrid_stack_with_mhc_spec(use_transformer_engine=False) needs the model's "
            "config (normalization, MoE and MLA settings pick the local modules). Fix: pass "
            "config=your MHCTransformerConfig.")
    return to_mhc_hybrid_stack_spec(get_hybrid_stack_local_spec(config))
