"""MHCRecomputeManager: cross-layer recompute of the mHC activations.

mHC keeps the residual as ``n`` streams ``[s, b, n*C]``; every sublayer's streams are saved
for backward (by the next sublayer's "pre" and "combine"), i.e. ``n`` times a plain
residual. With ``mhc_recompute=True`` the decoder's layers are grouped into blocks of
``config.mhc_recompute_block_size`` layers (``mhc_recompute_layer_num``, default eq. 20 of
the paper: ``round(sqrt(n L / (n + 2)))``). Inside a block, the outputs of the mHC ops
(the aggregate ``y`` of "pre", the expand-combine; layer 1's stream expansion is a view of
the embeddings, nothing to recompute) are not kept: each tensor that autograd would save and
that is (a view of) such an output is replaced by a placeholder. The first time backward
unpacks a placeholder of a block, one hook recomputes the block's mHC ops in forward order
(each op's inputs are the block's input streams, already-recomputed outputs, and what is
kept anyway: sublayer outputs ``f`` after dropout, parameters) and hands out the recomputed
tensors. What stays stored per block: its input streams, plus per sublayer the sublayer
output ``f`` (which the combine's backward needs in any case) and pre's per-token mappings
(``h_pre``, ``h_post``, ``h_res``: ``2n + n^2`` fp32 values a token, 1/340 of the streams at
n=4, C=4096 in bf16), so that the replay of pre is its aggregate alone, not the projection
over the streams and Sinkhorn. The sublayers (attention, MLP/MoE) are not recomputed here;
Megatron's own selective recompute can still run inside them.

Mechanism: autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``,
the same mechanism as ``torch.utils.checkpoint``'s non-reentrant mode), matching saved
tensors to recorded op outputs by their storage. Only three kinds of call save such outputs:
pre and the combine (the streams) and the module of the sublayer that reads ``y``. The hooks
are therefore on only around those (:class:`SublayerSaving`): from pre until the module that
alone reads ``y`` has returned (only over pre where that module's call was seen to save no
``y`` itself: Megatron's torch RMSNorm on a 16-bit ``y`` saves the fp32 copy it makes), and
around the combine; the rest of the sublayer's body (its linears, attention, an MoE layer's
hundreds of saved tensors) saves without them, so without a Python call per saved tensor.
That module is the sublayer's input norm, or, where Transformer Engine fuses the norm into
the first linear (the layer's norm is ``IdentityOp``), that linear of an attention, MLP or
Mamba / gated-delta-net mixer (:func:`~mhc_megatron.layers.transformer_layer.input_reader`).
Without one (an MoE layer without its own norm, whose router and dispatcher both read ``y``;
Megatron's ``layernorm`` selective recompute, whose checkpoint saves ``y`` after the norm
returns) the hooks stay on over the whole sublayer. Where the host replay extension is built
the hooks are its C++ ``SavedRanges`` (no Python frame for a tensor that is no recorded
output; a hit becomes a C++ ``Placeholder``, resolved in C++), else the same lookup in Python
(:class:`_AddressRanges`; ``MHC_RECOMPUTE_NATIVE_HOOKS=0`` or :func:`set_native_hooks`
chooses it). With the C++ hooks a block also replays from C++ (:meth:`_BlockState.recompute`):
each recorded op keeps a description of its arguments there, a Python replay of an op (or of
a fused pair) that ran one recorded kernel recipe on them teaches a replay site, and a block
whose needed ops all have sites replays them as one C++ call, without the ops' Python (the
same recipes on the same tensors; ``MHC_RECOMPUTE_NATIVE_REPLAY=0`` or
:func:`set_native_replay` turns it off). With the C++ hooks on top of autograd's hook stack, the
ops' C++ autograd nodes save every tensor past the hooks (torch's
``SavedTensorDefaultHooks::set_tracing``, the switch Dynamo uses, hides them for that one
save): one that is no registered output (pre's parameters and mappings, the combine's ``f``
and mappings) as autograd saves without hooks (the pack hook would keep it as it is), a
registered output (the streams) with the block's placeholder as C++ saved-tensor hooks (what
the pack hook would make): no Python call for it when saving nor when unpacking. It therefore
does not use Megatron's ``CheckpointWithoutOutput`` and has none of its pitfalls: no fp8
context is entered, op arguments may be any Python values, and outputs that need no gradient
are fine (a tensor nobody saves is never recomputed).

Numerics: the ops are deterministic (Triton kernels: bitwise; reference: same op
sequence), and the recompute replays them on the same inputs, so gradients with and
without recompute are identical.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mhc_megatron.kernels import host_replay, loaded_ops

_ACTIVE_BLOCK: contextvars.ContextVar["_BlockState | None"] = contextvars.ContextVar(
    "mhc_active_recompute_block", default=None)


class _OutputView(NamedTuple):
    """A (view of an) output of op ``op`` of a block: ``outputs[op][index]`` seen with
    ``size``/``stride``/``offset``. (A named tuple: one is made for every recorded argument
    and every placeholder, in the forward's host path.)"""

    op: int
    index: int
    size: tuple
    stride: tuple
    offset: int

    def resolve(self, outputs: dict) -> torch.Tensor:
        """The view of the recomputed output; the output itself where the view is all of
        it."""
        out = outputs[self.op][self.index]
        if self.offset == 0 and out.shape == self.size and out.stride() == self.stride:
            return out
        return out.as_strided(self.size, self.stride, self.offset)


class _Placeholder:
    """What autograd stores instead of a saved tensor that is an ``_OutputView`` of its
    ``block`` (with the Python ranges; the C++ ranges make the extension's ``Placeholder``, the
    same in C++): unpacking it recomputes the block (once) and resolves the view.

    Reference structure (no cycles, so a block is freed by reference counting as soon as its
    graph is, never left to the cyclic garbage collector with its tensors): the autograd graph
    holds placeholders, a placeholder holds its block, and the block holds only plain data:
    op arguments as ``_OutputView``s or detached tensors (no ``grad_fn``, so no path back
    into the graph), and the recomputed outputs."""

    __slots__ = ("block", "view")

    def __init__(self, block: "_BlockState", view: _OutputView):
        self.block = block
        self.view = view

    def unpack(self) -> torch.Tensor:
        """The saved tensor, recomputed (with its block, once)."""
        return self.view.resolve(self.block.recompute())


class _AddressRanges:
    """The storages of a block's recorded op outputs by address range, in Python (where the
    host replay extension is not built; else its ``SavedRanges``, the same decisions in C++):
    ``add`` registers an output (``add_outputs``: those of a recorded op that own their
    storage), ``lookup`` finds the output a tensor is (a view of), ``record`` records an op
    (its arguments packed, its outputs registered), ``recorded_ops`` lists them, ``pack`` is
    the block's saved-tensor pack hook (a :class:`_Placeholder` for a hit, whose op joins
    ``packed_ops``), ``entries`` lists ``(op, index, expired)``.

    The address ranges are sorted by start: a saved tensor whose data pointer falls in none of
    them (most of a sublayer's, e.g. an MoE layer's hundreds) is rejected with one bisect,
    without building a storage weakref. A range that a new registration overlaps has expired
    (live storages do not overlap) and is dropped then, so the range a pointer falls in is the
    only one that can hold it."""

    def __init__(self, block_ref: weakref.ref):
        self.block_ref = block_ref
        self._ops: list[tuple[Callable, tuple, dict, set[int]]] = []  # (fn, packed, kwargs, deps)
        self.packed_ops: set[int] = set()  # the ops with an output replaced by a placeholder
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, StorageWeakRef, tuple[int, int, torch.dtype]]] = []
        self.full_lookups = 0  # saved tensors that needed more than the address-range check

    def add(self, out: torch.Tensor, op: int, index: int) -> None:
        storage = out.untyped_storage()
        key = StorageWeakRef(storage)
        start = storage.data_ptr()
        end = start + storage.nbytes()
        i = bisect.bisect_right(self._starts, start)
        # ranges the new storage overlaps belong to freed storages: drop them
        lo = i
        while lo > 0 and self._ranges[lo - 1][1] > start:
            lo -= 1
        hi = i
        while hi < len(self._ranges) and self._ranges[hi][0] < end:
            hi += 1
        self._starts[lo:hi] = [start]
        self._ranges[lo:hi] = [(start, end, key, (op, index, out.dtype))]

    def lookup(self, t: torch.Tensor) -> tuple[int, int] | None:
        try:
            ptr = t.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # subclasses without storage
            return None
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        _, end, key, (op, index, dtype) = self._ranges[i]
        if ptr >= end:
            return None
        self.full_lookups += 1
        try:  # the registered storage itself (its weak reference keeps its address unique)
            same = t.untyped_storage()._cdata == key.cdata
        except (RuntimeError, NotImplementedError, TypeError):  # subclasses without storage
            return None
        if not same or key.expired() or t.dtype != dtype:
            return None
        return op, index

    def record(self, fn: Callable, args: tuple, kwargs: dict, outputs) -> None:
        """Record op ``fn(*args, **kwargs)``, which returned ``outputs``, as the next op: its
        arguments packed (each tensor that is (a view of) a registered output as an
        :class:`_OutputView`, every other tensor detached: the replay runs without grad, and
        the block holds no reference into the autograd graph; other values as they are), the
        ops of those outputs its dependencies; then its outputs registered
        (:meth:`add_outputs`)."""
        packed, deps = [], set()
        for a in args:
            found = self.lookup(a) if isinstance(a, torch.Tensor) else None
            if found is not None:
                deps.add(found[0])
                packed.append(_OutputView(*found, tuple(a.shape), tuple(a.stride()),
                                          a.storage_offset()))
            else:
                packed.append(a.detach() if isinstance(a, torch.Tensor) else a)
        op = len(self._ops)
        self._ops.append((fn, tuple(packed), kwargs, deps))
        self.add_outputs(outputs, op)

    @property
    def recorded(self) -> int:
        """How many ops are recorded."""
        return len(self._ops)

    def recorded_ops(self, view_type=None) -> list[tuple[Callable, tuple, dict, set[int]]]:
        """The recorded ops, ``(fn, packed args, kwargs, deps)`` each (``view_type``: the C++
        ranges' signature; the views here are :class:`_OutputView` already)."""
        return self._ops

    def add_outputs(self, outputs, op: int) -> None:
        """Register the outputs of op ``op`` (a tensor, or a tuple of them and other values)
        that own their whole storage: a placeholder is rebuilt as a view of the recomputed
        tensor with the saved tensor's size, stride and offset."""
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        for index, out in enumerate(outs):
            if (isinstance(out, torch.Tensor) and out.storage_offset() == 0
                    and out.is_contiguous()
                    and out.untyped_storage().nbytes() == out.numel() * out.element_size()):
                self.add(out, op, index)

    def pack(self, t: torch.Tensor):
        found = self.lookup(t)
        if found is None:
            return t
        block = self.block_ref()
        if block is None:  # (the block is gone: the tensor itself)
            return t
        op, index = found
        self.packed_ops.add(op)
        return _Placeholder(block, _OutputView(op, index, tuple(t.shape), tuple(t.stride()),
                                               t.storage_offset()))

    def entries(self) -> list[tuple[int, int, bool]]:
        return [(op, index, key.expired()) for _, _, key, (op, index, _) in self._ranges]


