"""mHC from Megatron's own training loop (``megatron.training``, shipped in the megatron-core wheel).

Both of Megatron-Core 0.19's entry styles:

* argparse: ``args = parse_and_validate_args(extra_args_provider=add_mhc_arguments)``, then
  ``model_cfg = mhc_gpt_model_config_from_args(args)`` and Megatron's own
  ``pretrain_cfg_container_from_args(args, model_cfg)`` / ``pretrain(...)``;
* config container: ``MHCGPTModelConfig(transformer=MHCTransformerConfig(...),
  transformer_layer_spec=mhc_block_spec, ...)`` (Megatron's ``GPTModelConfig`` works too, but
  its builder gives multi-token prediction Megatron's plain layers).

Hybrid models (Megatron's ``HybridModel``, ``--hybrid-layer-pattern``): ``model_cfg =
mhc_hybrid_model_config_from_args(args)``, a ``HybridModelConfig`` for Megatron's own
``HybridModelBuilder`` whose ``hybrid_stack_spec`` is the mHC one
(:func:`~mhc_megatron.specs.hybrid.get_hybrid_stack_with_mhc_spec`); the mHC flags apply as
for GPT, and the MTP depths of a ``/`` pattern are mHC layers through that spec.

``examples/pretrain_gpt_mhc.py`` is a complete pretraining script built on these (a GPT, or
a hybrid model with ``--hybrid-layer-pattern``). With
``--mhc-params-dtype fp32`` in a bf16/fp16 run, Megatron-Core 0.19.2's optimisers need
:mod:`mhc_megatron.training.fp32_params` to checkpoint the fp32 mapping parameters: the
script runs ``pretrain`` inside ``fp32_params_in_megatron_training()`` (the same for a
hybrid model: the fix is in the optimiser, whatever the model).
"""

from mhc_megatron.training.arguments import add_mhc_arguments, apply_mhc_argument_aliases
from mhc_megatron.training.config import (
    mhc_gpt_model_config_from_args,
    mhc_hybrid_model_config_from_args,
    mhc_transformer_config_from_args,
)
from mhc_megatron.training.model import MHCGPTModelBuilder, MHCGPTModelConfig
from mhc_megatron.training.fp32_params import (
    fp32_params_in_megatron_training,
    make_fp32_params_checkpointable,
)
from mhc_megatron.training.spec import mhc_block_spec

__all__ = [
    "MHCGPTModelBuilder",
    "MHCGPTModelConfig",
    "add_mhc_arguments",
    "apply_mhc_argument_aliases",
    "fp32_params_in_megatron_training",
    "mhc_block_spec",
    "mhc_gpt_model_config_from_args",
    "mhc_hybrid_model_config_from_args",
    "mhc_transformer_config_from_args",
    "make_fp32_params_checkpointable",
]
