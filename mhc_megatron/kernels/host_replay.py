"""The ops' host work in C++: an op call's allocations and kernel launches, recorded once and
replayed.

Between its kernels an op call does the same host work every time for the same launch plan
and signature: it allocates the same shapes, and launches the same compiled kernels with the
same grids, constants and tensors in the same argument positions. In Python that work is
most of an op's host time (a ``torch.empty`` is 5-9 us, a launch through Triton's C launcher
5-9 us more with many tensor arguments). Here the first call of each (plan, key) runs the
Python path and records it (:func:`run`): every launch's compiled kernel, grid and
arguments, each tensor argument resolved to one of the call's inputs, its reused scratch
tensors (:class:`~mhc_megatron.kernels.triton_common.Scratch`) or the tensors it allocated.
Later calls hand the recipe to a small C++ extension (``csrc/host_replay.cpp``), which
allocates the tensors with ``at::empty`` and launches the kernels with the driver's
``cuLaunchKernel``: the same kernels on the same arguments, so the same bits. Small returned
tensors that an op names as living and dying together (``shared``) take one allocation
there, each a tensor of its own at an aligned offset.

What a recipe bakes in must be fixed by its key: the op passes the plan (token count, n, C,
tiles, flags) and a key of everything else its launches and allocations depend on (the
signature of its tensor arguments: device, dtypes and alignment, see
:func:`~mhc_megatron.kernels.launch.signature`; its scalar arguments; its variant; the shapes
of the inputs whose shapes its outputs take, as the streams ``[s, b, n*C]`` and the tokens
``[T, n, C]`` share a plan). Inputs are the tensors the op hands its kernels after
its own normalisation (``.contiguous()``, fp32 casts), so a recipe never stands in for a
copy. A recording that meets anything else (a launch through Triton's own launcher, a tensor
that is neither an input, a scratch tensor nor one the op declared it allocated, a kernel
with clusters or scratch memory, an argument type not handled) registers no recipe: that key
keeps the Python path.

Off (the Python path everywhere) with ``MHC_HOST_REPLAY=0``, where the signature is None
(the direct launch path is off, ``torch.compile`` traces, a launch hook is set), while a CUDA
graph is being recorded (recording only; replays are captured as any launch), for triton
versions other than :data:`_TESTED_TRITON`, and where the extension cannot be built (no C++
compiler or ninja: the reason is logged once). The extension is built on first use with
``torch.utils.cpp_extension`` (about 30 s, once per machine: torch caches the build).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import threading
from typing import Callable, Sequence

import torch

from mhc_megatron.kernels import launch as _launch
from mhc_megatron.kernels.log import log_rank0

logger = logging.getLogger(__name__)

# Triton versions whose compiled kernels take exactly the non-constexpr arguments, in order,
# followed by this many pointer parameters (the global and profile scratch): read in their
# nvidia backend's launcher; checked against the driver (cuFuncGetParamInfo) where it has it.
_TESTED_TRITON = {(3, 6): 2}

# A kernel parameter's source: an input of the call, a tensor it allocated, one of its scratch
# tensors, or a constant (csrc/host_replay.cpp's Kind).
INPUT, ALLOCATED, SCRATCH, I32, I64, F32, NULLPTR = range(7)
_TYPES = {"i1": I32, "i8": I32, "i16": I32, "i32": I32, "u1": I32, "u8": I32, "u16": I32,
          "u32": I32, "i64": I64, "u64": I64, "fp32": F32, "f32": F32}
_DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11,
                torch.bfloat16: 15}

_SHARED_ALIGN = 256  # bytes: the offsets of tensors sharing an allocation (Triton's kernels
# were specialised on 16-byte aligned pointers; 256 as the allocator's own blocks)

# the extension's sources (csrc/): the replay, the ops' autograd nodes built on it
# (:mod:`~mhc_megatron.kernels.native_autograd`), and mhc_recompute's saved-tensor hooks and
# block replays (:mod:`mhc_megatron.recompute.manager`)
_SOURCES = ("host_replay.cpp", "autograd_nodes.cpp", "saved_ranges.cpp", "block_replay.cpp")

_ENABLED = os.environ.get("MHC_HOST_REPLAY", "1") != "0"
_extension = None  # the built module, once loaded
_unavailable: str | None = None  # why there is none (set once)
_build_lock = threading.Lock()


def set_enabled(enabled: bool) -> None:
    """Turn the replay on or off in this process (benchmarks compare the two; recipes already
    recorded are kept)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def enabled() -> bool:
    return _ENABLED