def _unpack_saved(obj):
    """The Python unpack hook: a tensor as it is; a placeholder resolves itself."""
    return obj.unpack() if isinstance(obj, _Placeholder) else obj


_NATIVE_HOOKS = os.environ.get("MHC_RECOMPUTE_NATIVE_HOOKS", "1") != "0"


def set_native_hooks(enabled: bool) -> None:
    """The blocks' saved-tensor hooks in C++ (the host replay extension's ``SavedRanges``,
    where it is built) or in Python (:class:`_AddressRanges`), for blocks opened from now on
    (``MHC_RECOMPUTE_NATIVE_HOOKS=0`` at start-up: Python)."""
    global _NATIVE_HOOKS
    _NATIVE_HOOKS = bool(enabled)


def native_hooks() -> bool:
    return _NATIVE_HOOKS


_NARROW_HOOKS = os.environ.get("MHC_RECOMPUTE_NARROW_HOOKS", "1") != "0"


def set_narrow_hooks(enabled: bool) -> None:
    """The blocks' saved-tensor hooks only where mHC outputs are saved (pre, the module that
    reads ``y``, the combine: :class:`SublayerSaving`), or on over each whole sublayer
    (``MHC_RECOMPUTE_NARROW_HOOKS=0`` at start-up), for sublayers run from now on. Both
    replace the same saved tensors; the whole-sublayer scope calls the pack hook for every
    tensor the sublayer saves."""
    global _NARROW_HOOKS
    _NARROW_HOOKS = bool(enabled)


