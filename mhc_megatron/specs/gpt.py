"""GPT layer and decoder-block specs with mHC, built from Megatron-Core's own GPT specs.

Each helper takes Megatron's spec for the same arguments and swaps in
:class:`HyperConnectionTransformerLayer` (one hyper-connection mapping per sublayer);
the block helper also makes the final norm contract the streams. Dense, MoE
(``num_experts``) and MLA (``multi_latent_attention``) layers are all covered, because
Megatron builds those and we only change the layer class and the final norm.

Use the **block** spec for a model: ``GPTModel(config, get_gpt_decoder_block_with_mhc_spec(
config, use_transformer_engine=...), ...)``. A layer spec alone leaves Megatron's plain
final norm, which cannot take the ``[s, b, n*C]`` streams.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Optional

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from mhc_megatron.layers.streams import StreamContractingNorm
from mhc_megatron.layers.transformer_layer import (
    SEQUENCE_PARALLEL_NORM_ERROR,
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
)


TE_MISSING = (
    "The Transformer Engine mHC spec needs transformer_engine, which is not installed (it is "
    "optional for mhc-megatron, and needs CUDA). Fix: on a CUDA machine, install it with "
    "`pip install --no-build-isolation \"transformer_engine[pytorch]\"` (builds TE's PyTorch "
    "extension against your torch; needs the CUDA toolkit and cuDNN), or use an NGC PyTorch "
    "container, which ships it (https://docs.nvidia.com/deeplearning/transformer-engine/"
    "user-guide/installation.html). Without TE: get_gpt_layer_with_mhc_local_spec or "
    "get_gpt_decoder_block_with_mhc_spec(..., use_transformer_engine=False)."
)


def _require_transformer_engine() -> None:
    if importlib.util.find_spec("transformer_engine") is None:
        raise ImportError(TE_MISSING)


def _torch_norms_in(spec, seen=None) -> bool:
    """Whether ``spec`` (a block/layer spec, a submodules dataclass, a partial, ...) builds
    Megatron's torch fallback norm ``WrappedTorchNorm`` anywhere."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen = set() if seen is None else seen
    if id(spec) in seen:
        return False
    seen.add(id(spec))
    if isinstance(spec, type):
        return issubclass(spec, WrappedTorchNorm)
    if isinstance(spec, ModuleSpec):
        parts = [spec.module, spec.submodules, *spec.params.values()]
    elif isinstance(spec, functools.partial):
        parts = [spec.func, *spec.args, *spec.keywords.values()]
    elif dataclasses.is_dataclass(spec):
        parts = [getattr(spec, f.name) for f in dataclasses.fields(spec)]
    elif isinstance(spec, (list, tuple)):
        parts = list(spec)
    elif isinstance(spec, dict):
        parts = list(spec.values())
    else:
        return False
    return any(_torch_norms_in(part, seen) for part in parts)


def check_sequence_parallel_norms(config: TransformerConfig, spec) -> None:
    """Refuse ``config.sequence_parallel`` when ``spec`` builds Megatron's torch fallback
    norm (``WrappedTorchNorm``), which asserts when it is built with sequence parallelism.

    Megatron's local modules use that norm for RMSNorm, and for LayerNorm where Apex is not
    installed (with Apex: its ``FusedLayerNorm``, which supports sequence parallelism);
    Transformer Engine's norms support it. A spec whose norms were replaced by ones that
    support sequence parallelism passes.
    """
    if getattr(config, "sequence_parallel", False) and _torch_norms_in(spec):
        raise ValueError(SEQUENCE_PARALLEL_NORM_ERROR)


