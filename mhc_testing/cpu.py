"""Shims that let Megatron-Core 0.19 run on a machine without CUDA.

Used by the test-suite and the CPU demo only; the product never imports this module.
Everything here is a no-op when CUDA is available, so the same test and demo code
runs unchanged on a GPU host.

What Megatron-Core needs on CPU, and what each shim does:

* ``torch.cuda.current_device()`` is called unconditionally by RoPE, by the local
  attention's global memory buffer and by a few utilities. We make it return
  ``"cpu"`` so that ``tensor.to(device=...)`` / ``torch.empty(device=...)`` land on CPU.
* ``torch.cuda.synchronize()`` is called by the distributed-checkpoint writer; without
  CUDA there is nothing to wait for, so it becomes a no-op.
* The CUDA RNG tracker (``tensor_parallel.random``): we install the inference tracker,
  whose ``fork()`` is a no-op context, and make ``_get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` (used by activation recompute) save/restore the CPU RNG.
* gloo has no ``reduce_scatter_tensor``; Megatron's sequence-parallel region uses
  it. We route it through ``all_reduce`` + slice when the group's backend is gloo.
* The softmax's default causal mask (what attention uses when no mask is given, as in
  Megatron's inference) is built on ``"cuda"``; on CPU it is built on CPU.

Call :func:`setup_cpu_megatron` once per process, after ``init_process_group`` and
before building models.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

_INSTALLED = False


def _reduce_scatter_tensor_via_all_reduce(output, input, op=dist.ReduceOp.SUM, group=None,
                                          async_op=False):
    """``dist.reduce_scatter_tensor`` for gloo: all-reduce then keep this rank's slice.

    ``input`` is ``[world * k, ...]`` and ``output`` is ``[k, ...]`` (first-dim split),
    as in torch's reduce_scatter_tensor.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    buf = input.clone()
    dist.all_reduce(buf, op=op, group=group)
    chunk = buf.shape[0] // world
    output.copy_(buf[rank * chunk:(rank + 1) * chunk])
    if async_op:
        return _DoneWork()
    return None


class _DoneWork:
    def wait(self):
        return True

    def is_completed(self):
        return True


def _gloo(group) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def setup_cpu_megatron(seed: int = 1234) -> None:
    """Install the CPU shims (idempotent) and seed the CPU RNG identically on every rank."""
    global _INSTALLED
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if _INSTALLED:
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    original_rs = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if _gloo(group):
            return _reduce_scatter_tensor_via_all_reduce(output, input, op, group, async_op)
        return original_rs(output, input, op=op, group=group, async_op=async_op)

    dist.reduce_scatter_tensor = reduce_scatter_tensor

    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = functools.lru_cache(
        lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool())
    _INSTALLED = True


def init_single_process_group() -> None:
    """Start a one-rank gloo (CPU) or nccl (GPU) process group if none is running: on an
    in-process store (``torch.distributed.HashStore``: no TCP port, so no race with other
    processes for a free one), or through the launcher's rendezvous where the launch variables
    name one (``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``: a torchrun-launched rank)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "MASTER_PORT" not in os.environ and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))


class SequenceParallelTorchNorm(torch.nn.Module):
    """LayerNorm/RMSNorm (per ``config.normalization``) whose weight is tagged for SP.

    Megatron-Core's torch fallback norm (``WrappedTorchNorm``) refuses
    ``sequence_parallel=True``; the SP-capable norms need apex or Transformer Engine.
    This stand-in lets CPU tests exercise sequence parallelism: like TE's norms it tags
    its parameters ``sequence_parallel`` so ``finalize_model_grads`` sums their grads
    over the tensor-parallel group. Builder signature: ``(config, hidden_size, eps)``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        if config.normalization == "RMSNorm":
            self.norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            self.norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.norm.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return self.norm(x)