def narrow_hooks() -> bool:
    return _NARROW_HOOKS


_NATIVE_REPLAY = os.environ.get("MHC_RECOMPUTE_NATIVE_REPLAY", "1") != "0"


def set_native_replay(enabled: bool) -> None:
    """The blocks' replays from C++ by their ops' replay sites (where the C++ hooks are on;
    :meth:`_BlockState.recompute`), or always in Python (``MHC_RECOMPUTE_NATIVE_REPLAY=0`` at
    start-up), for blocks replayed from now on."""
    global _NATIVE_REPLAY
    _NATIVE_REPLAY = bool(enabled)


def native_replay() -> bool:
    return _NATIVE_REPLAY


def _hooks():
    """``(ranges type, unpack hook)`` of a new block: the extension's ``SavedRanges`` and
    ``unpack_saved`` where the native hooks are on and the extension is built, else the Python
    ones."""
    if _NATIVE_HOOKS:
        ext = host_replay.extension()
        if ext is not None:
            return ext.SavedRanges, ext.unpack_saved
    return _AddressRanges, _unpack_saved


class _BlockState:
    """The recorded mHC ops of one block of layers during one forward pass."""

    def __init__(self, manager: "MHCRecomputeManager", block_id: tuple[int, int]):
        self.manager = manager
        self.block_id = block_id
        self.last_layer = 0
        ranges, self.unpack_hook = _hooks()
        self.ranges = ranges(weakref.ref(self))
        # the C++ ranges: their placeholders read the outputs there, and ops replay from C++
        self.native = ranges is not _AddressRanges
        self.pack_hook = self.ranges.pack  # one bound method: the hooks' stack holds it
        self.outputs: dict[int, tuple] | None = None
        enabled = torch.is_autocast_enabled("cuda")  # (the dtype only matters where enabled)
        self.autocast = (enabled, torch.get_autocast_dtype("cuda") if enabled else None)

    @property
    def packed_ops(self) -> set[int]:
        """The ops with an output the pack hook replaced by a placeholder."""
        return self.ranges.packed_ops

    # -- forward
    def record(self, fn: Callable, args: tuple, kwargs: dict, outputs) -> None:
        """Record op ``fn(*args, **kwargs)``, which returned ``outputs``, in the block's
        ranges: its arguments (outputs of earlier ops as views of them, other tensors
        detached), and its outputs registered, so that tensors saved from them are
        recomputed."""
        self.ranges.record(fn, args, kwargs, outputs)

    # -- backward
    def recompute(self) -> dict:
        """Recompute the needed ops of the block once, in forward order: with the C++ ranges
        by the ops' replay sites from C++ where every needed op has one
        (``SavedRanges.replay_native``: the outputs stay there, where the placeholders read
        them), else in Python, where each op (or fused pair) that ran one recorded kernel
        recipe on its arguments teaches its site (:meth:`_learn`). Returns the outputs the
        Python placeholders read (empty after a replay from C++)."""
        if self.outputs is not None:
            return self.outputs
        _register_kernel_fusions()
        generation = self._replay_generation()
        if generation is not None:
            done = self.ranges.replay_native(generation, hash(self.autocast))
            if done is not None:
                self.outputs = {}
                self.manager.blocks_recomputed += 1
                self.manager.blocks_replayed_natively += 1
                self.manager.ops_recomputed += done[0]
                self.manager.replays_fused += done[1]
                return self.outputs
        ops = self.ranges.recorded_ops(_OutputView)
        needed = set(self.packed_ops)
        for op in range(len(ops) - 1, -1, -1):
            if op in needed:
                needed |= ops[op][3]
        outputs: dict[int, tuple] = {}
        enabled, dtype = self.autocast
        autocast = (torch.autocast("cuda", dtype=dtype) if enabled
                    else contextlib.nullcontext())
        with torch.no_grad(), autocast:
            for op in sorted(needed):
                if op in outputs:  # replayed with the op before it (_replay_fused)
                    continue
                fn, args, kwargs, _ = ops[op]
                args = [a.resolve(outputs) if isinstance(a, _OutputView) else a for a in args]
                runs = None if generation is None else []
                with contextlib.nullcontext() if runs is None else host_replay.observing(runs):
                    flat = self._replay_fused(ops, op, args, kwargs, needed, outputs)
                    if flat is None:
                        out = fn(*args, **kwargs)
                        outputs[op] = out if isinstance(out, tuple) else (out,)
                if runs:
                    self._learn(op, flat, args, runs, outputs, generation)
        self.outputs = outputs
        if self.native:
            self.ranges.set_outputs(outputs)
        self.manager.blocks_recomputed += 1
        self.manager.ops_recomputed += len(needed)
        return outputs

    def _replay_generation(self) -> int | None:
        """The launch plans' generation the replay sites are learned and used at, or None
        where this block's ops replay in Python only (the Python ranges, the native replay
        off, op calls not replayed from C++ now)."""
        if not (self.native and _NATIVE_REPLAY):
            return None
        global _native_autograd
        if _native_autograd is None:  # (imported on first use: it imports the Triton ops)
            from mhc_megatron.kernels import native_autograd as _native_autograd
        return _native_autograd.replay_generation()

    def _learn(self, op: int, flat: list | None, args: list, runs: list, outputs: dict,
               generation: int) -> None:
        """Teach the C++ ranges the replay site of op ``op`` (with the next op where ``flat``,
        the arguments of a fused pair, is not None; else ``args``) from its Python replay,
        where that ran exactly one recorded recipe (``runs``: what
        :func:`~mhc_megatron.kernels.host_replay.observing` saw) whose
        inputs are all of them the op's arguments themselves and whose returned tensors are
        the op's outputs themselves. Else nothing: the op keeps replaying in Python."""
        if len(runs) != 1 or runs[0] is None:
            return
        recipe, inputs, scratch, returned = runs[0]
        pair = flat is not None
        flat = flat if pair else args
        tensors = [id(a) for a in flat if isinstance(a, torch.Tensor)]
        if scratch or len(set(tensors)) != len(tensors):  # (an argument twice: positions)
            return
        positions = []
        for t in inputs:
            pos = next((i for i, a in enumerate(flat) if a is t), None)
            if pos is None:  # an input the op made (a copy, a cast)
                return
            positions.append(pos)
        outs = (outputs[op], outputs[op + 1]) if pair else (outputs[op],)
        where = {id(t): k for k, t in enumerate(returned)}
        slots = [(-1, -1)] * len(returned)
        for which, tup in enumerate(outs):
            for index, t in enumerate(tup):
                k = where.get(id(t)) if isinstance(t, torch.Tensor) else None
                if k is None or slots[k] != (-1, -1):
                    return
                slots[k] = (which, index)
        self.ranges.learn(op, pair, recipe.rid, recipe.device, positions, slots,
                          [len(t) for t in outs], flat, generation, hash(self.autocast))

    def _replay_fused(self, ops: list, op: int, args: list, kwargs: dict, needed: set,
                      outputs: dict) -> list | None:
        """Replay op ``op`` of ``ops`` (the ranges' ``recorded_ops``) together with op
        ``op + 1`` through a registered fusion
        (:func:`register_replay_fusion`) when the next op is needed, is the fusion's second
        function, and takes this op's first output as its first argument (any view of it:
        the fusion decides from the view's geometry). When done (both outputs stored), the
        pair's arguments: ``args`` and the next op's after its first; else None."""
        fusion = _REPLAY_FUSIONS.get(ops[op][0])
        nxt = op + 1
        if fusion is None or nxt not in needed:
            return None
        fn2, args2, kwargs2, _ = ops[nxt]
        view = args2[0] if args2 else None
        if (fn2 is not fusion.second or not isinstance(view, _OutputView) or view.op != op
                or view.index != 0
                or any(isinstance(a, _OutputView) and a.op == op for a in args2[1:])):
            return None
        rest = [a.resolve(outputs) if isinstance(a, _OutputView) else a for a in args2[1:]]
        done = fusion.fused(args, kwargs, (view.size, view.stride, view.offset), rest, kwargs2)
        if done is None:
            return None
        outputs[op], outputs[nxt] = done
        self.manager.replays_fused += 1
        return [*args, *rest]


