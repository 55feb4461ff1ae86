"""Move a GPT mHC model's weights into the hybrid layout (``HybridModel``).

A GPT layer is two residual sublayers, each with its own hyper-connection; the hybrid stack
makes each sublayer a layer of its own with the same submodules and names. So the GPT mHC
model with L layers is the hybrid mHC model with pattern :func:`gpt_hybrid_layer_pattern`
(``"*-" * L``; ``*E`` for MoE layers, ``+`` for MLA attention), and its parameters map one to
one (GPT layer ``i`` -> hybrid layers ``2i`` and ``2i + 1``)::

    GPT                                             hybrid
    decoder.layers.{i}.input_layernorm.*            decoder.layers.{2i}.input_layernorm.*
    decoder.layers.{i}.self_attention.*             decoder.layers.{2i}.self_attention.*
    decoder.layers.{i}.self_attention_hyper_connection.*   decoder.layers.{2i}.(same)
    decoder.layers.{i}.pre_mlp_layernorm.*          decoder.layers.{2i+1}.pre_mlp_layernorm.*
    decoder.layers.{i}.mlp.*                        decoder.layers.{2i+1}.mlp.*
    decoder.layers.{i}.mlp_hyper_connection.*       decoder.layers.{2i+1}.mlp_hyper_connection.*
    decoder.final_layernorm.*                       decoder.final_norm.*
    mtp.layers.{d}.mtp_model_layer.*                mtp.layers.{d}.mtp_model_layer.layers.{0|1}.*
    (embedding, output_layer, mtp norms/eh_proj)    (unchanged)

Two ways to use it:

* :func:`gpt_to_hybrid_state_dict`: a whole (unsharded, one pipeline stage) ``state_dict``;
* :func:`load_gpt_checkpoint_into_hybrid`: a Megatron distributed checkpoint of the GPT model
  (``dist_checkpointing``, any parallel layout, as ``megatron.training`` saves it) loaded
  straight into a hybrid model of any parallel layout, through
  :func:`gpt_layout_sharded_state_dict` (the hybrid model's sharded state dict under the GPT
  checkpoint's keys and layer stacking). Save the model afterwards with Megatron's own
  checkpointing to get a hybrid checkpoint.
"""

from __future__ import annotations

import re

from megatron.core.dist_checkpointing.utils import apply_prefix_mapping, replace_prefix_for_sharding
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

ATTENTION_PARTS = ("input_layernorm.", "self_attention.", "self_attention_hyper_connection.")
MLP_PARTS = ("pre_mlp_layernorm.", "mlp.", "mlp_hyper_connection.")
_ATTENTION_SYMBOLS = (Symbols.ATTENTION, Symbols.MLA)
_MLP_SYMBOLS = (Symbols.MLP, Symbols.MOE)
OUTPUT_EXTRA_STATE = "output_layer._extra_state"
_DECODER_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.*)$")
_MTP_INNER = re.compile(r"^(.*mtp\.layers\.\d+\.mtp_model_layer\.)(.*)$")


def _gpt_layer_symbols(config, layer_index: int) -> str:
    """The two hybrid symbols of GPT layer ``layer_index`` (0-based) under ``config``."""
    mla = getattr(config, "multi_latent_attention", False)
    attention = Symbols.MLA if mla else Symbols.ATTENTION
    if not config.num_moe_experts:
        return attention + Symbols.MLP
    freq = config.moe_layer_freq
    is_moe = freq[layer_index] if isinstance(freq, list) else layer_index % freq == 0
    return attention + (Symbols.MOE if is_moe else Symbols.MLP)


def gpt_hybrid_layer_pattern(config, pipeline_stages: int = 1) -> str:
    """The ``hybrid_layer_pattern`` of the hybrid model equal to the GPT model of ``config``
    (``num_layers``, MoE per ``moe_layer_freq``, MLA, ``mtp_num_layers`` MTP depths, each
    the GPT's last layer), with ``pipeline_stages`` equal ``|``-separated stages (the GPT's
    even split)."""
    layers = config.num_layers
    if layers % pipeline_stages:
        raise ValueError(
            f"gpt_hybrid_layer_pattern: num_layers={layers} does not split into "
            f"pipeline_stages={pipeline_stages} equal stages. Fix: pass a divisor of num_layers.")
    per_stage = layers // pipeline_stages
    stages = ["".join(_gpt_layer_symbols(config, s * per_stage + i) for i in range(per_stage))
              for s in range(pipeline_stages)]
    pattern = Symbols.PIPE.join(stages)
    depths = getattr(config, "mtp_num_layers", None) or 0
    last = _gpt_layer_symbols(config, layers - 1)
    return pattern + "".join(Symbols.MTP_SEPARATOR + last for _ in range(depths))


