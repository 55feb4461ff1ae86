"""Megatron's GPT model config and builder, with mHC layers in multi-token prediction.

Megatron-Core 0.19's ``GPTModelBuilder`` makes the MTP block from Megatron's own decoder layer
spec, whatever ``transformer_layer_spec`` says, so with mHC the MTP depths would be Megatron's
plain layers. ``MHCGPTModelConfig`` is ``GPTModelConfig`` with one change, its ``builder``
(the extension point Megatron's config carries for this: ``gpt_config_from_args(...,
model_config_cls=...)``): :class:`MHCGPTModelBuilder` builds the model with Megatron's builder
and, on the stages that hold MTP, gives it the MTP block of
:func:`~mhc_megatron.specs.get_gpt_mtp_block_with_mhc_spec` (each depth's inner layer an mHC
layer on n streams of its own, contracted by the MTP layer's final norm).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

from mhc_megatron.config import hyper_connections_enabled
from mhc_megatron.specs import get_gpt_mtp_block_with_mhc_spec


@dataclass(kw_only=True)
class MHCGPTModelConfig(GPTModelConfig):
    """``GPTModelConfig`` whose builder gives multi-token prediction mHC layers (see the
    module docstring); no other difference."""

    builder: ClassVar[str] = "mhc_megatron.training.model.MHCGPTModelBuilder"


class MHCGPTModelBuilder(GPTModelBuilder):
    """Megatron's ``GPTModelBuilder``; with mHC and ``mtp_num_layers``, the MTP block of this
    stage is rebuilt from the mHC decoder block spec (same config, stage and process groups
    as Megatron's; the parameters of Megatron's plain MTP block it replaces are dropped before
    anything uses them)."""

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        model = super().build_model(pg_collection, pre_process=pre_process,
                                    post_process=post_process, vp_stage=vp_stage)
        if getattr(model, "mtp_process", False) and hyper_connections_enabled(model.config):
            spec = self._mtp_block_spec(vp_stage)
            model.mtp_block_spec = spec
            model.mtp = MultiTokenPredictionBlock(config=model.config, spec=spec,
                                                  vp_stage=vp_stage,
                                                  pg_collection=model.pg_collection)
            model._setup_mtp_cuda_graphs()  # as GPTModel does right after building its MTP
        return model

    def _mtp_block_spec(self, vp_stage):
        """The mHC MTP block spec for this stage, from the decoder block spec the model was
        built with (resolved as Megatron's builder resolves ``transformer_layer_spec``)."""
        cfg = self._model_config
        block = cfg.transformer_layer_spec
        if block is None:
            raise ValueError(
                "MHCGPTModelConfig: transformer_layer_spec is None, so Megatron builds plain "
                "layers. Fix: set transformer_layer_spec=mhc_megatron.training.mhc_block_spec "
                "(mhc_gpt_model_config_from_args does).")
        if not isinstance(block, ModuleSpec) and callable(block):
            takes_vp = "vp_stage" in inspect.signature(block).parameters
            block = block(cfg, vp_stage=vp_stage) if takes_vp else block(cfg)
        if not getattr(block, "layer_specs", None):
            raise ValueError(
                "MHCGPTModelBuilder: multi-token prediction sits on a pipeline stage without "
                "decoder layers, so there is no mHC layer spec to build its inner layer from. "
                "Fix: give the last pipeline stage at least one decoder layer "
                "(--pipeline-model-parallel-layout / --decoder-last-pipeline-num-layers).")
        use_te = cfg.transformer.transformer_impl == "transformer_engine"
        return get_gpt_mtp_block_with_mhc_spec(cfg.transformer, block, use_te,
                                               vp_stage=vp_stage)
