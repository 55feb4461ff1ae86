"""Hand-offs between the fused ops (Triton backend): x's gradient between the two ops of one
sublayer (:class:`DxLink`), and a sublayer's projection from the combine before it
(:class:`ProjectionHandoff`).

``x`` feeds both "pre" and "combine", so autograd would add two x-sized gradients (read 2,
write 1), and the combine would write its own, ``H_res^T g``, only for it to be read back.
When combine's ``h_res`` comes from our pre on the same ``x`` (unmodified), combine's
backward forms no ``dx`` at all: it parks its upstream gradient ``g`` and ``h_res`` on a
:class:`DxLink` and returns None for ``x``; pre's backward (which runs after it: it needs
the gradients of ``h_res`` / ``h_post``) forms ``H_res^T g`` inside its dx pass and adds it
to its own dx there (the fold: one x-sized write and read less a sublayer,
``benchmarks/probe_l2_order.py``). When the check fails, each op returns its own ``dx`` and
autograd adds them, so results never depend on whether the link was taken beyond rounding
(the linked path adds the combine's part in fp32, the other rounds it to x's dtype first).
"""

from __future__ import annotations

import os
import weakref

import torch


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class DxLink:
    """Hands combine's upstream gradient and ``H_res`` to the pre of the same ``x``.

    "Same ``x``": the same tensor or an equal view (address, shape, strides, dtype) of the
    same base, unmodified since pre read it, so that a gradient for one is a gradient for
    the other. The base, not pre's view object, is what the link holds on to: under the
    cross-layer recompute nothing else keeps pre's view alive until combine runs."""

    def __init__(self, x: torch.Tensor):
        self.root = weakref.ref(_root(x))
        self.geometry = _key(x)
        self.version = x._version
        self.claimed = False
        self.pending: tuple | None = None  # combine's (g [T, n, C], h_res [T, n, n] fp32)

    def claim(self, x: torch.Tensor) -> bool:
        ok = (not self.claimed and x.requires_grad and self.root() is _root(x)
              and _key(x) == self.geometry and x._version == self.version)
        self.claimed = self.claimed or ok
        return ok


_PROJECTION_ATTR = "_mhc_projection"


def projection_handoff_enabled() -> bool:
    """``MHC_PROJECTION_HANDOFF=1``: combines form the next pre's projection
    (:class:`ProjectionHandoff`). Off by default until measured on a GPU."""
    return os.environ.get("MHC_PROJECTION_HANDOFF", "0") == "1"


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class ProjectionHandoff:
    """Sublayer k+1's projection partials, formed by the combine of sublayer k from the
    streams it writes.

    Pre reads its streams ``x [T, n*C]`` twice in forward: for the projection onto its ``phi``
    (the mappings) and for the aggregate. When the streams are what the combine of the
    sublayer before has just written, that combine can form the projection from the tile it
    holds in registers (``_combine_proj_fwd``), and pre's first read goes. The layer knows
    which pre reads its combine's output (:meth:`request`); the combine fills the hand-off
    (``part [splits, T, MP]``, ``ss [splits, T]`` fp32, as pre's own projection partials) and
    the layer attaches it to the output tensor (:meth:`attach`). Pre takes it (:meth:`take`)
    only from that very tensor, unmodified since, and for the same ``phi``, unmodified since;
    otherwise it projects itself. Results do not depend on which way it went beyond the order
    of fp32 additions in the projection (channel splits in place of K splits).

    Never under CUDA-graph capture, at either end: a captured pre would read partials at
    addresses another graph, or eager code, wrote.
    """

    __slots__ = ("phi", "phi_version", "part", "ss", "version")

    def __init__(self, phi: torch.Tensor):
        self.phi = phi
        self.phi_version = phi._version
        self.part: torch.Tensor | None = None
        self.ss: torch.Tensor | None = None
        self.version: int | None = None

    @staticmethod
    def request(phi: torch.Tensor, streams: torch.Tensor) -> "ProjectionHandoff | None":
        """A hand-off to fill with the projection onto ``phi`` of the combine's output of
        ``streams``, or None (off, or capturing a CUDA graph)."""
        if not projection_handoff_enabled() or _capturing(streams):
            return None
        return ProjectionHandoff(phi)

    def attach(self, out: torch.Tensor) -> None:
        """Hand the filled partials on with the combine's output ``out`` (the tensor the next
        pre receives)."""
        if self.part is not None:
            self.version = out._version
            setattr(out, _PROJECTION_ATTR, self)

    @staticmethod
    def take(x: torch.Tensor, phi: torch.Tensor) -> "ProjectionHandoff | None":
        """The hand-off attached to ``x``, if it is the projection of ``x`` as it is now onto
        ``phi`` as it is now; detached from ``x`` either way (its partials are read once)."""
        handoff = getattr(x, _PROJECTION_ATTR, None)
        if handoff is None:
            return None
        delattr(x, _PROJECTION_ATTR)
        if (handoff.phi is not phi or phi._version != handoff.phi_version
                or x._version != handoff.version or _capturing(x)):
            return None
        return handoff
