"""Run-time choice of the mHC op implementation (``config.mhc_kernel_backend``).

A backend is an :class:`MHCOps` with the operations a hyper-connection module (and the
final norm's output head) needs, on flattened tokens (layouts in
:mod:`mhc_megatron.kernels.reference`):

* ``pre(x, phi, alpha, bias, iterations, eps, n=None, form=PAPER) -> (y, h_pre, h_post,
  h_res)``: the dynamic mappings and the aggregate (a fused backend reads ``x`` for both in
  one kernel), in the mapping ``form`` (a
  :class:`~mhc_megatron.kernels.reference.MappingForm`: the paper's mappings, or
  DeepSeek-V4's; ``h_res`` transposed or not), on either backend;
* ``combine(x, f, f_bias, h_res, h_post, n=None) -> x'``: expand-combine;
* ``aggregate(x, h_pre, n=None) -> y``: pre's ``y`` again from its ``h_pre``, bit for bit
  (what ``mhc_recompute`` replays in backward instead of the whole of pre);
* ``output_head(x, phi, alpha, bias, rms_eps, eps, n=None) -> y``: DeepSeek-V4's learned
  contraction of the streams (:func:`~mhc_megatron.kernels.reference.output_head`;
  ``phi [n, n*C]``, ``alpha [1]``, ``bias [n]``);
* ``replay_combine_aggregate`` (optional): a combine and the next pre's aggregate of its
  output replayed as one call, which ``mhc_recompute`` registers for its replay
  (:func:`loaded_ops`, :func:`mhc_megatron.recompute.register_replay_fusion`);
* ``pre_at_site`` / ``combine_at_site`` (optional): a module's pre and combine in one call
  from the call site its last call made, or None where that does not apply (the module then
  calls ``pre`` / ``combine``); :func:`site_ops` gives the backend that has them once loaded
  (the Triton ops: :func:`~mhc_megatron.kernels.native_autograd.pre_at_site`).

``x`` is ``[T, n, C]`` (``f``, ``y``: ``[T, C]``), or with ``n`` given the streams as the
layers carry them, ``[..., n*C]`` (``f``, ``y``: ``[..., C]``; the Triton ops take that layout
as is, so the autograd graph has no reshape nodes around them).

``select_ops(backend, x, n, form)``: "reference" always runs PyTorch; "triton" runs the fused
kernels (every mapping form, and the output head) or raises a clear error saying why they cannot
run for ``x``; "auto" runs Triton where it can (CUDA tensor, supported n and dtype, Triton
importable) and the reference otherwise, and says which once per (device type, choice) at INFO
on rank 0 (shown by default, see :mod:`mhc_megatron._logging`). ``KERNEL_BACKENDS``: the three
names.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from mhc_megatron.kernels import reference
from mhc_megatron.kernels.log import log_rank0

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class MHCOps:
    """One implementation of the mHC operations.

    ``replay_combine_aggregate(combine_args, combine_kwargs, (size, stride, offset),
    aggregate_rest_args, aggregate_kwargs)``, where a backend has it: the replay of a
    recorded ``combine`` and of the ``aggregate`` recorded right after it on (a view of
    geometry ``(size, stride, offset)`` of) its output as one call, ``((x',), (y,))`` bit for
    bit what the two calls return, or None where it cannot (the signature of
    :func:`mhc_megatron.recompute.register_replay_fusion`)."""

    name: str
    pre: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]
    combine: Callable[..., Tensor]
    aggregate: Callable[..., Tensor]
    output_head: Callable[..., Tensor]
    replay_combine_aggregate: Callable[..., tuple | None] | None = None
    pre_at_site: Callable[..., tuple | None] | None = None
    combine_at_site: Callable[..., Tensor | None] | None = None


# The reference wrappers make ``x`` contiguous: a broadcast x (global layer 1's streams as a
# view of the embeddings, stream stride 0) is copied, so that the reference runs the same ops
# on the same values as on materialised streams (the fused ops read the view as it is).
def _reference_pre(x, phi, alpha, bias, iterations, eps, n=None, form=reference.PAPER,
                   main_grads=False):
    # (main_grads: the Triton pre's gradient-accumulation fusion; here autograd hands the
    # parameters' gradients to Megatron's hook, the same values)
    x = x.contiguous()
    y, h_pre, h_post, h_res = reference.pre(reference.as_tokens(x, n), phi, alpha, bias,
                                            iterations, eps, form)
    return _in_layout_of(y, x, n), h_pre, h_post, h_res


def _reference_combine(x, f, f_bias, h_res, h_post, n=None):
    x = x.contiguous()
    f_tokens = f if n is None else f.reshape(-1, f.shape[-1])
    out = reference.expand_combine(reference.as_tokens(x, n), f_tokens, f_bias, h_res, h_post)
    return out if n is None else out.view(x.shape)


def _reference_aggregate(x, h_pre, n=None):
    x = x.contiguous()
    return _in_layout_of(reference.aggregate(reference.as_tokens(x, n), h_pre), x, n)


def _reference_output_head(x, phi, alpha, bias, rms_eps, eps, n=None):
    x = x.contiguous()
    y = reference.output_head(reference.as_tokens(x, n), phi, alpha, bias, rms_eps, eps)
    return _in_layout_of(y, x, n)


def _in_layout_of(y, x, n):
    """The aggregate ``y [T, C]`` in ``x``'s layout (:func:`reference.aggregate_shape`)."""
    return y if n is None else y.view(reference.aggregate_shape(x, n, y.shape[-1]))


REFERENCE_OPS = MHCOps(name="reference", pre=_reference_pre, combine=_reference_combine,
                       aggregate=_reference_aggregate, output_head=_reference_output_head)

_announced: set[tuple[str, str]] = set()
_triton_ops: MHCOps | None = None


def _load_triton_ops() -> MHCOps:
    global _triton_ops
    if _triton_ops is None:
        from mhc_megatron.kernels import native_autograd, triton_mhc

        _triton_ops = MHCOps(name="triton", pre=triton_mhc.pre, combine=triton_mhc.combine,
                             aggregate=triton_mhc.aggregate,
                             output_head=triton_mhc.output_head,
                             replay_combine_aggregate=_replay_combine_aggregate,
                             pre_at_site=native_autograd.pre_at_site,
                             combine_at_site=native_autograd.combine_at_site)
    return _triton_ops


def site_ops() -> MHCOps | None:
    """The backend whose calls make call sites (the Triton ops), once :func:`select_ops` has
    chosen it in this process, else None: what a module tries before choosing its ops
    (``pre_at_site`` and ``combine_at_site`` replay only calls that backend made before)."""
    return _triton_ops


def loaded_ops() -> tuple[MHCOps, ...]:
    """The backends loaded in this process so far: :data:`REFERENCE_OPS`, and the Triton
    ops once :func:`select_ops` has chosen them (what the ops a recompute block recorded can
    come from)."""
    return (REFERENCE_OPS,) if _triton_ops is None else (REFERENCE_OPS, _triton_ops)


def _replay_combine_aggregate(combine_args, combine_kwargs, geometry, aggregate_args,
                              aggregate_kwargs):
    """``mhc_recompute``'s replay of a Triton combine and of the next pre's aggregate of its
    output as one kernel (``triton_mhc.combine_aggregate``: the combine's output is not read
    back), when the aggregate took that output as it is: the combine's shape, contiguous,
    and the same layout (``n``). Else None: the two ops are replayed apart."""
    from mhc_megatron.kernels import triton_mhc

    n = combine_kwargs.get("n")
    x = combine_args[0]
    if (len(combine_args) != 5 or set(combine_kwargs) - {"n"} or len(aggregate_args) != 1
            or set(aggregate_kwargs) - {"n"} or aggregate_kwargs.get("n") != n
            or geometry != (tuple(x.shape), _contiguous_strides(x.shape), 0)):
        return None
    out, y = triton_mhc.combine_aggregate(*combine_args, aggregate_args[0], n=n)
    return (out,), (y,)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@functools.cache
def _triton_limits() -> tuple[tuple[int, ...], tuple] | None:
    """(supported n, supported dtypes) of the Triton kernels, or None without triton.

    Looked up once per process: ``select_ops`` runs on every sublayer call.
    """
    if importlib.util.find_spec("triton") is None:
        return None
    from mhc_megatron.kernels.triton_mhc import SUPPORTED_DTYPES, SUPPORTED_STREAMS

    return SUPPORTED_STREAMS, SUPPORTED_DTYPES


def triton_unsupported_reason(x: Tensor, n: int | None = None) -> str | None:
    """Why the fused Triton kernels cannot run on ``x [T, n, C]`` (or the streams
    ``[..., n*C]`` with ``n`` given), or None if they can. The ops share these limits (n in
    ``SUPPORTED_STREAMS``, the activation dtype in ``SUPPORTED_DTYPES``), the output head
    included, in every mapping form."""
    limits = _triton_limits()
    if limits is None:
        return "triton is not installed"
    streams, dtypes = limits

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not x.is_cuda and not (interpret and x.device.type == "cpu"):
        return f"the input is on {x.device.type}; the kernels need a CUDA device " \
               "(or TRITON_INTERPRET=1 on CPU, for testing)"
    if n is None:
        n = x.shape[1] if x.dim() == 3 else None
    if n not in streams:
        return f"n={n if n is not None else '?'} streams; supported n: {streams}"
    if x.dtype not in dtypes:
        return f"dtype {x.dtype}; supported: {dtypes}"
    return None


# select_ops' choices for CUDA inputs, by (backend, dtype, n): there they depend on nothing
# else (select_ops runs twice a sublayer)
_CUDA_CHOICES: dict[tuple, MHCOps] = {}


def select_ops(backend: str, x: Tensor, n: int | None = None,
               form: reference.MappingForm = reference.PAPER) -> MHCOps:
    """The :class:`MHCOps` that ``backend`` ("auto" | "triton" | "reference") selects for ``x``
    (``[T, n, C]``, or the streams ``[..., n*C]`` with ``n`` given) and the mapping ``form``
    (both backends compute every form, so the choice does not depend on it; the Triton ``pre``
    refuses an unknown ``form.name`` with a ValueError). A choice for a CUDA ``x`` is made once
    per (backend, dtype, n)."""
    if backend == "reference":
        return REFERENCE_OPS
    if x.is_cuda:
        key = (backend, x.dtype, n if n is not None else x.shape[1] if x.dim() == 3 else None)
        chosen = _CUDA_CHOICES.get(key)
        if chosen is None:
            chosen = _CUDA_CHOICES[key] = _select(backend, x, n)
        return chosen
    return _select(backend, x, n)


def _select(backend: str, x: Tensor, n: int | None) -> MHCOps:
    """:func:`select_ops`' choice, made afresh."""
    if backend not in ("auto", "triton"):
        raise ValueError(
            f"mhc_kernel_backend={backend!r} is unknown. Fix: use one of {KERNEL_BACKENDS}."
        )
    reason = triton_unsupported_reason(x, n)
    if backend == "auto" and not x.is_cuda:
        reason = reason or "'auto' uses Triton on CUDA devices only"
    if reason is not None and backend == "triton":
        raise RuntimeError(
            f"mhc_kernel_backend='triton' cannot run: {reason}. "
            "Fix: set mhc_kernel_backend='auto' (falls back to the reference) or 'reference'."
        )
    chosen = REFERENCE_OPS if reason is not None else _load_triton_ops()
    key = (x.device.type, chosen.name)
    if key not in _announced:
        _announced.add(key)
        detail = "" if reason is None else f" ({reason})"
        log_rank0(logger, logging.INFO, "mHC: mhc_kernel_backend=%r runs the %s ops on %s%s",
                  backend, chosen.name, x.device.type, detail)
    return chosen
