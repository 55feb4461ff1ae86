"""A core-attention stand-in for MLA on machines without Transformer Engine (tests only).

Megatron-Core 0.19's local ``DotProductAttention`` cannot serve multi-latent attention:
MLA builds its core attention with ``k_channels`` / ``v_channels`` (query/key and value
head dims differ), which only TE's attention accepts. This module takes the same
constructor arguments and computes causal softmax attention with
``torch.nn.functional.scaled_dot_product_attention``, so the MLA + mHC path can be
exercised on CPU. It has no parameters and supports no context parallelism or packing.

Shapes: query/key ``[sq, b, heads, dk]``, value ``[sk, b, heads, dv]`` ->
output ``[sq, b, heads*dv]``.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Causal (or masked) SDPA with separate key and value head dims."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention: context_parallel_size > 1 is not supported")
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: packed sequences are not supported")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 dropout_p=self.dropout if self.training else 0.0)
        else:  # Megatron masks are True where attention is NOT allowed.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 scale=self.softmax_scale,
                                                 dropout_p=self.dropout if self.training else 0.0)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
