"""What one fused mHC op hands to the next (Triton backend), with the checks that make it safe.

Both handoffs only save memory traffic: when a check fails, the receiving op does the work
itself, so results never depend on whether a handoff happened (up to the summation order
of an fp32 reduction).

* :class:`DxLink` (backward, within a sublayer): ``x`` feeds both "pre" and "combine", so
  autograd would add two x-sized gradients (read 2, write 1). When combine's ``h_res`` comes
  from our pre on the same ``x`` (unmodified), combine's backward parks its ``dx`` on the
  link and returns None for ``x``; pre's backward (which runs after it: it needs the
  gradients of ``h_res`` / ``h_post``) adds it inside its dx kernel.
* projection offers (forward, across sublayers): combine, given the *next* sublayer's
  ``phi``, computes the projection partials ``x' @ phi^T`` and ``sum(x'^2)`` while ``x'`` is
  in registers and :func:`offer_projection` registers them under ``x'``'s storage; the next
  "pre" takes them with :func:`take_projection` instead of reading ``x'`` once more.
  An offer is taken only for the same live storage, address, shape, strides and dtype,
  the same ``phi`` object at the same version, and (while combine's output object is
  alive) the same version of ``x'``. Offers stay until ``x'`` is freed, so that the
  cross-layer recompute, replaying "pre" on a kept block input, takes the same partials as
  the forward did (bitwise equal recompute); they cost ``splits * T * (MP + 1)`` fp32
  (< 1% of ``x'`` for n=4).
  Not detectable: an in-place write to ``x'`` through a data alias with its own version
  counter (Megatron's ``make_viewless_tensor``) between the combine and the next pre;
  Megatron's layer and block do not write the residual stream in place.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

STATS = {"projections_offered": 0, "projections_taken": 0}  # for tests and benchmarks


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class DxLink:
    """Hands combine's ``dx`` to the pre of the same ``x`` (see module doc).

    "Same ``x``": the same tensor or an equal view (address, shape, strides, dtype) of the
    same base, unmodified since pre read it, so that a gradient for one is a gradient for
    the other. The base, not pre's view object, is what the link holds on to: under the
    cross-layer recompute nothing else keeps pre's view alive until combine runs."""

    def __init__(self, x: torch.Tensor):
        self.root = weakref.ref(_root(x))
        self.geometry = _key(x)
        self.version = x._version
        self.claimed = False
        self.pending: torch.Tensor | None = None  # combine's dx

    def claim(self, x: torch.Tensor) -> bool:
        ok = (not self.claimed and x.requires_grad and self.root() is _root(x)
              and _key(x) == self.geometry and x._version == self.version)
        self.claimed = self.claimed or ok
        return ok


@dataclass(eq=False)
class ProjectionPartials:
    """``part [splits, T, MP]``: ``x' @ phi^T`` over channel splits; ``ss [splits, T]``:
    sums of squares of ``x'`` (fp32; summed in split order by the mappings kernel)."""

    part: torch.Tensor
    ss: torch.Tensor
    splits: int


class _Offer:
    def __init__(self, out: torch.Tensor, phi: torch.Tensor, partials: ProjectionPartials):
        self.storage = StorageWeakRef(out.untyped_storage())
        self.key = _key(out)
        self.out = weakref.ref(out)
        self.version = out._version
        self.phi = weakref.ref(phi)
        self.phi_version = phi._version
        self.partials = partials


_OFFERS: dict[int, _Offer] = {}


def offer_projection(out: torch.Tensor, phi: torch.Tensor, partials: ProjectionPartials) -> None:
    """Register combine's projection of ``out [T, n, C]`` with ``phi`` for the next pre."""
    for ptr in [p for p, o in _OFFERS.items() if o.storage.expired()]:
        del _OFFERS[ptr]
    _OFFERS[out.data_ptr()] = _Offer(out, phi, partials)
    STATS["projections_offered"] += 1


def take_projection(x: torch.Tensor, phi: torch.Tensor) -> ProjectionPartials | None:
    """The partials offered for exactly this ``x [T, n, C]`` and ``phi``, or None."""
    offer = _OFFERS.get(x.data_ptr())
    if offer is None or offer.storage.expired():
        return None
    try:
        if StorageWeakRef(x.untyped_storage()) != offer.storage:
            return None
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without storage
        return None
    if _key(x) != offer.key or offer.phi() is not phi or phi._version != offer.phi_version:
        return None
    out = offer.out()
    if out is not None and out._version != offer.version:
        return None
    STATS["projections_taken"] += 1
    return offer.partials