def _part_offset(rest: str, key: str) -> int:
    if rest.startswith(ATTENTION_PARTS):
        return 0
    if rest.startswith(MLP_PARTS):
        return 1
    raise ValueError(
        f"gpt_to_hybrid: {key!r} belongs to neither the attention sublayer {ATTENTION_PARTS} "
        f"nor the MLP sublayer {MLP_PARTS} of a GPT layer. Fix: convert a GPT model of "
        "self-attention + MLP/MoE layers (no cross-attention).")


def gpt_to_hybrid_key(key: str) -> str:
    """One GPT ``state_dict`` key -> the hybrid model's (table in the module docstring)."""
    match = _DECODER_LAYER.match(key)
    if match and "mtp." not in match.group(1):
        head, index, rest = match.groups()
        return f"{head}{2 * int(index) + _part_offset(rest, key)}.{rest}"
    match = _MTP_INNER.match(key)
    if match:
        head, rest = match.groups()
        return f"{head}layers.{_part_offset(rest, key)}.{rest}"
    return key.replace("decoder.final_layernorm.", "decoder.final_norm.")


def gpt_to_hybrid_state_dict(state_dict: dict) -> dict:
    """A GPT mHC model's ``state_dict()`` (all its layers, i.e. one pipeline stage) -> the
    ``state_dict`` of the hybrid model with pattern :func:`gpt_hybrid_layer_pattern`."""
    return {gpt_to_hybrid_key(k): v for k, v in state_dict.items()}


def _non_homogeneous_gpt_layers(config, metadata, symbols: str = "") -> bool:
    """Whether Megatron's ``TransformerBlock.sharded_state_dict`` keys the GPT's layers one by
    one (``decoder.layers.{i}.``) rather than stacking them (``decoder.layers.`` with a layer
    axis): the same rule as Megatron-Core 0.19's. ``symbols``: the hybrid main pattern of the
    GPT's layers; where it mixes MLP and MoE layers the GPT had ``moe_layer_freq`` > 1 or a
    list with dense layers (the hybrid model's own config needs neither: its pattern places
    the MoE layers), which Megatron keys one by one."""
    metadata = metadata or {}
    freq = getattr(config, "moe_layer_freq", 1)
    linear = getattr(config, "linear_attention_freq", None)
    return bool(
        {Symbols.MLP, Symbols.MOE} <= set(symbols[1::2])
        or metadata.get("non_homogeneous_layers", False)
        or metadata.get("singleton_local_shards", False)
        or getattr(config, "hetereogenous_dist_checkpoint", False)
        or getattr(config, "heterogeneous_block_specs", False)
        or isinstance(freq, list) or (isinstance(freq, int) and freq > 1)
        or isinstance(linear, list) or (isinstance(linear, int) and linear > 1))


def stacks_gpt_layers(checkpoint_keys) -> bool:
    """Whether a GPT checkpoint with these tensor keys stacks its decoder layers on a layer
    axis (``decoder.layers.<name>``) rather than keying them one by one."""
    layer_keys = [k[len("decoder.layers."):] for k in checkpoint_keys
                  if k.startswith("decoder.layers.")]
    if not layer_keys:
        raise ValueError(
            "load_gpt_checkpoint_into_hybrid: the checkpoint holds no 'decoder.layers.' tensors, "
            "so it is not a GPT model's distributed checkpoint. Fix: pass the directory "
            "Megatron saved the GPT model's weights in (e.g. <save>/iter_0000100).")
    return not layer_keys[0].split(".", 1)[0].isdigit()


def _check_gpt_pairs(symbols: str) -> int:
    """The GPT layer count of a hybrid main pattern of attention/MLP pairs, or a clear error."""
    if len(symbols) % 2 or any(
            s not in (_ATTENTION_SYMBOLS if i % 2 == 0 else _MLP_SYMBOLS)
            for i, s in enumerate(symbols)):
        raise ValueError(
            f"gpt_layout_sharded_state_dict: the hybrid pattern's layers {symbols!r} are not "
            "GPT layers (pairs of an attention '*'/'+' and an MLP '-'/MoE 'E'). Fix: build the "
            "hybrid model with gpt_hybrid_layer_pattern(gpt_config).")
    return len(symbols) // 2


