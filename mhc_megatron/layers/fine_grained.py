"""mHC layers in Megatron-Core's fine-grained MoE schedule (``overlap_moe_expert_parallel_comm``).

Megatron's combined 1F1B schedule (``pipeline_parallel/combined_1f1b.py``) runs a MoE layer
as five schedule nodes and interleaves two micro-batches' nodes, so that one micro-batch's
expert-parallel all-to-all runs while the other computes. The nodes' callables come from
``megatron.core.models.common.fine_grained_callables.build_layer_callables(layer)``:

1. ``pre_dispatch_computation``: attention, pre-MLP norm, router, dispatch preprocess;
2. ``moe_dispatch``: the dispatch all-to-all;
3. ``mlp``: the routed experts;
4. ``moe_combine``: the combine all-to-all, then the MLP's residual connection;
5. ``mtp_post_process`` (MTP layers only).

Each node runs its own autograd graph: a tensor one node makes and a later node reads crosses
as ``node.detach(t)``, whose gradient the making node's backward receives.

Megatron's GPT callables work for an mHC layer's dense MLP (node 1 calls the layer's
``_forward_attention``, node 3 its ``_forward_mlp``: both take and return the streams
``[s, b, n*C]``). For a MoE MLP they apply the pre-MLP norm to what attention returns and
add the MLP output to it: with mHC that is the streams, and the MLP sublayer needs mHC's
``pre`` (mappings and aggregate) before the norm and its ``combine`` after the combine
all-to-all. :func:`build_mhc_layer_callables` keeps Megatron's dispatch and experts callables
and replaces nodes 1 and 4:

- node 1: attention sublayer (streams in, streams out) -> ``pre`` of the MLP's hyper-connection
  (``y [s, b, C]`` and the mappings) -> pre-MLP norm -> shared experts -> router -> preprocess;
  the streams, ``H_post`` and ``H_res`` cross to node 4 through ``node.detach``;
- node 4: combine all-to-all -> postprocess (+ shared experts) -> mHC ``combine``
  ``H_res x + H_post^T dropout(f)`` -> the decoder's final norm on its last layer.

:func:`install` routes Megatron's ``build_layer_callables`` to this builder for mHC layers
(one wrapper around that module attribute, which Megatron reads at call time; Megatron-Core
0.19 only, see the README's table of what the package touches).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from mhc_megatron.layers.hyper_connection import StreamMappings

SUPPORTED_MEGATRON = ("0.19.",)


def build_mhc_layer_callables(layer):
    """``(forward_funcs, backward_dw)`` of an mHC layer for Megatron's fine-grained schedule,
    as ``build_transformer_layer_callables`` returns them (five forward callables, the
    delayed weight-gradient callables by node name). Dense MLP layers and layers with mHC
    off get Megatron's callables unchanged. What the schedule does not support with mHC
    (``mhc_recompute``, whose blocks need the layer's ``forward``; offloading the MLP's input
    streams; a dense last layer) the config refuses together with
    ``overlap_moe_expert_parallel_comm``."""
    from megatron.core.models.gpt.fine_grained_callables import build_transformer_layer_callables
    from megatron.core.transformer.moe.moe_layer import MoELayer

    forward_funcs, backward_dw = build_transformer_layer_callables(layer)
    if not getattr(layer, "mhc_enabled", False) or not isinstance(layer.mlp, MoELayer):
        return forward_funcs, backward_dw
    forward_funcs = list(forward_funcs)
    forward_funcs[0] = functools.partial(_pre_dispatch, layer)
    forward_funcs[3] = functools.partial(_combine, layer)
    return forward_funcs, backward_dw


def _pre_dispatch(layer, node, hidden_states: Tensor):
    """Node 1 of a MoE mHC layer: the attention sublayer, then the MLP sublayer up to the
    dispatch. ``hidden_states``: the streams ``[s, b, n*C]`` (the embeddings ``[s, b, C]`` for
    a layer that expands them). Returns ``(local_tokens, probs)`` for the dispatch."""
    from megatron.core import tensor_parallel
    from megatron.core.typed_torch import apply_module

    state = node.chunk_state
    streams, _ = layer._forward_attention(
        hidden_states=hidden_states, attention_mask=state.attention_mask,
        rotary_pos_emb=state.rotary_pos_emb, rotary_pos_cos=state.rotary_pos_cos,
        rotary_pos_sin=state.rotary_pos_sin, packed_seq_params=state.packed_seq_params,
        sequence_len_offset=state.sequence_len_offset)
    if not layer.has_attention:  # a layer with a MoE MLP only: its first sublayer expands
        streams = layer._streams_in(hidden_states)
    y, mappings = layer.mlp_hyper_connection.pre(streams)
    norm = apply_module(layer.pre_mlp_layernorm)
    if layer.recompute_pre_mlp_layernorm:  # node 3 discards and recomputes it (Megatron's)
        layer.pre_mlp_norm_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        normed = layer.pre_mlp_norm_checkpoint.checkpoint(norm, y)
    else:
        normed = norm(y)
    if isinstance(normed, tuple):
        raise ValueError(
            "the pre-MLP norm returned (output, residual) (a fused residual norm): an mHC "
            "layer's residual is its streams, which the norm does not see. Fix: use a plain "
            "norm module for pre_mlp_layernorm.")
    shared_expert_output = layer.mlp.shared_experts_compute(normed)
    probs, routing_map = layer.mlp.route(normed)
    local_tokens, probs = layer.mlp.preprocess(normed, probs, routing_map)
    node.layer_state.mhc_streams = node.detach(streams)
    node.layer_state.mhc_h_post = node.detach(mappings.h_post)
    node.layer_state.mhc_h_res = node.detach(mappings.h_res)
    if layer.mlp.use_shared_expert and not layer.mlp.shared_expert_overlap:
        node.layer_state.shared_expert_output = node.detach(shared_expert_output)
    return local_tokens, probs


def _combine(layer, node, output: Tensor):
    """Node 4 of a MoE mHC layer: the combine all-to-all, the MoE's postprocess, then mHC's
    combine of the streams and the MLP output. Returns the streams ``[s, b, n*C]`` (after
    the decoder's final norm on its last layer, as Megatron's callable does)."""
    from megatron.core.transformer.transformer_layer import make_viewless_tensor

    ls = node.layer_state
    streams, h_post, h_res = ls.mhc_streams, ls.mhc_h_post, ls.mhc_h_res
    shared_expert_output = getattr(ls, "shared_expert_output", None)
    output = layer.mlp.combine(output)
    output = layer.mlp.postprocess(output, shared_expert_output)
    with layer.bias_dropout_add_exec_handler():
        hidden_states = layer.mlp_hyper_connection.combine(
            streams, (output, None), StreamMappings(None, h_post, h_res), layer.hidden_dropout,
            layer.training)
    output = make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad,
                                  keep_graph=True)
    if streams.is_cuda:  # made on the compute stream, last read here on the comm stream
        stream = torch.cuda.current_stream()
        for t in (streams, h_post, h_res, shared_expert_output):
            if t is not None:
                t.record_stream(stream)
    ls.mhc_streams = ls.mhc_h_post = ls.mhc_h_res = ls.shared_expert_output = None
    final_layernorm = node.chunk_state.model.decoder.final_layernorm
    if not node.is_mtp and final_layernorm and node.is_last_layer:
        output = final_layernorm(output)
        output = make_viewless_tensor(inp=output, requires_grad=True, keep_graph=True)
    return output


_installed = False


def install() -> None:
    """Route ``megatron.core.models.common.fine_grained_callables.build_layer_callables`` to
    :func:`build_mhc_layer_callables` for mHC layers (also the inner layer of an MTP depth,
    which Megatron's MTP builder passes through the same function); every other layer gets
    Megatron's builder. Idempotent; refuses a Megatron-Core version it was not written for."""
    global _installed
    if _installed:
        return
    import megatron.core
    from megatron.core.models.common import fine_grained_callables as fgc

    version = getattr(megatron.core, "__version__", "")
    if not version.startswith(SUPPORTED_MEGATRON):
        raise RuntimeError(
            f"overlap_moe_expert_parallel_comm with mHC layers supports Megatron-Core "
            f"{SUPPORTED_MEGATRON} (installed: {version or 'unknown'}): its fine-grained "
            "layer callables may differ. Fix: set overlap_moe_expert_parallel_comm=False.")
    megatrons = fgc.build_layer_callables

    @functools.wraps(megatrons)
    def build_layer_callables(layer):
        if getattr(layer, "mhc_enabled", False):
            return build_mhc_layer_callables(layer)
        return megatrons(layer)

    build_layer_callables.mhc_wraps = megatrons
    fgc.build_layer_callables = build_layer_callables
    _installed = True
