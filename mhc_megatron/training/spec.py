"""The decoder-block spec callable for Megatron's ``GPTModelConfig.transformer_layer_spec``."""

from __future__ import annotations

from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
from mhc_megatron.specs.gpt import check_sequence_parallel_norms


def mhc_block_spec(model_cfg, vp_stage=None):
    """``GPTModelConfig`` -> the mHC decoder block spec (Megatron's ``GPTModelBuilder`` calls
    ``transformer_layer_spec(model_cfg, vp_stage=...)``).

    It is Megatron's own GPT block spec for ``model_cfg.transformer`` (dense or MoE layers per
    ``num_moe_experts`` / ``moe_layer_freq``, Transformer Engine modules when
    ``transformer_impl == "transformer_engine"``, local ones otherwise) with mHC layers and a
    stream-contracting final norm. Also usable as ``--spec mhc_megatron.training
    mhc_block_spec``. ``--sequence-parallel`` with norms that refuse it (Megatron's torch
    norm, e.g. ``--transformer-impl local`` without Apex) is a ValueError that names the fix.
    """
    tc = model_cfg.transformer
    unsupported = [name for name in ("experimental_attention_variant", "heterogeneous_block_specs")
                   if getattr(tc, name, None)]
    if unsupported:
        raise ValueError(
            f"mhc_block_spec: {', '.join(unsupported)} is not supported with hyper-connections. "
            "Fix: use the standard GPT layers (unset it) or build the block spec yourself with "
            "mhc_megatron.specs.with_mhc_block_spec.")
    block = get_gpt_decoder_block_with_mhc_spec(
        tc, use_transformer_engine=tc.transformer_impl == "transformer_engine",
        normalization=tc.normalization, qk_l2_norm=tc.qk_l2_norm, vp_stage=vp_stage)
    check_sequence_parallel_norms(tc, block)
    return block
