"""Launching the mHC Triton kernels with little host work.

A Triton kernel launched as ``kernel[grid](*args, **meta)`` goes through the JIT launcher on
every call: it reads the runtime knobs, binds and specialises every argument, builds the
cache key, looks the compiled kernel up, checks the globals it used and builds launch
metadata before it calls the C launcher. That is 13-22 us a launch on an H100 host (triton
3.6) against 5-9 us for the C launcher itself (``benchmarks/RESULTS.md``, "Host (CPU)
time"), and mHC makes 9 launches a sublayer, forward and backward. :class:`Launcher` keeps,
per call site, the compiled kernel that Triton's launcher picked for a cheaper key of the
same arguments, and calls the compiled kernel's launcher directly from then on.

The key is at least as fine as Triton's specialisation (so a cached kernel is always one
Triton itself would have picked for these arguments): per tensor its dtype and whether its
address is 16-byte aligned; every other argument by its type and value (Triton specialises
ints on being 1, on divisibility by 16 and on their width, all functions of the value); the
keyword arguments (constexprs and launch options) by value; and the device. An unhashable
argument, a launch hook such as a profiler's, the interpreter, an untested triton version,
tracing by ``torch.compile``, or ``MHC_TRITON_FAST_LAUNCH=0`` take Triton's own launcher, as
does the first launch of every key (it compiles, or finds the kernel in Triton's cache).
Where the compiled kernel needs no scratch memory and triton's launcher layout is known
(:data:`_DIRECT_C_LAUNCH`), the compiled module's C ``launch`` is called directly, without
the Python wrapper that allocates scratch.

A launch plan's own launches can skip even that key (:meth:`Launcher.signed`): the plan
fixes every integer argument, the constexprs and the temporaries (fresh ``torch.empty``
tensors, 16-byte aligned, of dtypes the plan chose), so what is left to key on is the
device and the dtypes of the tensors the op was given, and whether they are all aligned
(:func:`signature`, computed once per op call for all of its launches). Such keys live in
the plan (``LaunchPlan.launches``) and go with it. ``MHC_CHECK_LAUNCH_SIGNATURES=1`` (the
tests) takes the per-argument key on every launch and raises if a signature ever names a
kernel other than the one that key names.

Also here: ``cdiv`` and ``next_pow2`` for host code. ``triton.cdiv`` and
``triton.next_power_of_2`` are ``constexpr_function``s in triton 3.6: called from Python
each unwraps its arguments through Triton's constexpr machinery (~3 us a call).
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import triton

from mhc_megatron.kernels.log import log_rank0

logger = logging.getLogger(__name__)

# Versions whose JIT launcher calls ``kernel.run(grid0, grid1, grid2, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)`` with every bound
# argument (constexprs included), as read in their runtime/jit.py.
_TESTED_TRITON = ((3, 6), (3, 7), (3, 8))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (host code)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``; host code)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def fast_launch_supported() -> str | None:
    """Why the direct launch path is off in this process, or None if it is on."""
    if os.environ.get("MHC_TRITON_FAST_LAUNCH", "1") == "0":
        return "MHC_TRITON_FAST_LAUNCH=0"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1"
    try:
        version = _triton_version()
    except ValueError:
        return f"triton {triton.__version__} (version not parsed)"
    if version not in _TESTED_TRITON:
        return f"triton {triton.__version__} (tested: {_TESTED_TRITON})"
    for name in ("_cuda_getCurrentRawStream", "_cuda_getDevice"):
        if not hasattr(torch._C, name):
            return f"torch has no torch._C.{name}"
    return None


CHECK_SIGNATURES = os.environ.get("MHC_CHECK_LAUNCH_SIGNATURES", "0") == "1"


def signature(*tensors, extra: tuple = ()) -> tuple | None:
    """The launch signature of an op call whose kernels take ``tensors`` (every tensor the op
    was given and passes to a kernel, not those it allocates) besides its plan's own:
    ``(device, dtype of each, *extra)`` (``extra``: the op's integer arguments that its plan
    does not fix), or None where the direct path is off or a tensor is not 16-byte aligned
    (:meth:`Launcher.signed` then keys by argument), and where ``torch.compile`` traces or a
    launch hook is set (Triton's own launcher runs)."""
    if _signing_off():
        return None
    address = 0
    dtypes = []
    for t in tensors:  # (one loop: this runs once per op call)
        address |= t.data_ptr()
        dtypes.append(t.dtype)
    if address & 15:
        return None
    return (torch._C._cuda_getDevice(), *dtypes, *extra)


def signature_with_alignment(*tensors) -> tuple | None:
    """:func:`signature` for tensors that may be misaligned (views into a larger buffer, such
    as Megatron's ``main_grad``): each tensor's dtype and whether it is 16-byte aligned, so
    that a misaligned one is signed too (None only where the direct path is off, ``torch.compile``
    traces or a launch hook is set)."""
    if _signing_off():
        return None
    return (torch._C._cuda_getDevice(), *[(t.dtype, t.data_ptr() & 15 == 0) for t in tensors])


def _signing_off() -> bool:
    """Whether launches go through Triton's own launcher now: ``torch.compile`` traces, or
    :func:`_launch_path_off`."""
    return _compiling() or _launch_path_off()


def _launch_path_off() -> bool:
    """Whether launches go through Triton's own launcher for a reason other than a trace: the
    direct path is off, or a launch hook is set."""
    return ((Launcher._disabled is not None and Launcher._off_reason() is not None)
            or _launch_hooks())


class LaunchPlan:
    """Base of the ops' launch plans (:func:`~mhc_megatron.kernels.triton_common.plan`):
    ``launches`` holds the compiled kernels its launches took, by (launcher, meta,
    signature) (:meth:`Launcher.signed`); ``recipes`` the op calls recorded for replay from
    C++, by key (:func:`~mhc_megatron.kernels.host_replay.run`)."""

    def __init__(self):
        self.launches: dict = {}
        self.recipes: dict = {}


def _launch_key(device: int, meta, args) -> tuple:
    """``(device, meta, *per-argument keys)``: a tensor's dtype and 16-byte alignment, any other
    argument's type and value (see the module docstring)."""
    return (device, meta, *[(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                            else (type(a), a) for a in args])


class Meta:
    """The keyword arguments of a launch (the kernel's constexprs by name and the launch
    options, ``num_warps`` ...): fixed per launch plan, so hashed once."""

    __slots__ = ("kwargs", "items", "_hash")

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.items = tuple(kwargs.items())
        self._hash = hash(self.items)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Meta) and self.items == other.items

    def __repr__(self):
        return f"Meta({', '.join(f'{k}={v!r}' for k, v in self.items)})"


class Launcher:
    """``Launcher(jit_fn)(grid, meta, *args)``: launch ``jit_fn`` as ``jit_fn[grid](*args,
    **meta.kwargs)`` would, through the compiled kernel's own launcher once this launcher has
    seen the key (see the module docstring). ``args`` are the kernel's leading parameters in
    order; ``meta`` (a :class:`Meta`) names the rest (constexprs) and the launch options.
    One ``Launcher`` per kernel, created at import; its cache lives as long as the process."""

    _disabled: str | None | bool = False  # False: not looked up yet

    def __init__(self, fn):
        self.fn = fn
        self.param_names = tuple(fn.arg_names) if hasattr(fn, "arg_names") else ()
        self._cache: dict = {}

    @classmethod
    def _off_reason(cls) -> str | None:
        if cls._disabled is False:
            cls._disabled = fast_launch_supported()
            if cls._disabled is not None:
                log_rank0(logger, logging.INFO, "mHC: Triton kernels launch through Triton's "
                          "own launcher (%s)", cls._disabled)
        return cls._disabled

    def __call__(self, grid, meta: Meta, *args) -> None:
        self._launch(grid, meta, args)

    def signed(self, plan: LaunchPlan, sig: tuple | None, grid, meta: Meta, *args) -> None:
        """``self(grid, meta, *args)`` for a launch of ``plan`` (its grid, its ``meta``, its
        integer arguments and temporaries) by an op call whose :func:`signature` is ``sig``:
        the kernel taken for (self, meta, sig) once is taken from ``plan.launches`` from then
        on, without a per-argument key. ``sig`` None keys by argument."""
        if sig is not None and not CHECK_SIGNATURES:
            entry = plan.launches.get((self, meta, sig))
            if entry is not None:  # (sig: the direct path is on, no tracing, no hooks)
                launch, prefix, tail = entry
                launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                       torch._C._cuda_getCurrentRawStream(sig[0]), *prefix, *args, *tail)
                if _recorders:
                    _report(self, entry, grid, args)
                return
        entry = self._launch(grid, meta, args)
        if sig is not None and entry is not None:
            known = plan.launches.setdefault((self, meta, sig), entry)
            if known is not entry:
                raise AssertionError(
                    f"launch signature {sig} of {getattr(self.fn, '__name__', self.fn)} named a "
                    "kernel other than its arguments' key does: the op's signature misses an "
                    "argument that Triton specialises on")

    def _launch(self, grid, meta: Meta, args):
        """Launch; return the cache entry that launched, or None (Triton's own launcher). An
        op call being recorded (:mod:`~mhc_megatron.kernels.host_replay`) hears of it."""
        entry = self._launch_by_key(grid, meta, args)
        if _recorders:
            _report(self, entry, grid, args)
        return entry

    def _launch_by_key(self, grid, meta: Meta, args):
        if (Launcher._disabled is not None and self._off_reason() is not None) or _compiling():
            self.fn[grid](*args, **meta.kwargs)  # (torch.compile traces Triton's launch form)
            return None
        if _launch_hooks():
            self.fn[grid](*args, **meta.kwargs)  # a profiler's hooks: Triton's path calls them
            return None
        device = torch._C._cuda_getDevice()
        key = _launch_key(device, meta, args)
        try:
            entry = self._cache.get(key)
        except TypeError:  # an unhashable argument: Triton's launcher, every time
            self.fn[grid](*args, **meta.kwargs)
            return None
        if entry is None:
            return self._first_launch(key, grid, meta, args)
        launch, prefix, tail = entry
        launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
               torch._C._cuda_getCurrentRawStream(device), *prefix, *args, *tail)
        return entry

    def _first_launch(self, key, grid, meta: Meta, args):
        kernel = self.fn[grid](*args, **meta.kwargs)  # compiles if needed, launches
        if kernel is None:
            return None
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        tail_names = self.param_names[len(args):]
        if (not self.param_names or any(n not in meta.kwargs for n in tail_names)
                or pre_run_hooks(self.fn)):
            return None  # a defaulted parameter or a hook: keep Triton's launcher for this key
        tail = tuple(meta.kwargs[n] for n in tail_names)
        entry = self._cache[key] = (*_compiled_launch(kernel), tail)
        _KERNELS[id(entry)] = kernel
        return entry

    def cached_kernels(self) -> int:
        """How many compiled kernels this launcher calls directly (tests)."""
        return len(self._cache)