def unavailable() -> str | None:
    """Why ops take the Python path in this process, or None if they replay (builds the
    extension if needed)."""
    if not _ENABLED:
        return "MHC_HOST_REPLAY=0"
    if _extension is None and _unavailable is None:
        _load()
    return _unavailable


def extension():
    """The built extension, or None where the ops' host work stays in Python (see
    :func:`unavailable`)."""
    return _extension if unavailable() is None else None


def _load() -> None:
    global _extension, _unavailable
    with _build_lock:
        if _extension is not None or _unavailable is not None:
            return
        reason = _launch.fast_launch_supported()
        if reason is None and _launch._triton_version() not in _TESTED_TRITON:
            reason = f"triton {_launch.triton.__version__} (tested: {sorted(_TESTED_TRITON)})"
        if reason is None and not torch.cuda.is_available():
            reason = "no CUDA device"
        if reason is None:
            try:
                from torch.utils import cpp_extension

                log_rank0(logger, logging.INFO, "mHC: loading the host replay extension (built "
                          "once per machine, about 30 s; torch caches the build)")
                csrc = os.path.join(os.path.dirname(__file__), "csrc")
                sources = [os.path.join(csrc, name) for name in _SOURCES]
                # a release build, as torch's own: NDEBUG drops the debug-only checks of the
                # pybind11 and c10 headers (pybind11's GIL check on every reference count)
                _extension = cpp_extension.load("mhc_host_replay", sources,
                                                extra_cflags=["-O2", "-DNDEBUG"], verbose=False)
            except Exception as error:  # no compiler, no ninja, a failed build
                first = (str(error).strip().splitlines() or [""])[0][:300]
                reason = f"the extension did not build ({type(error).__name__}: {first})"
        if reason is not None:
            _unavailable = reason
            log_rank0(logger, logging.INFO, "mHC: ops' host work stays in Python (%s)", reason)


class Recipe:
    """A registered recording: :meth:`run` allocates and launches as the recorded call did and
    returns the tensors it returned."""

    __slots__ = ("rid", "device", "table")

    def __init__(self, rid: int, device: int):
        self.rid, self.device = rid, device
        self.table = None  # the op's autograd node table, where it has one (native_autograd)

    def run(self, inputs: Sequence[torch.Tensor], scratch: Sequence[torch.Tensor]) -> list:
        device = self.device
        return _extension.run(self.rid, inputs, scratch,
                              torch._C._cuda_getCurrentRawStream(device), device)


def recorded(plan, key) -> Recipe | None:
    """The replayable recording of ``(plan, key)`` (see :func:`run`), or None: not recorded
    yet, not replayable, or the replay is off."""
    recipe = plan.recipes.get(key)
    return recipe if recipe and _ENABLED else None


def run(plan, key, inputs: Sequence[torch.Tensor], scratch: Sequence[torch.Tensor],
        python: Callable[[], tuple], shared: tuple[int, ...] = ()) -> tuple:
    """The kernels' part of one op call: ``python()`` (which allocates, launches and returns
    ``(returned, temporaries)``: the tensors the call hands back and those it allocated only
    for its kernels) or its replay. ``plan`` is the call's launch plan and ``key`` everything
    else its launches depend on (see the module docstring; its first element is the call's
    :func:`~mhc_megatron.kernels.launch.signature`, None where launches are not signed).
    ``inputs`` and ``scratch`` are the tensors the kernels take that the call did not
    allocate. ``shared``: the indices in ``returned`` of small tensors that live as long as
    each other (a mapping's fp32 tensors, saved together and freed together), which the
    replay places in one allocation (each its own tensor at a 256-byte aligned offset, no
    view of another) instead of one each. Returns ``returned``."""
    recipe = plan.recipes.get(key)  # a Recipe, False (not replayable) or None (not recorded)
    runs = _observed.runs
    if recipe and _ENABLED:
        returned = recipe.run(inputs, scratch)
        if runs is not None:
            runs.append((recipe, inputs, scratch, returned))
        return returned
    if recipe is None and key[0] is not None and _ENABLED and unavailable() is None \
            and not torch.cuda.is_current_stream_capturing():
        recorder = _Recorder(inputs, scratch)
        with recorder.active():
            returned, temporaries = python()
        recipe = plan.recipes[key] = recorder.register(returned, temporaries, key[0][0],
                                                       shared) or False
        if runs is not None:  # (the recipe is this call's launches on these inputs)
            runs.append((recipe, inputs, scratch, returned) if recipe else None)
        return returned
    if runs is not None:
        runs.append(None)
    return python()[0]