class MHCRecomputeManager:
    """Groups a decoder's layers into recompute blocks and records their mHC ops.

    One manager is shared by the layers built from one config (:func:`manager_for`).
    Each :class:`HyperConnectionTransformerLayer` runs its forward inside
    :meth:`layer_scope`; its hyper-connection ops go through :func:`run_recorded`.
    ``blocks_recomputed`` / ``ops_recomputed`` / ``replays_fused`` count the backward hooks
    work (for tests and logs).
    """

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"MHCRecomputeManager: block_size must be an int >= 1, got "
                             f"{block_size!r}. Fix: set mhc_recompute_layer_num >= 1 or None.")
        self.block_size = block_size
        # The open block, weakly: between its layers the block is kept alive by the
        # placeholders autograd holds (every layer's mHC outputs are saved by the next op),
        # and once its graph is freed (after backward) nothing keeps its recomputed tensors.
        # Should it die mid-block (nothing of it saved), the next layer opens a new one.
        self._current: weakref.ref | None = None
        self.blocks_recomputed = 0
        self.blocks_replayed_natively = 0  # of those, replayed from C++ (their replay sites)
        self.ops_recomputed = 0
        self.replays_fused = 0  # pairs of ops replayed as one (register_replay_fusion)

    def block_of(self, layer_number: int, chunk_offset: int = 0) -> tuple[int, int]:
        """Block of a global (1-based) layer number: ``(chunk_offset, index)``, blocks counted
        from the first layer of the layer's pipeline chunk (``chunk_offset`` = that layer's
        global number - 1), so that no block spans a pipeline-stage boundary."""
        return chunk_offset, (layer_number - 1 - chunk_offset) // self.block_size

    def _state_for(self, layer_number: int, chunk_offset: int = 0) -> _BlockState:
        block = self.block_of(layer_number, chunk_offset)
        cur = self._current() if self._current is not None else None
        # A new block starts at a block boundary, and a new forward pass (the layer numbers
        # go back to the start) starts new blocks too.
        if cur is None or cur.block_id != block or layer_number <= cur.last_layer:
            cur = _BlockState(self, block)
            self._current = weakref.ref(cur)
        cur.last_layer = layer_number
        return cur

    def layer_scope(self, layer_number: int, chunk_offset: int = 0) -> "_LayerScope":
        """A context to run one layer's forward in, in its block (only with grad on; it gives
        the block, or None): its mHC ops are recorded, and each sublayer turns the block's
        saved-tensor hooks on where needed (:func:`sublayer_saving`)."""
        return _LayerScope(self, layer_number, chunk_offset)

    def reset(self) -> None:
        """Forget the open block (the next layer opens a new one)."""
        self._current = None