def to_mhc_layer_spec(layer_spec: ModuleSpec) -> ModuleSpec:
    """Megatron ``TransformerLayer`` spec -> the same layer with hyper-connections."""
    if isinstance(layer_spec.module, type) and issubclass(
        layer_spec.module, HyperConnectionTransformerLayer
    ):
        return layer_spec
    if layer_spec.module is not TransformerLayer:
        raise ValueError(
            f"to_mhc_layer_spec: cannot add hyper-connections to {layer_spec.module!r}; only "
            "megatron.core TransformerLayer specs are supported. Fix: start from Megatron's "
            "GPT layer/block specs (get_gpt_layer_local_spec, "
            "get_gpt_layer_with_transformer_engine_spec, get_gpt_decoder_block_spec)."
        )
    submodules = layer_spec.submodules
    fields = {f.name: getattr(submodules, f.name) for f in dataclasses.fields(submodules)}
    return ModuleSpec(
        module=HyperConnectionTransformerLayer,
        params=dict(layer_spec.params),
        submodules=HyperConnectionTransformerLayerSubmodules(**fields),
    )


def get_gpt_layer_with_mhc_local_spec(*args, **kwargs) -> ModuleSpec:
    """``get_gpt_layer_local_spec`` (same arguments) with hyper-connections."""
    return to_mhc_layer_spec(gpt_layer_specs.get_gpt_layer_local_spec(*args, **kwargs))


def get_gpt_layer_with_mhc_te_spec(*args, **kwargs) -> ModuleSpec:
    """``get_gpt_layer_with_transformer_engine_spec`` (same arguments) with hyper-connections.

    Transformer Engine is imported lazily; a clear ``ImportError`` says what to do if it
    is missing.
    """
    _require_transformer_engine()
    return to_mhc_layer_spec(
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)
    )


def get_gpt_decoder_block_with_mhc_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """``get_gpt_decoder_block_spec`` with hyper-connections in every layer.

    Dense and MoE layers follow ``config.num_moe_experts`` / ``config.moe_layer_freq`` as in
    Megatron; the final norm (``decoder.final_layernorm``) becomes a
    :class:`StreamContractingNorm` around Megatron's norm.
    """
    if use_transformer_engine:
        _require_transformer_engine()
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine, normalization, qk_l2_norm, vp_stage, pp_rank
    )
    return with_mhc_block_spec(block)


def with_mhc_block_spec(block: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """Any Megatron ``TransformerBlockSubmodules`` -> mHC layers + stream-contracting norm."""
    return TransformerBlockSubmodules(
        layer_specs=[to_mhc_layer_spec(spec) for spec in block.layer_specs],
        layer_norm=StreamContractingNorm.wrapping(block.layer_norm),
    )


def get_gpt_mtp_block_with_mhc_spec(
    config: TransformerConfig,
    spec: TransformerBlockSubmodules,
    use_transformer_engine: bool,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
):
    """Megatron's multi-token-prediction block spec (``get_gpt_mtp_block_spec``) for an mHC
    decoder block spec ``spec``: pass it as ``GPTModel(..., mtp_block_spec=...)``.

    Where the streams live in MTP (DeepSeek-V3 style, depth k): each MTP layer takes the main
    model's output ``[s, b, C]`` (after the decoder's stream-contracting final norm, as every
    MTP module takes the previous depth's normalised representation) and the next token's
    embedding, projects them (``eh_proj``) to ``[s, b, C]``, and its inner layer, an mHC layer
    like the decoder's last, **expands that into n streams of its own**; the MTP layer's final
    norm contracts them (a ``StreamContractingNorm``) before the shared output head. So every
    MTP depth is a residual stack of one mHC layer with its own mappings, and nothing of the
    decoder's n-stream state crosses into MTP (what DeepSeek-V3's MTP passes on is the
    normalised representation ``h``, which here is the contracted streams). Returns ``None``
    where Megatron builds no MTP layer on this pipeline stage.
    """
    if use_transformer_engine:
        _require_transformer_engine()
    block = gpt_layer_specs.get_gpt_mtp_block_spec(config, spec, use_transformer_engine,
                                                   vp_stage=vp_stage, pp_rank=pp_rank)
    if block is None:
        return None
    layer_specs = []
    for layer_spec in block.layer_specs:
        sub = layer_spec.submodules
        if not StreamContractingNorm.is_builder(sub.layer_norm):
            sub = dataclasses.replace(sub, layer_norm=StreamContractingNorm.wrapping(sub.layer_norm))
        layer_specs.append(dataclasses.replace(layer_spec, submodules=sub))
    return dataclasses.replace(block, layer_specs=layer_specs)

