"""mHC layers and stack for Megatron-Core's ``HybridModel`` (``megatron/core/models/hybrid``).

A ``HybridStack`` builds one layer per symbol of ``hybrid_layer_pattern``, and every layer
is **one residual sublayer**: ``*`` attention, ``+`` MLA, ``D`` DeepSeek sparse attention and
``G`` gated delta net are ``TransformerLayer``s without an MLP, ``-`` is an ``MLPLayer`` and
``E`` a ``MoETransformerLayer`` without attention, ``M`` a ``MambaLayer``. Each gets its own
hyper-connection around its sublayer, exactly as a GPT layer's attention and MLP get theirs, so
a GPT layer (two sublayers) is two hybrid layers (``*-``, or ``*E`` for MoE) with the same
parameters and the same math:

* :class:`HybridHyperConnectionLayer` (``*``, ``+``, ``D``, ``G``),
  :class:`HyperConnectionMLPLayer` (``-``), :class:`HyperConnectionMoETransformerLayer` (``E``):
  :class:`~mhc_megatron.layers.transformer_layer.HyperConnectionTransformerLayer` on Megatron's
  layer class, with a hyper-connection for the present sublayer only
  (``self_attention_hyper_connection`` or ``mlp_hyper_connection``);
* :class:`HyperConnectionMambaLayer` (``M``): Megatron's ``MambaLayer`` with
  ``mixer_hyper_connection``, its combine in the ``mamba_bda`` slot.

The residual state between layers is ``[s, b, n*C]`` (stream-major). The stack's global layer 1
(whatever its symbol) expands the embeddings ``[s, b, C]``, and :class:`MHCHybridStack`'s final
norm contracts the streams (:class:`~mhc_megatron.layers.streams.StreamContractingNorm`). Each
multi-token-prediction depth's inner stack (Megatron builds a plain ``HybridStack`` without a
final norm for it, numbering its layers from 1) expands in its layer 1 and is contracted by
the MTP layer's norm. With pipeline stages (``|``) the boundaries carry ``[s, b, n*C]``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Union

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import MoETransformerLayer
from torch import Tensor

from mhc_megatron.config import hyper_connections_enabled
from mhc_megatron.layers.hyper_connection import HyperConnectionModule
from mhc_megatron.layers.streams import StreamContractingNorm
from mhc_megatron.layers.transformer_layer import (
    HyperConnectionTransformerLayer,
    _StreamCombine,
    recompute_scope,
    refuse_pipelined_inference,
    require_mhc_config,
    run_sublayer,
    streams_in,
)
from mhc_megatron.recompute.manager import manager_for


class HybridHyperConnectionLayer(HyperConnectionTransformerLayer):
    """A hybrid stack's ``TransformerLayer`` (one sublayer) with its hyper-connection.

    Expands the streams in the stack's layer 1 only: Megatron numbers a hybrid stack's layers
    globally from 1 (``layer_number = i + 1 + pp_layer_offset``), and each MTP depth's inner
    stack from 1 again, so unlike a GPT MTP layer, ``is_mtp_layer`` does not mean "first".
    """

    def _expands_streams(self) -> bool:
        return self.layer_number == 1


class HyperConnectionMLPLayer(HybridHyperConnectionLayer, MLPLayer):
    """Megatron's ``MLPLayer`` (``-``) with a hyper-connection around its MLP."""


class HyperConnectionMoETransformerLayer(HybridHyperConnectionLayer, MoETransformerLayer):
    """Megatron's ``MoETransformerLayer`` (``E``) with a hyper-connection around its MoE."""


@dataclass
class HyperConnectionMambaLayerSubmodules(MambaLayerSubmodules):
    """``MambaLayerSubmodules`` plus the hyper-connection around the mixer."""

    mixer_hyper_connection: Union[ModuleSpec, type] = HyperConnectionModule