class _LayerScope:
    """:meth:`MHCRecomputeManager.layer_scope`: the layer's block active from entry to exit
    (a class rather than a generator context: entered once per layer of every step)."""

    __slots__ = ("_manager", "_layer", "_offset", "_token")

    def __init__(self, manager: MHCRecomputeManager, layer_number: int, chunk_offset: int):
        self._manager, self._layer, self._offset = manager, layer_number, chunk_offset
        self._token = None

    def __enter__(self) -> _BlockState | None:
        if not torch.is_grad_enabled():
            return None
        state = self._manager._state_for(self._layer, self._offset)
        self._token = _ACTIVE_BLOCK.set(state)
        return state

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _ACTIVE_BLOCK.reset(self._token)
            self._token = None


_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
# (pack, unpack) on top of autograd's hook stack; a torch without it (older releases) keeps
# the hooks on over the whole sublayer, popped at its end as saved_tensors_hooks does
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class ReaderWatch:
    """A sublayer's reader of ``y`` (its input norm or fused first linear) as
    :class:`SublayerSaving` watches it: ``saves``, per ``(dtype of y, autocast state)``, whether
    its call saved ``y`` (learned from its first call under that key), and the layer's forward
    hook ``hook`` on ``module`` (it tells the sublayer's :class:`SublayerSaving` that the
    reader returned), registered only while it is needed: a call to watch or a reader that
    saves ``y``. (A module with a forward hook takes ``nn.Module``'s slower call path.)"""

    __slots__ = ("saves", "_module", "_hook", "_handle")

    def __init__(self, module: torch.nn.Module, hook: Callable):
        self.saves: dict = {}
        self._module = module
        self._hook = hook
        self._handle = module.register_forward_hook(hook)

    def hooked(self, on: bool) -> None:
        """The forward hook registered (``on``) or removed."""
        if on and self._handle is None:
            self._handle = self._module.register_forward_hook(self._hook)
        elif not on and self._handle is not None:
            self._handle.remove()
            self._handle = None


