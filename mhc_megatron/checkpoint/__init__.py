"""Checkpoint interchange: mHC weights between model layouts (GPT -> hybrid) and between the
naming schemes of other checkpoints (Hugging Face, DeepSeek, Megatron-LM), for files and
Megatron distributed checkpoints."""

from mhc_megatron.checkpoint.dist_files import (
    DistCheckpoint,
    read_dist_checkpoint,
    stack_layers,
    unstack_layers,
    write_dist_checkpoint,
)

from mhc_megatron.checkpoint.gpt_to_hybrid import (
    gpt_hybrid_layer_pattern,
    gpt_layout_sharded_state_dict,
    gpt_to_hybrid_key,
    gpt_to_hybrid_state_dict,
    load_gpt_checkpoint_into_hybrid,
)
from mhc_megatron.checkpoint.names import (
    SCHEMES,
    MHCParameter,
    convert_state_dict,
    format_name,
    parse_name,
)

__all__ = [
    "DistCheckpoint",
    "read_dist_checkpoint",
    "stack_layers",
    "unstack_layers",
    "write_dist_checkpoint",
    "MHCParameter",
    "SCHEMES",
    "convert_state_dict",
    "format_name",
    "parse_name",
    "gpt_hybrid_layer_pattern",
    "gpt_layout_sharded_state_dict",
    "gpt_to_hybrid_key",
    "gpt_to_hybrid_state_dict",
    "load_gpt_checkpoint_into_hybrid",
]
