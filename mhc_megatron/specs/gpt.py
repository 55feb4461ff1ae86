"""GPT layer and decoder-block specs with mHC, built from Megatron-Core's own GPT specs.

Each helper takes Megatron's spec for the same arguments and swaps in
:class:`HyperConnectionTransformerLayer` (one hyper-connection mapping per sublayer);
the block helper also makes the final norm contract the streams. Dense, MoE
(``num_experts``) and MLA (``multi_latent_attention``) layers are all covered, because
Megatron builds those and we only change the layer class and the final norm.

Use the **block** spec for a model: ``GPTModel(config, get_gpt_decoder_block_with_mhc_spec(
config, use_transformer_engine=...), ...)``. A layer spec alone leaves Megatron's plain
final norm, which cannot take the ``[s, b, n*C]`` streams.

With ``fuse_input_norm=True`` (the block helper follows ``config.mhc_fuse_input_norm``) each
sublayer's input RMSNorm moves into its hyper-connection module (the mHC pre kernel applies
it): the spec loses the sublayer's own norm (a separate norm module becomes ``IdentityOp``;
Transformer Engine's ``TELayerNormColumnParallelLinear`` becomes ``TEColumnParallelLinear``),
the hyper-connection modules are built with ``fuse_input_norm=True``, and the layer's
``sharded_state_dict_keys_map`` stores their ``norm_weight`` under the key the removed norm's
weight had, so distributed checkpoints of fused and unfused models load into each other.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Optional

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from mhc_megatron.config import hyper_connections_enabled
from mhc_megatron.layers.hyper_connection import HyperConnectionModule
from mhc_megatron.layers.streams import StreamContractingNorm
from mhc_megatron.layers.transformer_layer import (
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


def to_mhc_layer_spec(layer_spec: ModuleSpec, fuse_input_norm: bool = False) -> ModuleSpec:
    """Megatron ``TransformerLayer`` spec -> the same layer with hyper-connections.

    ``fuse_input_norm=True``: the sublayers' input norms move into the hyper-connection modules
    (see the module docstring; for a model whose config has ``mhc_fuse_input_norm=True``).
    An mHC spec is returned as it is, unless it is to be fused and is not yet; False never
    un-fuses a fused spec. ``layer_spec`` itself is never modified (Megatron's block specs share
    one layer spec object between layers): changed parts are new objects.
    """
    if isinstance(layer_spec.module, type) and issubclass(
        layer_spec.module, HyperConnectionTransformerLayer
    ):
        spec = layer_spec
    elif layer_spec.module is not TransformerLayer:
        raise ValueError(
            f"to_mhc_layer_spec: cannot add hyper-connections to {layer_spec.module!r}; only "
            "megatron.core TransformerLayer specs are supported. Fix: start from Megatron's "
            "GPT layer/block specs (get_gpt_layer_local_spec, "
            "get_gpt_layer_with_transformer_engine_spec, get_gpt_decoder_block_spec)."
        )
    else:
        spec = ModuleSpec(
            module=HyperConnectionTransformerLayer,
            params=dict(layer_spec.params),
            submodules=HyperConnectionTransformerLayerSubmodules(**_fields(layer_spec.submodules)),
        )
    if fuse_input_norm and not fuses_input_norm(spec):
        spec = _fuse_input_norms(spec)
    return spec


def fuses_input_norm(layer_spec: ModuleSpec) -> bool:
    """True for an mHC layer spec whose hyper-connection modules apply the input norms
    (built by ``to_mhc_layer_spec(..., fuse_input_norm=True)``)."""
    submodules = layer_spec.submodules
    return all(_hc_fuses(getattr(submodules, name, None)) for name in _HC_FIELDS)


# The hyper-connection module of each sublayer, the sublayer, its separate input-norm module,
# and the fields of the sublayer's submodules where a linear layer with the norm fused into it
# (Transformer Engine's LayerNormLinear) may sit: dense attention's linear_qkv, MLA's
# linear_qkv_down_proj (with mla_down_proj_fusion), the dense MLP's linear_fc1.
_SUBLAYERS = (
    ("self_attention_hyper_connection", "self_attention", "input_layernorm",
     ("linear_qkv", "linear_qkv_down_proj")),
    ("mlp_hyper_connection", "mlp", "pre_mlp_layernorm", ("linear_fc1",)),
)
_HC_FIELDS = tuple(hc for hc, *_ in _SUBLAYERS)
_FUSE_FIX = ("use fuse_input_norm=False (mhc_fuse_input_norm=False), or a spec whose sublayers "
             "have one RMSNorm each, as a separate module (Megatron's local specs, TENorm) or "
             "fused into Transformer Engine's TELayerNormColumnParallelLinear")


def _fuse_input_norms(spec: ModuleSpec) -> ModuleSpec:
    """The mHC layer spec with each sublayer's input norm moved into its hyper-connection module.

    Each sublayer's norm is either a separate module (``input_layernorm`` /
    ``pre_mlp_layernorm``: Megatron's local specs, MoE and MLA layers), which becomes
    ``IdentityOp``, or fused into the sublayer's first linear
    (``TELayerNormColumnParallelLinear``: dense layers of the TE spec), which becomes
    ``TEColumnParallelLinear``. Its weight's checkpoint key is what the unfused layer writes
    (``input_layernorm.weight`` or ``self_attention.linear_qkv.layer_norm_weight`` passed
    through the spec's own ``sharded_state_dict_keys_map``); an exact entry
    ``"<hyper_connection>.norm_weight" -> that key`` leads the map. Megatron's
    ``apply_prefix_mapping`` takes the first entry whose key is a prefix of a parameter's key,
    and no other entry is a prefix of these two; the entries for the removed norms (e.g. the
    local spec's ``"input_layernorm." -> "self_attention.linear_qkv.layer_norm_"``) match
    nothing any more, as ``IdentityOp`` has no state.
    """
    submodules = spec.submodules
    if not isinstance(submodules, HyperConnectionTransformerLayerSubmodules):
        submodules = HyperConnectionTransformerLayerSubmodules(**_fields(submodules))
    keys_map = submodules.sharded_state_dict_keys_map or {}
    changes, fused_map = {}, {}
    for hc_field, sublayer, norm_field, linear_fields in _SUBLAYERS:
        replaced, unfused_key = _remove_input_norm(submodules, sublayer, norm_field,
                                                   linear_fields)
        changes.update(replaced)
        changes[hc_field] = _fusing_hyper_connection(getattr(submodules, hc_field))
        fused_map[f"{hc_field}.norm_weight"] = _mapped_key(unfused_key, keys_map)
    fused_map.update((k, v) for k, v in keys_map.items() if k not in fused_map)
    changes["sharded_state_dict_keys_map"] = fused_map
    return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, **changes))


def _remove_input_norm(submodules, sublayer: str, norm_field: str,
                       linear_fields: tuple[str, ...]) -> tuple[dict, str]:
    """``({field: replacement}, key of the norm weight)`` for one sublayer (see
    :func:`_fuse_input_norms`); a ``ValueError`` where there is no single RMSNorm to move."""
    builder = getattr(submodules, sublayer)
    inner = _builder_submodules(builder)
    if any(cls.__name__ == "TEFusedMLP" for cls in getattr(_builder_class(builder), "__mro__", ())):
        raise ValueError(
            "fuse_input_norm: the MLP is Transformer Engine's TEFusedMLP (use_te_op_fuser), "
            "whose operation sequence needs the norm inside its linear_fc1. Fix: build the spec "
            "with use_te_op_fuser=False, or use fuse_input_norm=False")
    found = []  # (field, replacement, key of the norm weight)
    for field in linear_fields:
        linear = getattr(inner, field, None) if inner is not None else None
        if linear is None:
            continue
        if _is_te_layer_norm_linear(linear):
            found.append((field, None, f"{sublayer}.{field}.layer_norm_weight"))
        elif _has_fused_norm(linear):
            raise ValueError(
                f"fuse_input_norm: {sublayer}.{field} is {_name(linear)}, a linear layer with "
                "the input norm fused into it that this version does not replace (only "
                f"Transformer Engine's TELayerNormColumnParallelLinear). Fix: {_FUSE_FIX}")
    norm = getattr(submodules, norm_field)
    if norm is not None and not _is_identity(norm):
        found.append((norm_field, IdentityOp, f"{norm_field}.weight"))
    if len(found) != 1:
        where = ", ".join(key.rsplit(".", 1)[0] for _, _, key in found)
        problem = (f"has two input norms ({where})" if found else
                   f"has no input norm (neither {norm_field} nor a norm fused into "
                   f"{sublayer}'s first linear layer)")
        raise ValueError(f"fuse_input_norm: the {sublayer} sublayer of this spec {problem}, so "
                         f"there is no single norm to move into the hyper-connection module. "
                         f"Fix: {_FUSE_FIX}")
    field, replacement, key = found[0]
    if field == norm_field:
        return {norm_field: replacement}, key
    inner = dataclasses.replace(inner, **{field: _te_column_parallel_linear()})
    return {sublayer: _with_builder_submodules(builder, inner)}, key


def _fusing_hyper_connection(builder):
    """A hyper-connection module spec with ``fuse_input_norm=True`` (class or ModuleSpec in)."""
    if isinstance(builder, ModuleSpec):
        return dataclasses.replace(builder, params={**builder.params, "fuse_input_norm": True})
    return ModuleSpec(module=builder or HyperConnectionModule, params={"fuse_input_norm": True})


def _hc_fuses(builder) -> bool:
    return isinstance(builder, ModuleSpec) and bool(builder.params.get("fuse_input_norm"))


def _mapped_key(key: str, keys_map: dict) -> str:
    """``key`` as Megatron's ``apply_prefix_mapping`` rewrites it (first matching prefix)."""
    for old, new in keys_map.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _fields(submodules) -> dict:
    return {f.name: getattr(submodules, f.name) for f in dataclasses.fields(submodules)}


def _target(builder):
    """The class a spec entry builds: ``ModuleSpec.module``, a partial's function, or itself."""
    if isinstance(builder, ModuleSpec):
        return builder.module
    if isinstance(builder, functools.partial):
        return builder.func
    return builder


def _builder_class(builder):
    """The module class of a sublayer entry (``partial(MLP.as_mlp_submodule, ...)`` -> MLP)."""
    target = _target(builder)
    return getattr(target, "__self__", target)


def _name(builder) -> str:
    target = _target(builder)
    return getattr(target, "__name__", repr(target))


def _is_identity(builder) -> bool:
    target = _builder_class(builder)
    return isinstance(target, type) and issubclass(target, IdentityOp)


def _builder_submodules(builder):
    """The submodules of a sublayer entry: a ``ModuleSpec``'s, or a partial's ``submodules``
    keyword (Megatron 0.19 builds MLPs as ``partial(MLP.as_mlp_submodule, submodules=...)``)."""
    if isinstance(builder, ModuleSpec):
        return builder.submodules
    if isinstance(builder, functools.partial):
        return builder.keywords.get("submodules")
    return None


def _with_builder_submodules(builder, submodules):
    if isinstance(builder, ModuleSpec):
        return dataclasses.replace(builder, submodules=submodules)
    return functools.partial(builder.func, *builder.args,
                             **{**builder.keywords, "submodules": submodules})


def _transformer_engine_extension():
    """Megatron's TE extension module when Transformer Engine imports, else None (without TE
    its class names are stand-ins, not classes)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    from megatron.core.extensions import transformer_engine as te_ext

    return te_ext if te_ext.HAVE_TE else None


def _is_te_layer_norm_linear(builder) -> bool:
    """Megatron's ``TELayerNormColumnParallelLinear``: by identity with TE, else by name."""
    target = _target(builder)
    te_ext = _transformer_engine_extension()
    if te_ext is not None:
        return target is te_ext.TELayerNormColumnParallelLinear
    return getattr(target, "__name__", None) == "TELayerNormColumnParallelLinear"


def _has_fused_norm(builder) -> bool:
    """A linear layer with a norm in it by its class name (``*LayerNorm*Linear``: Kitchen's,
    the inference spec's, subclasses of TE's)."""
    name = getattr(_target(builder), "__name__", "")
    return "LayerNorm" in name and "Linear" in name


def _te_column_parallel_linear():
    """Megatron's ``TEColumnParallelLinear`` (TE's ColumnParallelLinear without the norm)."""
    from megatron.core.extensions import transformer_engine as te_ext

    return te_ext.TEColumnParallelLinear


def get_gpt_layer_with_mhc_local_spec(*args, fuse_input_norm: bool = False,
                                      **kwargs) -> ModuleSpec:
    """``get_gpt_layer_local_spec`` (same arguments) with hyper-connections; with
    ``fuse_input_norm`` the input norms move into them (see :func:`to_mhc_layer_spec`)."""
    return to_mhc_layer_spec(gpt_layer_specs.get_gpt_layer_local_spec(*args, **kwargs),
                             fuse_input_norm=fuse_input_norm)


def get_gpt_layer_with_mhc_te_spec(*args, fuse_input_norm: bool = False,
                                   **kwargs) -> ModuleSpec:
    """``get_gpt_layer_with_transformer_engine_spec`` (same arguments) with hyper-connections;
    with ``fuse_input_norm`` the input norms move into them (see :func:`to_mhc_layer_spec`).

    Transformer Engine is imported lazily; a clear ``ImportError`` says what to do if it
    is missing.
    """
    _require_transformer_engine()
    return to_mhc_layer_spec(
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(*args, **kwargs),
        fuse_input_norm=fuse_input_norm,
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
    :class:`StreamContractingNorm` around Megatron's norm. The layers' input norms move into
    the hyper-connection modules when ``config.mhc_fuse_input_norm`` is set and mHC is on
    (with mHC off the layers are Megatron's own, which need their norms).
    """
    if use_transformer_engine:
        _require_transformer_engine()
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine, normalization, qk_l2_norm, vp_stage, pp_rank
    )
    fuse = hyper_connections_enabled(config) and bool(getattr(config, "mhc_fuse_input_norm",
                                                              False))
    return with_mhc_block_spec(block, fuse_input_norm=fuse)


def with_mhc_block_spec(block: TransformerBlockSubmodules,
                        fuse_input_norm: bool = False) -> TransformerBlockSubmodules:
    """Any Megatron ``TransformerBlockSubmodules`` -> mHC layers + stream-contracting norm;
    ``fuse_input_norm`` as in :func:`to_mhc_layer_spec`."""
    return TransformerBlockSubmodules(
        layer_specs=[to_mhc_layer_spec(spec, fuse_input_norm=fuse_input_norm)
                     for spec in block.layer_specs],
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
    normalised representation ``h``, which here is the contracted streams). The inner layer's
    spec is the decoder's last layer spec, so its input norms are fused when the decoder's
    are. Returns ``None`` where Megatron builds no MTP layer on this pipeline stage.
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

