"""Megatron args -> mHC configs, through Megatron's own ``argument_utils``.

``core_transformer_config_from_args(args, config_class)`` copies every args attribute that
is named like a field of ``config_class``, so the mHC flags land in
:class:`~mhc_megatron.config.MHCTransformerConfig` as they are, and its validation (with its
clear refusals) runs there, on every rank, before any process group exists.
"""

from __future__ import annotations

import contextlib

from mhc_megatron.config import MHCMLATransformerConfig, MHCTransformerConfig
from mhc_megatron.training.arguments import apply_mhc_argument_aliases
from mhc_megatron.training.spec import mhc_block_spec


@contextlib.contextmanager
def _mla_config_class(config_class):
    """Make Megatron's helper build ``config_class`` for MLA models.

    ``core_transformer_config_from_args`` replaces whatever class it is given with
    ``megatron.core.transformer.MLATransformerConfig`` when ``--multi-latent-attention`` is
    set, looking that name up at call time; for the duration of the call the name points
    to our MLA config. Scoped, restored on exit, and the result's type is checked.
    """
    import megatron.core.transformer as mct

    original = mct.MLATransformerConfig
    mct.MLATransformerConfig = config_class
    try:
        yield
    finally:
        mct.MLATransformerConfig = original


def mhc_transformer_config_from_args(args) -> MHCTransformerConfig:
    """``args`` (from ``parse_and_validate_args(extra_args_provider=add_mhc_arguments)``) ->
    :class:`MHCTransformerConfig`, or :class:`MHCMLATransformerConfig` with
    ``--multi-latent-attention``."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    apply_mhc_argument_aliases(args)
    if not getattr(args, "multi_latent_attention", False):
        return core_transformer_config_from_args(args, config_class=MHCTransformerConfig)
    with _mla_config_class(MHCMLATransformerConfig):
        config = core_transformer_config_from_args(args)
    if not isinstance(config, MHCMLATransformerConfig):
        raise RuntimeError(
            "megatron.training.argument_utils.core_transformer_config_from_args no longer picks "
            "its MLA config class by name, so the mHC fields were dropped. Fix: build "
            "MHCMLATransformerConfig yourself for this Megatron version.")
    return config


def mhc_gpt_model_config_from_args(args):
    """Megatron's ``gpt_config_from_args`` with the mHC transformer config and, unless
    ``--spec`` names another, :func:`~mhc_megatron.training.spec.mhc_block_spec`: an
    ``MHCGPTModelConfig`` (a ``GPTModelConfig`` whose builder gives multi-token prediction mHC
    layers) for ``pretrain_cfg_container_from_args(args, model_cfg)``."""
    from megatron.training.argument_utils import gpt_config_from_args

    from mhc_megatron.training.model import MHCGPTModelConfig

    model_cfg = gpt_config_from_args(args, config=mhc_transformer_config_from_args(args),
                                     model_config_cls=MHCGPTModelConfig)
    if getattr(args, "spec", None) is None:
        model_cfg.transformer_layer_spec = mhc_block_spec
    return model_cfg


def mhc_hybrid_model_config_from_args(args):
    """Megatron's ``hybrid_config_from_args`` with the mHC transformer config and, unless
    ``--spec`` names another, the hybrid stack spec of
    :func:`~mhc_megatron.specs.hybrid.get_hybrid_stack_with_mhc_spec` for that config
    (Megatron's TE ``hybrid_stack_spec`` with mHC layers when ``--transformer-impl
    transformer_engine``, Megatron's local modules otherwise): a ``HybridModelConfig`` for
    ``pretrain_cfg_container_from_args(args, model_cfg)``, built by Megatron's
    ``HybridModelBuilder``.

    Megatron's own builder needs nothing else: multi-token prediction (``/`` in the pattern)
    is built from the spec's ``mtp_block_spec``, which the mHC spec gives mHC layers and a
    stream-contracting norm; ``|`` pipeline stages carry the ``[s, b, n*C]`` streams. Needs
    ``--hybrid-layer-pattern`` (Megatron derives ``num_layers`` from it). ``--sequence-parallel``
    with norms that refuse it (Megatron's torch norm, e.g. ``--transformer-impl local`` without
    Apex) is a ValueError that names the fix, as for GPT.
    """
    from megatron.training.argument_utils import hybrid_config_from_args

    from mhc_megatron.specs.gpt import check_sequence_parallel_norms
    from mhc_megatron.specs.hybrid import get_hybrid_stack_with_mhc_spec

    if getattr(args, "hybrid_layer_pattern", None) is None:
        raise ValueError(
            "mhc_hybrid_model_config_from_args: --hybrid-layer-pattern is not set, so there is "
            "no hybrid model to build. Fix: pass --hybrid-layer-pattern (e.g. '*-*-': attention "
            "and MLP layers), or build a GPT with mhc_gpt_model_config_from_args.")
    transformer_config = mhc_transformer_config_from_args(args)
    model_cfg = hybrid_config_from_args(args, config=transformer_config)
    if getattr(args, "spec", None) is None:
        spec = get_hybrid_stack_with_mhc_spec(
            transformer_config,
            use_transformer_engine=transformer_config.transformer_impl == "transformer_engine")
        check_sequence_parallel_norms(transformer_config, spec)
        model_cfg.hybrid_stack_spec = spec
    return model_cfg