class HyperConnectionMambaLayer(MambaLayer):
    """Megatron's ``MambaLayer`` (``M``) whose residual is an mHC hyper-connection.

    ``MambaLayer.forward`` does ``out = mixer(norm(h))`` then ``mamba_bda(out, residual=h)``;
    this layer hands it the aggregate ``y = sum_i H_pre[i] x_i`` of the streams and fills the
    ``mamba_bda`` slot with the expand-combine, as
    :class:`~mhc_megatron.layers.transformer_layer.HyperConnectionTransformerLayer` does for
    attention and MLP. Input ``[s, b, n*C]`` (``[s, b, C]`` in the stack's layer 1), output
    ``[s, b, n*C]``; with mHC off it is Megatron's layer.
    """

    def __init__(self, config, submodules: MambaLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.mhc_enabled = hyper_connections_enabled(config)
        if not self.mhc_enabled:
            return
        require_mhc_config(config)
        spec = getattr(submodules, "mixer_hyper_connection", HyperConnectionModule)
        self.n = config.num_residual_streams
        self.mixer_hyper_connection = build_module(spec, config=config)
        self.mamba_bda = _StreamCombine(self.mixer_hyper_connection)
        self.mhc_recompute_manager = manager_for(config)
        if self.mhc_recompute_manager is not None:
            self.mamba_bda.watch_input_reader(self.norm, self.mixer)
        self.mhc_chunk_offset = 0  # set by MHCHybridStack to its pipeline segment's offset

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if not self.mhc_enabled:
            return super().forward(hidden_states, *args, **kwargs)
        refuse_pipelined_inference(self.config, kwargs)
        streams = streams_in(hidden_states, self.n, self.config.hidden_size,
                             expands=self.layer_number == 1)
        with recompute_scope(self):
            return run_sublayer(super().forward, self.mixer_hyper_connection, self.mamba_bda,
                                streams, *args, **kwargs)


# Layers whose mixer needs a package Megatron imports optionally: symbol -> (what, packages,
# how to install). Checked before any layer is built, on every rank.
_OPTIONAL_PACKAGES = {
    Symbols.MAMBA: ("Mamba ('M') layers", ("mamba_ssm", "causal_conv1d"),
                    "pip install --no-build-isolation mamba-ssm causal-conv1d (needs CUDA)"),
    Symbols.GDN: ("Gated delta net ('G') layers", ("fla",),
                  "pip install flash-linear-attention"),
}


# Pattern symbol -> the HybridStackSubmodules field that builds it.
SYMBOL_FIELDS = {
    Symbols.MAMBA: "mamba_layer", Symbols.GDN: "gdn_layer", Symbols.ATTENTION: "attention_layer",
    Symbols.DS_ATTENTION: "dsa_layer", Symbols.MLA: "mla_layer", Symbols.MLP: "mlp_layer",
    Symbols.MOE: "moe_layer",
}


def check_layer_specs(layer_types, submodules: HybridStackSubmodules) -> None:
    """Refuse a pattern symbol whose layer the stack spec does not build (``IdentityOp``:
    Megatron would silently build an identity layer there)."""
    for symbol in sorted(set(layer_types)):
        field = SYMBOL_FIELDS.get(symbol)
        if field is not None and getattr(submodules, field) is IdentityOp:
            raise ValueError(
                f"hybrid_layer_pattern has '{symbol}' layers, but this stack spec builds no "
                f"{field} (it is IdentityOp). Fix: use a spec that builds it (e.g. the "
                "Transformer Engine spec, get_hybrid_stack_with_mhc_spec(config, "
                "use_transformer_engine=True); 'E' needs num_moe_experts in the config of the "
                f"local spec), or drop '{symbol}' from the pattern.")


def check_layer_packages(layer_types) -> None:
    """Raise ``ImportError`` naming the package (and how to install it) for each Mamba or GDN
    layer in ``layer_types`` whose package does not import here."""
    for symbol, (what, packages, install) in _OPTIONAL_PACKAGES.items():
        if symbol not in layer_types:
            continue
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        if missing:
            raise ImportError(
                f"{what} need the package(s) {', '.join(missing)}, which are not installed. "
                f"Fix: {install}, or drop '{symbol}' from hybrid_layer_pattern.")


@dataclass
class MHCHybridStackSubmodules(HybridStackSubmodules):
    """``HybridStackSubmodules`` plus the norm the stack's final norm wraps (Megatron's
    ``HybridStack`` always builds ``TENorm``; the local-module spec gives Megatron's torch
    norm, so the stack builds without Transformer Engine)."""

    final_norm: Union[ModuleSpec, type, None] = None


class MHCHybridStack(HybridStack):
    """Megatron's ``HybridStack`` whose final norm contracts the ``[s, b, n*C]`` streams.

    Constructor arguments are ``HybridStack``'s. The final norm is a
    :class:`~mhc_megatron.layers.streams.StreamContractingNorm` around
    ``submodules.final_norm`` (``TENorm`` when None, as Megatron's stack); its parameters
    appear as ``final_norm.norm.*``. Layers are built by Megatron's constructor; this class
    refuses Mamba / GDN layers whose packages are missing before it, and numbers the mHC
    recompute blocks from this pipeline segment's first layer.
    """

    contracts_streams = True  # read by the layers' build-time check of their stack

    def __init__(self, config, submodules: HybridStackSubmodules, pre_process: bool = True,
                 layer_type_list=None, pp_layer_offset: int = 0, post_layer_norm: bool = True,
                 post_process: bool = True, **kwargs) -> None:
        check_layer_specs(layer_type_list or (), submodules)
        check_layer_packages(layer_type_list or ())
        super().__init__(config, submodules, pre_process=pre_process,
                         layer_type_list=layer_type_list, pp_layer_offset=pp_layer_offset,
                         post_layer_norm=False, post_process=post_process, **kwargs)
        self.post_layer_norm = post_layer_norm
        for layer in self.layers:
            if hasattr(layer, "mhc_chunk_offset"):
                layer.mhc_chunk_offset = pp_layer_offset
        if post_process and post_layer_norm:
            norm = getattr(submodules, "final_norm", None)
            if norm is None:
                from megatron.core.extensions.transformer_engine import TENorm as norm
            self.final_norm = StreamContractingNorm(
                norm, config=self.config, hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon)