class SublayerSaving:
    """The active block's saved-tensor hooks over one residual sublayer: on from its
    creation (before pre), off once ``y``'s reader has saved it (:meth:`reader_returned`,
    called by the forward hook of the sublayer's input norm or fused first linear), or right
    after pre where that reader was seen to save no ``y`` itself (:meth:`pre_done`), on
    around the combine (:meth:`on` / :meth:`off`), off at :meth:`close` (the end of the
    sublayer, also on an exception).

    With :func:`set_narrow_hooks` off the hooks stay on until :meth:`close`. Hooks another
    context pushed on top of these and has not popped yet are never popped
    here: :meth:`off` then leaves the hooks on (the sublayer saves through them as if no
    reader had been found), and :meth:`close` raises, since that context left its hooks on
    past the sublayer."""

    __slots__ = ("_pack", "_unpack", "_on", "_narrow", "_block", "_watching")

    def __init__(self, block: _BlockState):
        self._pack = block.pack_hook
        self._unpack = block.unpack_hook
        self._on = False
        # else on until close (set_narrow_hooks, or a torch that cannot show its stack's top)
        self._narrow = _NARROW_HOOKS and _top_hooks is not None
        self._block = block
        self._watching = None  # (reader.saves, key, y's op) while the reader's saves are watched
        self.on()

    def pre_done(self, reader: ReaderWatch | None, dtype: torch.dtype) -> None:
        """Pre has returned and recorded ``y`` (of ``dtype``), the block's last op. The hooks
        are on over the sublayer's ``reader`` of ``y`` (None: none is watched) only to turn
        its saves of ``y`` into placeholders; ``reader.saves`` says, per ``(dtype, the
        block's autocast state)``, whether its call made any. Where it made none (Megatron's
        torch RMSNorm on a 16-bit ``y`` saves the fp32 copy it makes, not ``y``), the hooks go
        off now, and the reader runs without its forward hook: its saves then cost no Python
        call each way, and its saved tensors are the same. Not known yet: this call is
        watched (:meth:`reader_returned`). A reader that would save ``y`` where it was seen
        not to (its behaviour changed under the same key) keeps ``y`` stored: more memory,
        the same results."""
        if reader is None or not self._narrow:
            return
        key = (dtype, self._block.autocast)
        saves = reader.saves.get(key)
        if saves is False:
            reader.hooked(False)
            self.off()
            return
        reader.hooked(True)
        if saves is None:
            self._watching = (reader.saves, key, self._block.ranges.recorded - 1)

    def reader_returned(self) -> None:
        """The sublayer's reader of ``y`` has returned: the hooks off; where its call was
        watched (:meth:`pre_done`), whether it saved ``y`` (a placeholder of pre's op) noted."""
        watching = self._watching
        if watching is not None:
            self._watching = None
            saves, key, op = watching
            saves[key] = op in self._block.packed_ops
        self.off()

    def on(self) -> None:
        if not self._on:
            _push_hooks(self._pack, self._unpack)
            self._on = True

    def _on_top(self) -> bool:
        top = _top_hooks(True)
        return top is not None and top[0] is self._pack

    def off(self) -> None:
        if self._on and self._narrow and self._on_top():
            _pop_hooks()
            self._on = False

    def close(self) -> None:
        if not self._on:
            return
        if _top_hooks is not None and not self._on_top():
            raise RuntimeError(
                "mhc_recompute: saved-tensor hooks pushed inside an mHC sublayer (by "
                "torch.autograd.graph.saved_tensors_hooks or a checkpoint / offload context) "
                "were still on when the sublayer returned, so the block's own hooks cannot be "
                "popped. Fix: close that context inside the sublayer's forward.")
        _pop_hooks()
        self._on = False