_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

# The op calls being recorded by host_replay, by thread: each hears of its thread's launches.
_recorders: dict = {}


def _report(launcher, entry, grid, args) -> None:
    recorder = _recorders.get(threading.get_ident())
    if recorder is not None:
        recorder.launch(launcher, entry, grid, args)


# id(cache entry) -> the compiled kernel it launches (entries live as long as the process).
_KERNELS: dict = {}


def compiled_kernel(entry):
    """The compiled Triton kernel a launcher cache entry launches, or None."""
    return _KERNELS.get(id(entry))


def _compiled_launch(kernel) -> tuple:
    """``(launch, prefix)`` for a compiled kernel: ``launch(gx, gy, gz, stream, *prefix,
    *kernel_args)`` launches it. The compiled module's C launcher where triton's launcher
    layout is known (:data:`_DIRECT_C_LAUNCH`) and the kernel needs no scratch memory (what
    the Python wrapper would allocate); else the wrapper, ``kernel.run``, with no launch
    metadata and no hooks (Triton's launcher passes None and empty hook chains)."""
    run = kernel.run
    if (_triton_version() in _DIRECT_C_LAUNCH and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0 and hasattr(run, "launch")):
        return run.launch, (kernel.function, run.launch_cooperative_grid, run.launch_pdl,
                            None, None, kernel.packed_metadata, None, None, None)
    return run, (kernel.function, kernel.packed_metadata, None, None, None)


