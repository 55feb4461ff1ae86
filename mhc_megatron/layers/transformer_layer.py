"""HyperConnectionTransformerLayer: Megatron's TransformerLayer with mHC residuals.

Each layer has two residual sublayers (self-attention, MLP/MoE) and one
:class:`HyperConnectionModule` for each. The residual state between layers is
``[s, b, n*C]`` (stream-major); global layer 1 expands the embeddings ``[s, b, C]``: its
first sublayer reads them as n equal streams through a view
(:func:`~mhc_megatron.layers.streams.broadcast_streams`), and its combine writes the first
``[s, b, n*C]``; with the streams offloaded (``attn_norm`` in ``offload_modules``) it
materialises them (:func:`~mhc_megatron.layers.streams.expand_streams`).

How it hooks into Megatron-Core 0.19 without copying its layer logic:
``TransformerLayer._forward_attention`` / ``_forward_mlp`` do
``out = sublayer(norm(h))`` and then ``h = bda(training, fused)(out, residual=h, p)``.
Our overrides of those two methods compute the mappings and the aggregated input
``y = sum_i H_pre[i] x_i``, hand ``y`` to Megatron's method as its ``hidden_states`` and
arm a :class:`_StreamCombine` that sits in the ``self_attn_bda`` / ``mlp_bda`` slot: when
Megatron calls the bias-dropout-add it gets ``x' = H_res x + H_post^T dropout(f + bias)``
instead of ``y + dropout(f + bias)``. Everything else Megatron does around the sublayer
(selective recompute of layernorm / MLP / core attention, MoE un-flattening, the final
``make_viewless_tensor``) runs unchanged; CUDA graphs, the legacy ``cpu_offloading``
and fused-TP inference are refused by the config. Megatron's MoE EP-overlap schedule runs a
layer as separate nodes; an mHC MoE layer's nodes are built by
:mod:`~mhc_megatron.layers.fine_grained`.

Fine-grained activation offloading runs as in Megatron's layer; with ``"attn_norm"`` /
``"mlp_norm"`` in ``offload_modules`` each sublayer's input streams (the real residual,
``[s, b, n*C]``) are offloaded in a group of their own and force-released right after the
combine, where Megatron releases its residual (:mod:`mhc_megatron.layers.stream_offload`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Union

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from torch import Tensor

from mhc_megatron._logging import log_rank0
from mhc_megatron.config import MHCTransformerConfig, hyper_connections_enabled
from mhc_megatron.layers.hyper_connection import HyperConnectionModule, StreamMappings
from mhc_megatron.layers.stream_offload import StreamOffload, stream_offload_group
from mhc_megatron.layers.streams import (
    StreamContractingNorm,
    broadcast_streams,
    expand_streams,
)
from mhc_megatron.recompute.manager import (
    ReaderWatch,
    SublayerSaving,
    manager_for,
    sublayer_saving,
)

logger = logging.getLogger(__name__)
_said_mhc_off = False

SEQUENCE_PARALLEL_NORM_ERROR = (
    "sequence_parallel (--sequence-parallel) needs norms that support it, but this spec builds "
    "Megatron's torch norm WrappedTorchNorm, which refuses it: Megatron's local modules "
    "(--transformer-impl local, use_transformer_engine=False) use it for RMSNorm, and for "
    "LayerNorm where Apex is not installed (Megatron's own GPT spec fails the same). Fix: "
    "install Transformer Engine and use its spec (--transformer-impl transformer_engine, "
    "use_transformer_engine=True), or drop --sequence-parallel (sequence_parallel=False)."
)

BLOCK_SPEC_FIX = (
    "Fix: pass the decoder *block* spec, e.g. GPTModel(config, "
    "get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=...), ...), or "
    "with_mhc_block_spec(your_block_spec); its final norm contracts the n streams"
)


@dataclass
class HyperConnectionTransformerLayerSubmodules(TransformerLayerSubmodules):
    """``TransformerLayerSubmodules`` plus one hyper-connection mapping per sublayer."""

    self_attention_hyper_connection: Union[ModuleSpec, type] = HyperConnectionModule
    mlp_hyper_connection: Union[ModuleSpec, type] = HyperConnectionModule


class _StreamCombine:
    """Fills Megatron's bias-dropout-add slot with the mHC expand-combine.

    Megatron calls ``bda(training, fused)(output_with_bias, residual, prob)``. The layer
    ``arm``s this object with the streams and mappings before handing control to
    Megatron; the call then returns ``hyper_connection.combine(streams, output_with_bias,
    ...)`` and ignores ``residual`` (Megatron's residual there is the aggregated input
    ``y``, not the streams). The object holds tensors only between ``arm`` and the call.
    ``offload_group``: the Megatron offload group of the streams (fine-grained activation
    offloading with this sublayer's norm module in ``offload_modules``), or None; when the
    layer arms a :class:`StreamOffload`, the combine runs through it (its commit releases
    the streams, as Megatron's layer releases its residual after the bias-dropout-add).
    With ``mhc_recompute`` the layer arms the sublayer's :class:`SublayerSaving`: the combine
    runs with the block's saved-tensor hooks on, and :meth:`input_read` (the forward hook
    of the module that reads ``y``, :meth:`watch_input_reader`) turns them off.
    """

    def __init__(self, hyper_connection: HyperConnectionModule, offload_group: str | None = None):
        self.hyper_connection = hyper_connection
        self.offload_group = offload_group
        # the sublayer's reader of y, watched (SublayerSaving.pre_done), or None
        self.reader: ReaderWatch | None = None
        self._armed: tuple[Tensor, StreamMappings, StreamOffload | None,
                           SublayerSaving | None] | None = None

    def arm(self, streams: Tensor, mappings: StreamMappings,
            offload: StreamOffload | None = None, saving: SublayerSaving | None = None) -> None:
        self._armed = (streams, mappings, offload, saving)

    def watch_input_reader(self, norm, body, checkpointed: bool = False) -> None:
        """Turn the recompute's hooks off once the module of the sublayer that alone reads
        and saves the aggregate ``y`` has returned (:func:`input_reader` of ``norm``, the
        sublayer's input norm, ``body``, its attention / MLP / mixer, and ``checkpointed``,
        Megatron's ``layernorm`` recompute of that norm): the rest of the body then saves
        without them. Where there is no such module the hooks stay on over the sublayer. A
        reader seen not to save ``y`` itself runs without them, and without this forward hook
        (:meth:`~mhc_megatron.recompute.manager.SublayerSaving.pre_done`)."""
        reader = input_reader(norm, body, checkpointed)
        if reader is not None:
            self.reader = ReaderWatch(reader, self.input_read)

    def input_read(self, module, args, output) -> None:
        armed = self._armed
        if armed is not None and armed[3] is not None:
            armed[3].reader_returned()

    def disarm(self) -> None:
        self._armed = None

    def __call__(self, training: bool, fused: bool):
        return functools.partial(self._combine, training)

    def _combine(self, training, output_with_bias, residual, prob) -> Tensor:
        if self._armed is None:
            raise RuntimeError(
                "mHC combine called outside HyperConnectionTransformerLayer._forward_attention/"
                "_forward_mlp; a Megatron code path bypassed the mHC hooks. Fix: turn off the "
                "feature that runs the sublayers on its own (partial CUDA-graph scopes, fused "
                "inference paths; the config refuses the known ones; the MoE EP-overlap "
                "schedule runs mHC layers through mhc_megatron.layers.fine_grained) and "
                "report the Megatron code path."
            )
        streams, mappings, offload, saving = self._armed
        self._armed = None
        if offload is not None:
            return offload.combine(
                lambda out: self.hyper_connection.combine(streams, out, mappings, prob, training),
                output_with_bias)
        if saving is None:
            return self.hyper_connection.combine(streams, output_with_bias, mappings, prob,
                                                 training)
        saving.on()
        out = self.hyper_connection.combine(streams, output_with_bias, mappings, prob, training)
        saving.off()
        return out


# Sublayer bodies that read their input ``y`` through one first linear alone, by class
# (``module.qualname``, the exact class: a subclass may read ``y`` elsewhere too) -> that
# linear's attribute. Transformer Engine specs fuse the input norm into that linear
# (``TELayerNormColumnParallelLinear``) and leave the layer's norm ``IdentityOp``.
_FIRST_LINEARS = {
    "megatron.core.transformer.attention.SelfAttention": "linear_qkv",
    "megatron.core.transformer.mlp.MLP": "linear_fc1",
    "megatron.core.ssm.mamba_mixer.MambaMixer": "in_proj",
    "megatron.core.ssm.gated_delta_net.gdn.GatedDeltaNet": "in_proj",
}


def input_reader(norm, body, checkpointed: bool = False):
    """The module whose call alone reads and saves a sublayer's input ``y``, or None.

    Megatron's sublayer method hands ``y`` to the input ``norm`` and the norm's output to
    ``body``. The reader is ``norm`` where it is a module of its own (not ``IdentityOp``);
    with ``IdentityOp`` (a Transformer Engine norm fused into the first linear, or no norm)
    ``body``'s first linear where ``body`` reads ``y`` only through it (``_FIRST_LINEARS``:
    ``SelfAttention.linear_qkv``, ``MLP.linear_fc1``, ``MambaMixer.in_proj``,
    ``GatedDeltaNet.in_proj``). None under Megatron's ``layernorm`` recompute
    (``checkpointed``: its checkpoint saves ``y`` after the norm returns) and for other bodies
    (an MoE layer's router and dispatcher both read ``y``; MLA)."""
    if checkpointed:
        return None
    if not isinstance(norm, IdentityOp):
        return norm
    cls = type(body)
    name = _FIRST_LINEARS.get(f"{cls.__module__}.{cls.__qualname__}")
    return None if name is None else getattr(body, name, None)


class HyperConnectionTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose residual connections are mHC hyper-connections.

    Input ``[s, b, n*C]`` (``[s, b, C]`` for global layer 1, which expands it), output
    ``[s, b, n*C]``. With ``enable_hyper_connections=False`` (or a plain
    ``TransformerConfig``) it is exactly Megatron's ``TransformerLayer``: no extra
    parameters, no extra work. Constructor arguments are ``TransformerLayer``'s.
    """

    def __init__(self, config, submodules: TransformerLayerSubmodules, *args, **kwargs):
        try:
            super().__init__(config, submodules, *args, **kwargs)
        except AssertionError as error:  # Megatron's WrappedTorchNorm under sequence parallel
            if "sequence parallel not supported" in str(error):
                raise ValueError(SEQUENCE_PARALLEL_NORM_ERROR) from error
            raise
        self.mhc_enabled = hyper_connections_enabled(config)
        if not self.mhc_enabled:
            _say_mhc_is_off(config)
            return
        require_mhc_config(config)
        if not isinstance(self.cross_attention, IdentityOp):
            raise ValueError(
                "HyperConnectionTransformerLayer: cross_attention is not supported with "
                "hyper-connections. Fix: use a decoder-only spec (cross_attention=IdentityOp)."
            )
        if not isinstance(submodules, HyperConnectionTransformerLayerSubmodules):
            submodules = HyperConnectionTransformerLayerSubmodules(**vars(submodules))
        self.n = config.num_residual_streams
        self.expands_streams = self._expands_streams()
        # A hybrid stack's layers hold one sublayer each (the other is Megatron's IdentityOp,
        # which passes the streams through): only present sublayers get a hyper-connection.
        self.has_attention = not isinstance(self.self_attention, IdentityOp)
        self.has_mlp = not isinstance(self.mlp, IdentityOp)
        if not (self.has_attention or self.has_mlp):
            raise ValueError(
                "HyperConnectionTransformerLayer: both self_attention and mlp are IdentityOp, "
                "so there is no residual sublayer to connect. Fix: give the layer spec an "
                "attention or an MLP/MoE submodule.")
        if self.has_attention:
            self.self_attention_hyper_connection = build_module(
                submodules.self_attention_hyper_connection, config=config)
            self.self_attn_bda = _StreamCombine(self.self_attention_hyper_connection,
                                                stream_offload_group(config, "attn_norm"))
        if self.has_mlp:
            self.mlp_hyper_connection = build_module(submodules.mlp_hyper_connection,
                                                     config=config)
            self.mlp_bda = _StreamCombine(self.mlp_hyper_connection,
                                          stream_offload_group(config, "mlp_norm"))
        if config.overlap_moe_expert_parallel_comm:  # Megatron's fine-grained MoE schedule
            from mhc_megatron.layers import fine_grained

            fine_grained.install()
        self.mhc_recompute_manager = manager_for(config)  # shared by the decoder's layers
        if self.mhc_recompute_manager is not None:
            if self.has_attention:
                self.self_attn_bda.watch_input_reader(self.input_layernorm, self.self_attention,
                                                      self.recompute_input_layernorm)
            if self.has_mlp:
                self.mlp_bda.watch_input_reader(self.pre_mlp_layernorm, self.mlp,
                                                self.recompute_pre_mlp_layernorm)
        # Global number of this pipeline chunk's first layer, minus 1 (0 without PP): recompute
        # blocks are counted from there, so none spans a pipeline-stage (or virtual-chunk)
        # boundary. Megatron passes the chunk-local number and adds the offset itself.
        local_number = kwargs.get("layer_number", args[0] if args else 1)
        self.mhc_chunk_offset = self.layer_number - local_number
        _refuse_block_without_stream_contraction(_enclosing_block())

    def forward(self, *args, **kwargs):
        """Megatron's forward; with ``mhc_recompute`` inside this layer's recompute block."""
        if self.mhc_enabled:
            refuse_pipelined_inference(self.config, kwargs)
        with recompute_scope(self):
            return super().forward(*args, **kwargs)

    def _expands_streams(self) -> bool:
        """Whether this layer's first sublayer takes ``[s, b, C]`` and expands it into the
        streams: global layer 1, and the inner layer of every GPT multi-token-prediction
        depth (numbered by its depth; its input is ``eh_proj``'s ``[s, b, C]``, and the MTP
        layer's final norm contracts)."""
        return self.layer_number == 1 or self.is_mtp_layer

    def _streams_in(self, hidden_states: Tensor) -> Tensor:
        """The streams the layer's first present sublayer reads (see :func:`streams_in`)."""
        combine = self.self_attn_bda if self.has_attention else self.mlp_bda
        return streams_in(hidden_states, self.n, self.config.hidden_size, self.expands_streams,
                          materialise=combine.offload_group is not None)

    def _forward_attention(self, hidden_states: Tensor, *args, **kwargs):
        """Self-attention sublayer on ``[s, b, n*C]`` streams (see module docstring)."""
        if not (self.mhc_enabled and self.has_attention):
            return super()._forward_attention(hidden_states, *args, **kwargs)
        return run_sublayer(
            super()._forward_attention,
            self.self_attention_hyper_connection,
            self.self_attn_bda,
            self._streams_in(hidden_states),
            *args,
            **kwargs,
        )

    def _forward_mlp(self, hidden_states: Tensor, *args, **kwargs):
        """MLP / MoE sublayer on ``[s, b, n*C]`` streams (see module docstring)."""
        if not (self.mhc_enabled and self.has_mlp):
            return super()._forward_mlp(hidden_states, *args, **kwargs)
        return run_sublayer(
            super()._forward_mlp,
            self.mlp_hyper_connection,
            self.mlp_bda,
            hidden_states if self.has_attention else self._streams_in(hidden_states),
            *args,
            **kwargs,
        )

    def get_layer_static_inputs(self, seq_length, micro_batch_size):
        """Static inputs for CUDA-graph capture: ``hidden_states`` is ``[s, b, n*C]``."""
        static_inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        if self.mhc_enabled and not self.expands_streams:
            h = static_inputs["hidden_states"]
            static_inputs["hidden_states"] = torch.ones(
                (*h.shape[:-1], self.n * h.shape[-1]),
                dtype=h.dtype, device=h.device, requires_grad=h.requires_grad,
            )
        return static_inputs


def require_mhc_config(config) -> None:
    """An mHC layer with ``enable_hyper_connections`` needs an mhc-megatron config."""
    if not isinstance(config, MHCTransformerConfig):
        raise TypeError(
            f"enable_hyper_connections needs an mhc_megatron MHCTransformerConfig, got "
            f"{type(config).__name__}. Fix: build the config with "
            "mhc_megatron.config.MHCTransformerConfig (or MHCMLATransformerConfig).")


def refuse_pipelined_inference(config, kwargs: dict) -> None:
    """Megatron's inference wrappers size a pipeline stage's receive buffer
    ``[s, b, hidden_size]`` while an mHC layer hands on ``[s, b, n*C]``: a forward with an
    inference context (``kwargs``, a layer's call) under pipeline parallelism is refused."""
    if config.pipeline_model_parallel_size > 1 and (
            kwargs.get("inference_context") is not None
            or kwargs.get("inference_params") is not None):
        raise ValueError(
            "mHC inference with pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size}: Megatron's inference wrappers size the "
            "stage boundary's receive buffer [s, b, hidden_size], and an mHC model sends its "
            f"{config.num_residual_streams} streams [s, b, n*hidden_size]. Fix: run inference "
            "with pipeline_model_parallel_size=1.")


def recompute_scope(layer):
    """The context an mHC layer's forward runs in: its ``mhc_recompute`` block
    (``layer.mhc_recompute_manager``, blocks counted from ``layer.mhc_chunk_offset``), or
    nothing without ``mhc_recompute`` (or with mHC off)."""
    manager = getattr(layer, "mhc_recompute_manager", None)
    if manager is None:
        return contextlib.nullcontext()
    return manager.layer_scope(layer.layer_number, layer.mhc_chunk_offset)


def streams_in(hidden_states: Tensor, n: int, hidden_size: int, expands: bool,
               materialise: bool = False) -> Tensor:
    """The streams a layer's first sublayer reads.

    ``expands`` (the first layer of a decoder or of an MTP depth): ``hidden_states`` are the
    embeddings ``[s, b, C]``, read as n equal streams through a view
    (:func:`broadcast_streams`), or copied into ``[s, b, n*C]`` (:func:`expand_streams`)
    with ``materialise`` (offloaded streams are force-released after the combine, so they
    need storage of their own, not the embeddings'; offloading excludes ``mhc_recompute``,
    so there is no recompute block to record the copy in). Otherwise the streams
    ``[s, b, n*C]`` as they are.
    """
    if not expands:
        return hidden_states
    if hidden_states.shape[-1] != hidden_size:
        raise ValueError(
            f"layer 1 of an mHC decoder expects the embeddings [s, b, {hidden_size}] (it "
            f"expands them into the {n} streams), got {tuple(hidden_states.shape)}. Fix: feed "
            f"layer 1 hidden states of width hidden_size={hidden_size}; later layers take the "
            f"streams [s, b, {n}*{hidden_size}].")
    return expand_streams(hidden_states, n) if materialise else broadcast_streams(hidden_states, n)


def run_sublayer(parent_method, hyper_connection: HyperConnectionModule,
                 combine: _StreamCombine, streams: Tensor, *args, **kwargs):
    """Aggregate the streams, run Megatron's sublayer method on ``y``, combine.

    ``parent_method(y, *args, **kwargs)`` is Megatron's code for one residual sublayer
    (``TransformerLayer._forward_attention`` / ``_forward_mlp``, ``MambaLayer.forward``); it
    calls ``combine`` where it would call its bias-dropout-add. With the streams' offload
    group configured (``combine.offload_group``), pre saves the streams by reference and the
    group opens on ``y``, before Megatron's sublayer (and its norm group), as Megatron's norm
    group opens on the norm's input; the combine commits it and releases the streams
    (:mod:`~mhc_megatron.layers.stream_offload`). Inside an ``mhc_recompute`` block the
    block's saved-tensor hooks are on from pre until ``y`` is saved and around the combine
    (:class:`~mhc_megatron.recompute.manager.SublayerSaving`).
    """
    saving = sublayer_saving()
    try:
        offload = StreamOffload.begin(combine.offload_group, streams)
        if offload is None:
            y, mappings = hyper_connection.pre(streams)
        else:
            with offload.deferring():
                y, mappings = hyper_connection.pre(streams)
            y = offload.start(y)
        if saving is not None:
            saving.pre_done(combine.reader, y.dtype)
        combine.arm(streams, mappings, offload, saving)
        return parent_method(y, *args, **kwargs)
    finally:
        combine.disarm()
        if saving is not None:
            saving.close()


def _say_mhc_is_off(config) -> None:
    """An mHC layer built without mHC: warn for a plain config (a likely mistake), else log."""
    global _said_mhc_off
    if not isinstance(config, MHCTransformerConfig):
        warnings.warn(
            f"HyperConnectionTransformerLayer built with a plain {type(config).__name__}: it "
            "runs as Megatron's TransformerLayer, with no hyper-connections. Fix: build the "
            "config with mhc_megatron.config.MHCTransformerConfig(enable_hyper_connections=True,"
            " num_residual_streams=...) (MHCMLATransformerConfig for MLA).",
            UserWarning, stacklevel=2)
    elif not _said_mhc_off:
        _said_mhc_off = True
        log_rank0(logger, logging.INFO, "mHC: enable_hyper_connections=False: mHC layer specs "
                  "build Megatron's plain layers (set it True to use mHC)")


def _enclosing_block(max_frames: int = 8):
    """The ``TransformerBlock`` or ``HybridStack`` whose constructor is building this layer,
    or None.

    Megatron builds a block's layers inside ``TransformerBlock.__init__`` (``_build_layers``
    -> ``build_layer`` -> ``build_module`` -> the layer class) and a hybrid stack's inside
    ``HybridStack.__init__`` (-> ``build_module``), where the block is the ``self`` of a
    frame a few levels up. A layer built on its own (tests, hand-made stacks) finds none.
    Read-only: nothing of Megatron's is changed.
    """
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    frame = sys._getframe(2)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, (TransformerBlock, HybridStack)):
            return owner
        frame = frame.f_back
    return None


def _refuse_block_without_stream_contraction(block) -> None:
    """Refuse, at build time, a block whose final norm would get ``[s, b, n*C]`` streams.

    A *layer* spec passed alone to ``GPTModel`` makes Megatron build the block with its plain
    final norm (``TransformerBlockSubmodules(layer_specs=[spec] * L, layer_norm=LayerNormImpl)``),
    which would fail in the first forward with torch's ``normalized_shape`` error; Megatron's
    own ``HybridStack`` always builds a plain ``TENorm`` (an MTP depth's inner stack builds
    none: the MTP layer's norm follows it).
    """
    if block is None or not (block.post_process and block.post_layer_norm):
        return
    if not isinstance(block, TransformerBlock):
        if getattr(block, "contracts_streams", False):
            return
        raise ValueError(
            "mHC layers carry n residual streams [s, b, n*C] to the stack's final norm, but "
            f"this {type(block).__name__} builds Megatron's plain final norm, which takes "
            "[s, b, C]. Fix: build the hybrid model with the mHC stack spec, e.g. "
            "HybridModel(config, get_hybrid_stack_with_mhc_spec(config, "
            "use_transformer_engine=...), ...) (mhc_megatron.specs); its final norm "
            "contracts the n streams.")
    layer_norm = block.submodules.layer_norm
    if layer_norm is None or StreamContractingNorm.is_builder(layer_norm):
        return
    raise ValueError(
        "mHC layers carry n residual streams [s, b, n*C] to the decoder's final norm, but "
        f"this TransformerBlock's final norm ({getattr(layer_norm, '__name__', layer_norm)}) "
        "takes [s, b, C]: a layer spec was given where a block spec is needed (GPTModel "
        "turns a layer spec into a block with Megatron's plain final norm). " + BLOCK_SPEC_FIX
        + "."
    )