class _Observed(threading.local):
    runs: list | None = None


_observed = _Observed()


class observing:
    """A context in which this thread's op calls through :func:`run` are reported to ``runs``
    (a list; None: nothing is): ``(recipe, inputs, scratch, returned)`` for a call replayed
    from its recipe or recorded as one, None for one that took the Python path otherwise.
    ``mhc_recompute``'s block replay learns its C++ replay sites from it
    (:meth:`~mhc_megatron.recompute.manager._BlockState.recompute`)."""

    __slots__ = ("_runs", "_previous")

    def __init__(self, runs: list | None):
        self._runs = runs
        self._previous = None

    def __enter__(self) -> list | None:
        self._previous, _observed.runs = _observed.runs, self._runs
        return self._runs

    def __exit__(self, *exc) -> None:
        _observed.runs = self._previous


class _Recorder:
    """Collects the launches of one op call (:func:`run`; the launcher reports each one)."""

    def __init__(self, inputs, scratch):
        self.inputs, self.scratch = inputs, scratch
        self.launches: list = []
        self.failed: str | None = None

    @contextlib.contextmanager
    def active(self):
        """Hear of this thread's launches while open (another thread's launches are theirs)."""
        thread = threading.get_ident()
        previous = _launch._recorders.get(thread)
        _launch._recorders[thread] = self
        try:
            yield self
        finally:
            if previous is None:
                del _launch._recorders[thread]
            else:
                _launch._recorders[thread] = previous

    def launch(self, launcher, entry, grid, args) -> None:
        if entry is None:
            self.failed = "a launch through Triton's own launcher"
        else:
            self.launches.append((launcher, entry, grid, args))

    def register(self, returned, temporaries, device, shared=()) -> Recipe | None:
        try:
            return self._register(returned, temporaries, device, shared)
        except _NotReplayable as why:
            log_rank0(logger, logging.DEBUG, "mHC: an op call is not replayed (%s)", why)
            return None

    def _register(self, returned, temporaries, device, shared) -> Recipe:
        if self.failed is not None:
            raise _NotReplayable(self.failed)
        if not self.launches:
            raise _NotReplayable("no launch")
        inputs = {}
        for i, t in enumerate(self.inputs):
            inputs.setdefault(t.data_ptr(), i)
        scratch = {t.data_ptr(): i for i, t in enumerate(self.scratch)}
        declared = {id(t) for t in (*returned, *temporaries)}
        slots: dict = {}
        sizes, dtypes = [], []

        def slot(t: torch.Tensor) -> int:
            found = slots.get(t.data_ptr())
            if found is not None:
                return found
            if id(t) not in declared:
                raise _NotReplayable("a kernel argument the call neither took nor allocated")
            if not t.is_contiguous() or t.dtype not in _DTYPE_CODES:
                raise _NotReplayable("an allocated tensor that is not contiguous")
            slots[t.data_ptr()] = len(sizes)
            sizes.append(list(t.shape))
            dtypes.append(_DTYPE_CODES[t.dtype])
            return slots[t.data_ptr()]

        for t in returned:  # every returned tensor is allocated by the call, in this order
            if t.data_ptr() in inputs or t.data_ptr() in scratch:
                raise _NotReplayable("the call returns one of its inputs")
            slot(t)
        geometry, kinds, values = [], [], []
        for launcher, entry, grid, args in self.launches:
            native = _native_launch(launcher, entry)
            g = (*grid, 1, 1)[:3]
            geometry.append([native.function, *g, native.block, native.shared])
            k, v = [], []
            for ty, a in zip(native.types, (*args, *entry[2])):
                if ty is None:  # a constexpr: compiled into the kernel
                    continue
                if isinstance(a, torch.Tensor):
                    p = a.data_ptr()
                    if p in inputs:
                        k.append(INPUT), v.append(inputs[p])
                    elif p in scratch:
                        k.append(SCRATCH), v.append(scratch[p])
                    else:
                        k.append(ALLOCATED), v.append(slot(a))
                elif a is None and ty == "ptr":
                    k.append(NULLPTR), v.append(0)
                elif isinstance(a, (bool, int)) and ty in (I32, I64):
                    k.append(ty), v.append(int(a))
                elif isinstance(a, float) and ty == F32:
                    k.append(F32), v.append(struct.unpack("<I", struct.pack("<f", a))[0])
                else:
                    raise _NotReplayable(f"argument {a!r} of type {ty}")
            k += [NULLPTR] * native.trailing
            v += [0] * native.trailing
            kinds.append(k)
            values.append(v)
        returned_slots = [slots[t.data_ptr()] for t in returned]
        group, offset, group_bytes = [-1] * len(sizes), [0] * len(sizes), []
        if shared:
            end = 0
            for i in shared:
                t, at = returned[i], returned_slots[i]
                if group[at] == 0:
                    raise _NotReplayable("a shared tensor named twice")
                group[at], offset[at] = 0, end
                end += -(-t.numel() * t.element_size() // _SHARED_ALIGN) * _SHARED_ALIGN
            group_bytes.append(max(end, _SHARED_ALIGN))
        rid = _extension.add_recipe(len(self.inputs), len(self.scratch), sizes, dtypes, group,
                                    offset, group_bytes, returned_slots, geometry, kinds, values)
        return Recipe(rid, device)


class _NotReplayable(Exception):
    pass


class _NativeLaunch:
    __slots__ = ("function", "block", "shared", "types", "trailing")

    def __init__(self, function, block, shared, types, trailing):
        self.function, self.block, self.shared = function, block, shared
        self.types, self.trailing = types, trailing


_NATIVE: dict = {}  # id(launcher cache entry) -> _NativeLaunch (entries live as long as the process)


def _native_launch(launcher, entry) -> _NativeLaunch:
    """How to launch an entry's compiled kernel from C++: its function handle, block and shared
    memory, the type of each launch argument (None for a constexpr) and the trailing null
    pointer parameters."""
    found = _NATIVE.get(id(entry))
    if found is not None:
        return found
    kernel = _launch.compiled_kernel(entry)
    if kernel is None:
        raise _NotReplayable("no compiled kernel for the launch")
    md, run = kernel.metadata, kernel.run
    if (getattr(md, "num_ctas", 1) != 1 or tuple(getattr(md, "cluster_dims", (1, 1, 1))) not in
            ((1, 1, 1), (0, 0, 0), ()) or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False) or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0):
        raise _NotReplayable("a kernel with clusters, cooperative or PDL launch, or scratch")
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    if not isinstance(signature, dict):
        raise _NotReplayable("a kernel without its signature")
    types = []
    for name in launcher.param_names:
        ty = signature.get(name)
        if ty == "constexpr":
            types.append(None)
        elif isinstance(ty, str) and ty.startswith("*"):
            types.append("ptr")
        elif ty in _TYPES:
            types.append(_TYPES[ty])
        else:
            raise _NotReplayable(f"parameter {name} of type {ty}")
    trailing = _TESTED_TRITON[_launch._triton_version()]
    count = _param_count(kernel.function)
    if count is not None and count != sum(t is not None for t in types) + trailing:
        raise _NotReplayable(f"{count} kernel parameters, not the arguments and {trailing}")
    found = _NATIVE[id(entry)] = _NativeLaunch(kernel.function, 32 * md.num_warps, md.shared,
                                               tuple(types), trailing)
    return found


def _param_count(function: int) -> int | None:
    """The kernel's parameter count from the driver (``cuFuncGetParamInfo``, CUDA 12.4+), or
    None where the driver has no such call."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        query = cuda.cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    offset, size, count = ctypes.c_size_t(), ctypes.c_size_t(), 0
    while query(ctypes.c_void_p(function), ctypes.c_size_t(count), ctypes.byref(offset),
                ctypes.byref(size)) == 0:
        count += 1
    return count