# Triton versions whose CudaLauncher.__call__(gx, gy, gz, stream, function, *rest) calls the
# compiled module's ``launch(gx, gy, gz, stream, function, cooperative_grid, pdl,
# global_scratch, profile_scratch, *rest)`` and nothing else when both scratch sizes are 0
# (read in their backends/nvidia/driver.py).
_DIRECT_C_LAUNCH = ((3, 6),)


# triton's runtime knobs, where a profiler sets its launch hooks (triton.knobs.runtime: one
# object for the process, whose hook attributes are read on every call)
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
_HOOK_CHAIN = getattr(getattr(triton, "knobs", None), "HookChain", None)


def _launch_hooks() -> bool:
    """Whether a launch enter or exit hook is set: triton 3.6+ keeps an empty ``HookChain``
    by default (which Triton's launcher calls on every launch; ours skips it), a profiler adds
    to it or replaces it. (One function, no helper per hook: this runs on every op call.)"""
    runtime = _RUNTIME_KNOBS
    if runtime is None:
        return False
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is not None and (type(enter) is not _HOOK_CHAIN or bool(enter.calls)))
            or (leave is not None and (type(leave) is not _HOOK_CHAIN or bool(leave.calls))))


def pre_run_hooks(fn) -> bool:
    """Whether ``fn`` has pre-run hooks (Triton's launcher calls them; ours would not)."""
    return bool(getattr(fn, "pre_run_hooks", ()))
