"""Layer, block and stack specs that add mHC to Megatron-Core models (GPT and hybrid)."""

from mhc_megatron.specs.gpt import (
    get_gpt_decoder_block_with_mhc_spec,
    get_gpt_layer_with_mhc_local_spec,
    get_gpt_layer_with_mhc_te_spec,
    get_gpt_mtp_block_with_mhc_spec,
    to_mhc_layer_spec,
    with_mhc_block_spec,
)
from mhc_megatron.specs.hybrid import (
    get_hybrid_stack_local_spec,
    get_hybrid_stack_with_mhc_spec,
    to_mhc_hybrid_layer_spec,
    to_mhc_hybrid_stack_spec,
)

__all__ = [
    "get_gpt_decoder_block_with_mhc_spec",
    "get_gpt_layer_with_mhc_local_spec",
    "get_gpt_layer_with_mhc_te_spec",
    "get_gpt_mtp_block_with_mhc_spec",
    "get_hybrid_stack_local_spec",
    "get_hybrid_stack_with_mhc_spec",
    "to_mhc_hybrid_layer_spec",
    "to_mhc_hybrid_stack_spec",
    "to_mhc_layer_spec",
    "with_mhc_block_spec",
]
