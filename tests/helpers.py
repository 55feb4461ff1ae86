"""Small builders shared by the tests (tiny GPT configs and batches)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mhc_megatron.config import MHCTransformerConfig
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec

VOCAB = 64
SEQ = 16

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(not (HAVE_TE and torch.cuda.is_available()),
                              reason="needs Transformer Engine and a CUDA device")
# Spec families a test runs with: Megatron's local modules everywhere, TE's where installed.
SPEC_FAMILIES = ["local", pytest.param("te", marks=needs_te)]


def tiny_config(**overrides) -> MHCTransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        enable_hyper_connections=True,
        num_residual_streams=4,
        mhc_kernel_backend="reference",
    )
    base.update(overrides)
    return MHCTransformerConfig(**base)


def moe_overrides() -> dict:
    return dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", add_bias_linear=False)


def build_gpt(config, device=None, spec=None, te=False) -> GPTModel:
    spec = spec or get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=te)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    return model.to(device) if device is not None else model


def batch(batch_size=2, seq=SEQ, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(seq).expand(batch_size, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    return [t.to(device) for t in (ids, pos, mask, labels)]


def lm_loss(model, data) -> torch.Tensor:
    ids, pos, mask, labels = data
    return model(ids, pos, mask, labels=labels).float().mean()


def replace(config, **kw):
    return dataclasses.replace(config, **kw)


def sequence_parallel_capable_spec(config, spec=None):
    """The mHC block spec (or ``spec``, a local-modules mHC block spec, e.g. one pipeline
    stage's) with norms that accept sequence_parallel on CPU (no apex/TE)."""
    from mhc_megatron.layers import StreamContractingNorm
    from mhc_megatron.testing.cpu import SequenceParallelTorchNorm

    if spec is None:
        spec = get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=False)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.input_layernorm = SequenceParallelTorchNorm
        layer_spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    spec.layer_norm = StreamContractingNorm.wrapping(SequenceParallelTorchNorm)
    return spec