def gpt_layout_sharded_state_dict(model, metadata: dict | None = None,
                                  stacked_layers: bool | None = None) -> dict:
    """The hybrid ``model``'s sharded state dict under the keys of the equivalent GPT mHC
    model's distributed checkpoint: each decoder layer is asked for its tensors with the GPT
    layer's offset on the layer axis, as Megatron's ``TransformerBlock`` does; the final norm
    and the MTP inner layers are renamed. The dict keys stay the hybrid model's own, so
    ``dist_checkpointing.load(this, gpt_dir)`` gives a ``state_dict`` for ``model``.

    ``stacked_layers``: whether the GPT checkpoint stacks its layers on a layer axis
    (``decoder.layers.<name>``) or keys them one by one (``decoder.layers.<i>.<name>``); None
    infers it as Megatron decides it, from ``metadata``, the config and the pattern (a mix of
    dense and MoE layers is keyed one by one). :func:`load_gpt_checkpoint_into_hybrid` reads
    it from the checkpoint instead."""
    parsed = parse_hybrid_pattern(model.hybrid_layer_pattern)
    main = (parsed.main_pattern or "").replace(Symbols.PIPE, "")
    gpt_layers = _check_gpt_pairs(main)
    config = model.config
    if stacked_layers is None:
        non_homogeneous = _non_homogeneous_gpt_layers(config, metadata, main)
    else:
        non_homogeneous = not stacked_layers
    full = model.sharded_state_dict(prefix="", metadata=metadata)
    sharded = {k: v for k, v in full.items()
               if not k.startswith(("decoder.layers.", "mtp."))}
    # GPTModel drops its output layer's (empty) extra state from its checkpoints
    sharded.pop(OUTPUT_EXTRA_STATE, None)
    apply_prefix_mapping(sharded, {"decoder.final_norm.": "decoder.final_layernorm."})
    for local_index, layer in enumerate(model.decoder.layers):
        gpt_index = (layer.layer_number - 1) // 2
        prefix = f"decoder.layers.{local_index}."
        if non_homogeneous:
            target, offsets = f"decoder.layers.{gpt_index}.", []
        else:
            target, offsets = "decoder.layers.", [(0, gpt_index, gpt_layers)]
        layer_sharded = layer.sharded_state_dict(prefix, offsets, metadata)
        replace_prefix_for_sharding(layer_sharded, prefix, target)
        sharded.update(layer_sharded)
    if getattr(model, "mtp_process", False):
        mtp = {k: v for k, v in full.items() if k.startswith("mtp.")}
        for mtp_layer in model.mtp.layers:
            depth = f"mtp.layers.{mtp_layer.layer_number - 1}."
            _check_gpt_pairs("".join(mtp_layer.mtp_model_layer.layer_type_list))
            apply_prefix_mapping(mtp, {
                f"{depth}mtp_model_layer.layers.{k}.": f"{depth}transformer_layer."
                for k in range(2)})
        sharded.update(mtp)
    return sharded


def load_gpt_checkpoint_into_hybrid(model, checkpoint_dir: str, metadata: dict | None = None,
                                    strict: bool = True):
    """Load a GPT mHC model's Megatron distributed checkpoint (the model weights in
    ``checkpoint_dir``, e.g. ``<save>/iter_0000100``) into the hybrid ``model``. ``metadata``:
    the sharded-state-dict metadata the checkpoint was saved with (``megatron.training``
    records it in the checkpoint's ``content_metadata``). Returns ``load_state_dict``'s
    result. Whether the checkpoint stacks the GPT's layers is read from its own tensor keys.
    ``metadata`` is not modified (Megatron's ``sharded_state_dict`` writes into the dict it
    gets; a copy is passed)."""
    from megatron.core import dist_checkpointing

    stacked = stacks_gpt_layers(dist_checkpointing.load_tensors_metadata(checkpoint_dir))
    sharded = gpt_layout_sharded_state_dict(model, dict(metadata or {}), stacked_layers=stacked)
    loaded = dist_checkpointing.load(sharded, checkpoint_dir)
    own = model.state_dict()
    if OUTPUT_EXTRA_STATE in own:  # not in GPT checkpoints (GPTModel.sharded_state_dict)
        loaded[OUTPUT_EXTRA_STATE] = own[OUTPUT_EXTRA_STATE]
    return model.load_state_dict(loaded, strict=strict)
