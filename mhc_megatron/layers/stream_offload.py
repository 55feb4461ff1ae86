"""Fine-grained activation offloading of the n residual streams (Megatron's ``offload_modules``).

In Megatron's own layer, ``"attn_norm"`` / ``"mlp_norm"`` in ``offload_modules`` offload what
the norm saves (its input, which is also the residual) and, right after the bias-dropout-add,
release the residual's GPU storage (``forced_released_tensors=[residual]``). Under mHC the
norm's input is the aggregate ``y [s, b, C]``, and the real residual is the n streams
``x [s, b, n*C]``, saved for backward by the mHC ops ("pre" and "combine"): n times the bytes
of a plain residual, the tensors most worth offloading. So with ``attn_norm`` (``mlp_norm``)
each self-attention (MLP/MoE) sublayer's input streams get an offload group of their own,
``"mhc_attn_streams"`` (``"mhc_mlp_streams"``), next to Megatron's norm group (which still
offloads and releases ``y``):

* pre runs under :meth:`StreamOffload.deferring`: each tensor it saves that is a view of the
  streams' storage is saved as a reference to one shared copy of the streams (nothing else
  changes: pre's other saved tensors, the per-token mappings, stay on the GPU);
* :meth:`StreamOffload.start` (on ``y``, before Megatron's sublayer) opens the group, as
  Megatron's norm group opens on its input, and puts the streams into it, once;
* :meth:`StreamOffload.combine` (in the bias-dropout-add slot) runs the combine under the
  same reference hooks, then commits the group with ``forced_released_tensors=[streams]``
  exactly where Megatron's layer releases its residual: the streams are copied to the CPU
  once and their GPU storage is freed, if (and only if) Megatron offloads the group (its
  policy: ``min_offloaded_tensor_size``, the last layer kept, ``activation_offload_fraction``).
  No other saved tensor holds that storage, so the release cannot corrupt a saved tensor.

In backward, the first use of the streams (an identity node right after the combine) takes
the reloaded copy out of the group; pre and combine then read views of that one tensor, and
it is freed with their saved tensors. Why these points: Megatron reloads ahead from a stack
of groups in commit order (each group start's backward reloads the top) and waits for a
reload only in the group's commit backward, so a group must be emptied before a later start's
backward can reach it. Opened on ``y`` (upstream of the whole sublayer, Megatron's norm group
included), committed before the norm group and emptied right after its own commit backward,
the streams' group keeps that order in Megatron's warmup step and in its steady state (one
layer ahead) alike. Values are moved, never recomputed, and the ops are the same: loss and
gradients are bitwise those without offloading.

Not combined with ``mhc_recompute`` (refused by the config): the recompute replays a block
from its input streams, whose storage the forced release frees.
"""

from __future__ import annotations

from torch import Tensor, autograd, is_grad_enabled
from torch.autograd.graph import saved_tensors_hooks

from mhc_megatron.config import STREAM_OFFLOAD_MODULES

# Offload group of a sublayer's input streams, per Megatron offload module that enables it
# (the modules the config validates): "attn_norm" -> "mhc_attn_streams", and so on.
STREAM_OFFLOAD_GROUPS = {m: f"mhc_{m.removesuffix('_norm')}_streams"
                         for m in STREAM_OFFLOAD_MODULES}


def stream_offload_group(config, norm_module: str) -> str | None:
    """The offload group name of the streams before the sublayer of ``norm_module``
    ("attn_norm" or "mlp_norm"), or None when that module is not offloaded. Megatron skips
    its own norm group where the norm is fused into the next linear (TE's LayerNormLinear);
    the streams are offloaded regardless: they exist either way."""
    if not getattr(config, "fine_grained_activation_offloading", False):
        return None
    if norm_module not in (getattr(config, "offload_modules", None) or []):
        return None
    return STREAM_OFFLOAD_GROUPS[norm_module]


def _offload_api():
    # Lazy, as in Megatron's transformer_layer.py (transformer <-> pipeline_parallel imports).
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface,
        PipelineOffloadManager,
    )

    return FineGrainedActivationOffloadingInterface, PipelineOffloadManager


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # subclasses without storage
        return None