def sublayer_saving() -> SublayerSaving | None:
    """A :class:`SublayerSaving` of the active recompute block, hooks on; None outside a
    block (no ``mhc_recompute``, grad off)."""
    state = _ACTIVE_BLOCK.get()
    if state is None or not torch.is_grad_enabled():
        return None
    return SublayerSaving(state)


# The recompute block open in this context, or None (the context variable's own ``get``: a
# call without a Python frame, for the ops' hot paths to skip :func:`record_as` outside blocks)
active_recompute_block = _ACTIVE_BLOCK.get


def run_recorded(fn: Callable, *args: Any, **kwargs: Any):
    """``fn(*args, **kwargs)``; inside a recompute block its outputs are recorded so that the
    tensors autograd saves from them are recomputed in backward instead of kept."""
    out = fn(*args, **kwargs)
    record_as(out, fn, *args, **kwargs)
    return out


def record_as(outputs, fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Inside a recompute block: the tensors autograd saves from ``outputs`` (already
    computed) are recomputed in backward as ``fn(*args, **kwargs)``, which must give the same
    bits. Lets an op recompute only its large outputs from small ones that are kept (pre: ``y``
    from ``h_pre`` by the aggregate alone, not the projection and Sinkhorn again)."""
    state = _ACTIVE_BLOCK.get()
    if state is not None and torch.is_grad_enabled():
        state.record(fn, args, kwargs, outputs)


@dataclass(frozen=True)
class _ReplayFusion:
    second: Callable
    fused: Callable


_REPLAY_FUSIONS: dict[Callable, _ReplayFusion] = {}
_native_autograd = None  # mhc_megatron.kernels.native_autograd, once a block replays natively


def register_replay_fusion(first: Callable, second: Callable, fused: Callable) -> None:
    """Let the replay run a recorded ``first`` op and the ``second`` op recorded right after
    it, whose first argument is (a view of) ``first``'s first output, as one call:
    ``fused(first_args, first_kwargs, (size, stride, offset), second_rest_args,
    second_kwargs)`` (the geometry is that of the view ``second`` took; ``second_rest_args``
    its other arguments) returns ``(first_outputs, second_outputs)`` as tuples, bit for bit
    what the two calls return, or None where it cannot (then the two ops run apart). The
    kernel backends' own fusions are registered here by the replay itself
    (:func:`_register_kernel_fusions`; the Triton backend's: combine, then the next pre's
    aggregate, without reading the combine's output back)."""
    _REPLAY_FUSIONS[first] = _ReplayFusion(second, fused)


def _register_kernel_fusions() -> None:
    """Register the replay fusion of every kernel backend loaded so far that has one
    (``MHCOps.replay_combine_aggregate``: its combine and its aggregate). Runs before each
    block's replay: the ops a block recorded were loaded in its forward."""
    for ops in loaded_ops():
        if ops.replay_combine_aggregate is not None and ops.combine not in _REPLAY_FUSIONS:
            register_replay_fusion(ops.combine, ops.aggregate, ops.replay_combine_aggregate)


_MANAGERS: dict[int, MHCRecomputeManager] = {}


def manager_for(config) -> MHCRecomputeManager | None:
    """The manager shared by the layers built with ``config`` (None without mhc_recompute)."""
    if not getattr(config, "mhc_recompute", False):
        return None
    key = id(config)
    manager = _MANAGERS.get(key)
    if manager is None:
        manager = _MANAGERS[key] = MHCRecomputeManager(config.mhc_recompute_block_size)
        weakref.finalize(config, _MANAGERS.pop, key, None)
    return manager
