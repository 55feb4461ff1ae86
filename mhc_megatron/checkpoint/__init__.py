"""Checkpoint interchange: moving mHC weights between model layouts."""

from mhc_megatron.checkpoint.gpt_to_hybrid import (
    gpt_hybrid_layer_pattern,
    gpt_layout_sharded_state_dict,
    gpt_to_hybrid_key,
    gpt_to_hybrid_state_dict,
    load_gpt_checkpoint_into_hybrid,
)

__all__ = [
    "gpt_hybrid_layer_pattern",
    "gpt_layout_sharded_state_dict",
    "gpt_to_hybrid_key",
    "gpt_to_hybrid_state_dict",
    "load_gpt_checkpoint_into_hybrid",
]