def _owns_storage(t: Tensor) -> bool:
    """``t`` is contiguous and spans its whole storage (so every saved view of the storage
    is a view of ``t``, and a reloaded contiguous copy of ``t`` can stand in for it)."""
    try:
        return (t.numel() > 0 and t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class _SharedStreams:
    """The one saved copy of a sublayer's input streams: the tensor itself until it is put
    into the offload group, then the group's tag, and after the reload the reloaded tensor
    (alive while a saved view of it is)."""

    __slots__ = ("tensor", "tag", "manager", "ptr", "dtype", "device")

    def __init__(self, streams: Tensor):
        self.tensor = streams
        self.tag = None
        self.manager = None
        self.ptr, self.dtype, self.device = _storage_ptr(streams), streams.dtype, streams.device

    def holds(self, t) -> bool:
        """``t`` is a view of the streams' storage (only asked while the streams are alive)."""
        return (isinstance(t, Tensor) and t.dtype == self.dtype and t.device == self.device
                and _storage_ptr(t) == self.ptr)

    def put(self, manager) -> None:
        """Hand the streams to ``manager``'s current offload group (inside its context)."""
        self.tag = manager.on_save_for_backward(self.tensor)
        self.manager = manager
        self.tensor = None  # the group holds the only saved reference now

    def get(self) -> Tensor:
        if self.tensor is None:
            self.tensor = self.manager.on_get_saved_tensor(self.tag)  # reloaded (or as was)
            self.tag = self.manager = None
        return self.tensor


class _StreamsView:
    """What autograd saves instead of a view of the streams: the shared copy + the view."""

    __slots__ = ("streams", "size", "stride", "offset")

    def __init__(self, streams: _SharedStreams, t: Tensor):
        self.streams = streams
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()

    def resolve(self) -> Tensor:
        return self.streams.get().as_strided(self.size, self.stride, self.offset)


def _unpack(saved):
    return saved.resolve() if isinstance(saved, _StreamsView) else saved


class _TakeStreams(autograd.Function):
    """Identity on the combine's output whose backward takes the reloaded streams out of the
    offload group: after the group's commit backward (which waits for a prefetched reload),
    before any op of the sublayer reads them."""

    @staticmethod
    def forward(ctx, out, streams):
        ctx.streams = streams
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.streams.get()
        ctx.streams = None
        return grad, None


class StreamOffload:
    """Offload of one sublayer call's input streams; see the module docstring for the flow."""

    def __init__(self, group: str, streams: Tensor):
        self.group = group
        self.shared = _SharedStreams(streams)
        self._streams = streams  # what the commit releases
        self._interface = None

    @classmethod
    def begin(cls, group: str | None, streams: Tensor) -> "StreamOffload | None":
        """A :class:`StreamOffload` for ``streams``, or None: no group configured, no grad
        (nothing is saved), or streams that do not own their storage (never the case for the
        layer's own streams; then they are simply not offloaded)."""
        if group is None or not is_grad_enabled() or not _owns_storage(streams):
            return None
        return cls(group, streams)

    def _pack(self, t):
        return _StreamsView(self.shared, t) if self.shared.holds(t) else t

    def deferring(self):
        """Saved-tensor hooks for pre and combine: views of the streams are saved as
        references to the shared copy; every other tensor is saved as usual."""
        return saved_tensors_hooks(self._pack, _unpack)

    def start(self, hidden_states: Tensor) -> Tensor:
        """Open the streams' group on the sublayer input ``y`` and put the streams into it.
        Returns ``y`` through Megatron's group-start identity (whose backward prefetches)."""
        interface_cls, manager_cls = _offload_api()
        self._interface = interface_cls(True, hidden_states, self.group)
        with self._interface as hidden_states:
            manager = manager_cls.get_instance()
            if getattr(manager, "inside_context", False):  # offloading active for this chunk
                self.shared.put(manager)
        return hidden_states

    def combine(self, run_combine, output_with_bias):
        """``run_combine(output_with_bias)`` under the reference hooks, then commit the group
        with the streams as ``forced_released_tensors`` (as Megatron's layer its residual)."""
        with self.deferring():
            out = run_combine(output_with_bias)
        streams, self._streams = self._streams, None
        out = _TakeStreams.apply(out, self.shared)
        if self._interface is None:  # start() never ran: nothing to commit
            return out
        return self._interface.group_offload(out, forced_released_tensors=[streams])
