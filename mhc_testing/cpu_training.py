"""Shims that let Megatron's own training loop (``megatron.training.pretrain``) run on CPU.

Test support only (CPU CI and smoke runs of ``examples/pretrain_gpt_mhc.py``); the product
never imports this module, and it must never be installed in a GPU job. Call :func:`install`
once, before ``parse_and_validate_args``. Run with Megatron's CPU-capable flags:
``--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
--distributed-backend gloo --no-rope-fusion`` (and no fused softmax / bias kernels).

What megatron.training 0.19.2 needs on CPU, and what each shim does:

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``, which ``pretrain`` never
  passes: bind ``allow_no_cuda=True``.
* ``_initialize_distributed`` builds the model-parallel groups only if a GPU is counted:
  run it again with one device counted (the process group exists by then, so only the
  model-parallel groups are built).
* The JIT warm-up allocates CUDA tensors: skipped (it only warms up fusions).
* ``training.py``, the optimiser and grad clipping create tensors with ``device="cuda"``,
  call ``.cuda()`` and use CUDA streams: one process-wide ``TorchFunctionMode`` maps CUDA
  devices to the CPU and makes ``Tensor.cuda()`` the identity, plus stand-ins for streams;
  ``Tensor.type()`` reports ``torch.cuda.*`` names, which grad clipping and the fp16/bf16
  optimiser assert on.
* The CUDA RNG state (rerun state machine, checkpoints): an empty state; our
  :func:`~mhc_testing.cpu.setup_cpu_megatron` provides the model-parallel RNG
  tracker, with a placeholder state so that checkpoint loading finds one (without it Megatron
  prints "Unable to load rng state" and exits with code 0).
* TP/CP > 1 query the GPU architecture: reported as Hopper.
* Megatron's torch FSDP2 wrapper builds its ``DeviceMesh`` on "cuda": built on the CPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_INSTALLED = False


class _NoStream:
    """Stands in for ``torch.cuda.Stream`` (a class, so annotations such as
    ``torch.cuda.Stream | None`` in other libraries still evaluate)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NoEvent()


class _NoEvent:
    """What ``_NoStream.record_event`` returns: CPU work is done when it is issued."""

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _install_cuda_to_cpu_mode() -> None:
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            if func is torch.Tensor.to:
                args = tuple("cpu" if i > 0 and _is_cuda(a) and not isinstance(a, int) else a
                             for i, a in enumerate(args))
            return func(*args, **kwargs)

    CudaToCpu().__enter__()  # active for the rest of the process
    _device_meshes_on_cpu()
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None


def _device_meshes_on_cpu() -> None:
    """``DeviceMesh.from_group(group, "cuda")`` (Megatron's torch FSDP2 wrapper) builds a CPU
    mesh."""
    from torch.distributed import DeviceMesh

    from_group = DeviceMesh.from_group

    @functools.wraps(from_group)
    def on_cpu(group, device_type, *args, **kwargs):
        return from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(on_cpu)


_CUDA_TO_CPU = False


def install_cuda_to_cpu() -> None:
    """Only the CUDA -> CPU redirection (idempotent; no-op with CUDA): for Megatron code that
    allocates on ``device="cuda"`` outside the training loop, e.g. its pipeline schedules."""
    global _CUDA_TO_CPU
    if _CUDA_TO_CPU or torch.cuda.is_available():
        return
    _install_cuda_to_cpu_mode()
    _CUDA_TO_CPU = True


def install() -> None:
    """Install every shim (idempotent). No-op on a machine with CUDA."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    from megatron.core.tensor_parallel import random as tp_random

    from mhc_testing.cpu import setup_cpu_megatron

    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
    build_groups = initialize._initialize_distributed

    def _initialize_distributed(*args, **kwargs):
        build_groups(*args, **kwargs)
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized() and \
                not kwargs.get("skip_model_parallel_init"):
            count = torch.cuda.device_count
            torch.cuda.device_count = lambda: 1
            try:
                build_groups(*args, **kwargs)
            finally:
                torch.cuda.device_count = count

    initialize._initialize_distributed = _initialize_distributed
    training.set_jit_fusion_options = lambda *a, **k: None
    arguments.get_device_arch_version = lambda: 9
    install_cuda_to_cpu()
    setup_cpu_megatron()
    tp_random.get_cuda_rng_tracker().states_["model-parallel-rng"] = torch.get_rng_state()
    _INSTALLED = True
