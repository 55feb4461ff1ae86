"""Builders for the hybrid-model tests: a GPT mHC model and the equal ``HybridModel``.

A GPT layer is two hybrid layers (``*-``, ``*E`` for MoE, ``+-`` / ``+E`` for MLA), with the same
submodules and names (:mod:`mhc_megatron.checkpoint.gpt_to_hybrid`); the pair built here
shares its weights through that key map.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel

from helpers import SEQ, VOCAB, build_gpt, moe_overrides, tiny_config
from mhc_megatron.checkpoint import gpt_hybrid_layer_pattern, gpt_to_hybrid_state_dict
from mhc_megatron.config import MHCMLATransformerConfig
from mhc_megatron.specs import (
    get_gpt_decoder_block_with_mhc_spec,
    get_hybrid_stack_with_mhc_spec,
)
from mhc_testing.attention import SDPACoreAttention

MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)
KINDS = ("dense", "moe", "mla", "mtp")


def gpt_config(kind: str, **overrides):
    """The GPT config of ``kind`` (2 layers unless overridden); MoE in every layer."""
    extra = dict(overrides)
    if kind == "moe":
        extra = {**moe_overrides(), **extra}
    if kind == "mtp":
        extra.setdefault("mtp_num_layers", 1)
    if kind == "mla":
        base = vars(tiny_config()).copy()
        keep = {k: base[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                     "ffn_hidden_size", "use_cpu_initialization",
                                     "params_dtype", "hidden_dropout", "attention_dropout",
                                     "enable_hyper_connections", "mhc_kernel_backend")}
        return MHCMLATransformerConfig(**{**keep, **MLA, **extra})
    return tiny_config(**extra)


def hybrid_config(gpt_cfg):
    """The hybrid model's config: the GPT's, with one layer per sublayer."""
    return dataclasses.replace(gpt_cfg, num_layers=2 * gpt_cfg.num_layers)


def _sdpa_for_local_mla(layer_specs) -> None:
    """Megatron's local DotProductAttention cannot serve MLA (its k/v head dims differ): the
    GPT tests swap in SDPA; do the same for every MLA layer spec given."""
    for spec in layer_specs:
        attention = getattr(spec.submodules, "self_attention", None)
        if attention is not None and "MLA" in getattr(attention.module, "__name__", ""):
            attention.submodules.core_attention = SDPACoreAttention


def build_gpt_model(cfg, device, te: bool = False) -> GPTModel:
    """:func:`helpers.build_gpt`, with MLA's core attention on SDPA for local specs."""
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=te)
    if cfg.multi_latent_attention and not te:
        _sdpa_for_local_mla(block.layer_specs)
    return build_gpt(cfg, device, block, te)


def build_hybrid_model(cfg, device, pattern: str, te: bool = False, spec=None) -> HybridModel:
    spec = spec or get_hybrid_stack_with_mhc_spec(cfg, use_transformer_engine=te)
    if cfg.multi_latent_attention and not te:
        _sdpa_for_local_mla([spec.submodules.mla_layer])
    return HybridModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope").to(device)


def gpt_and_hybrid(kind: str, device, te: bool = False, **overrides):
    """A GPT mHC model of ``kind`` and the hybrid mHC model with its weights."""
    gcfg = gpt_config(kind, **overrides)
    gpt = build_gpt_model(gcfg, device, te)
    hybrid = build_hybrid_model(hybrid_config(gcfg), device, gpt_hybrid_layer_pattern(gcfg), te)
    hybrid.load_state_dict(gpt_to_hybrid_state_dict(gpt.state_dict()), strict=True)
    return gpt, hybrid


def unit_mappings(model) -> int:
    """n=1 mappings that make every hyper-connection the plain residual: alpha = 0,
    H_pre = sigmoid(40) == 1.0 in fp32, H_post = 2 sigmoid(0) = 1, H_res = 1. Returns how many
    hyper-connections were set."""
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("hyper_connection"):
                assert module.n == 1
                module.alpha.zero_()
                module.bias[0] = 40.0
                module.bias[1] = 0.0
                count += 1
    return count
