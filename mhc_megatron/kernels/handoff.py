"""The handoff of x's gradient between the two fused ops of one sublayer (Triton backend).

``x`` feeds both "pre" and "combine", so autograd would add two x-sized gradients (read 2,
write 1), and the combine would write its own, ``H_res^T g``, only for it to be read back.
When combine's ``h_res`` comes from our pre on the same ``x`` (unmodified), combine's
backward forms no ``dx`` at all: it parks its upstream gradient ``g`` and ``h_res`` on a
:class:`DxLink` and returns None for ``x``; pre's backward (which runs after it: it needs
the gradients of ``h_res`` / ``h_post``) forms ``H_res^T g`` inside its dx pass and adds it
to its own dx there (the fold: one x-sized write and one x-sized read less a sublayer).
When the check fails, each op returns its own ``dx`` and autograd adds them, so results
never depend on whether the link was taken beyond rounding (the linked path adds the
combine's part in fp32, the other rounds it to x's dtype first).

Where the ops' C++ extension is loaded the handed-over pair lives in its C++ half
(:func:`~mhc_megatron.kernels.native_autograd.link`), which the ops' C++ autograd nodes
read and write directly; the Python functions go through :meth:`DxLink.park` and
:meth:`DxLink.take`, so either kind of node hands over to either.
"""

from __future__ import annotations

import weakref

import torch

from mhc_megatron.kernels import native_autograd


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)  # (torch.Size and stride(): tuples)


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class DxLink:
    """Hands combine's upstream gradient and ``H_res`` to the pre of the same ``x``.

    "Same ``x``": the same tensor or an equal view (address, shape, strides, dtype) of the
    same base, unmodified since pre read it, so that a gradient for one is a gradient for
    the other. The base, not pre's view object, is what the link holds on to: under the
    cross-layer recompute nothing else keeps pre's view alive until combine runs. Where the
    extension is loaded the C++ half holds that and the claim too (so a combine called from
    C++, which finds the link through ``h_res``'s node, and one called here claim it once
    between them)."""

    __slots__ = ("root", "geometry", "version", "_claimed", "native", "site", "_pending")

    def __init__(self, x: torch.Tensor):
        self.native = native_autograd.link(x)  # the C++ half, where the extension is loaded
        self.site = None  # pre's call site (native_autograd.CallSite), for the combine's
        self._pending: tuple | None = None  # combine's (g [T, n, C], h_res [T, n, n] fp32)
        if self.native is None:
            self.root = weakref.ref(_root(x))
            self.geometry = _key(x)
            self.version = x._version
            self._claimed = False

    @classmethod
    def of_native(cls, native) -> "DxLink":
        """A link around the C++ half ``native`` that a C++ pre node made (no site)."""
        link = cls.__new__(cls)
        link.native, link.site, link._pending = native, None, None
        return link

    @property
    def claimed(self) -> bool:
        return self.native.claimed if self.native is not None else self._claimed

    def park(self, g: torch.Tensor, h_res: torch.Tensor) -> None:
        """Combine's backward: hand ``g`` (contiguous, as its kernel read it) and ``h_res``
        (fp32) to pre's."""
        if self.native is not None:
            self.native.park(g, h_res)
        else:
            self._pending = (g, h_res)

    def take(self) -> tuple | None:
        """Pre's backward: ``(g, h_res)`` if combine's backward handed them over, else None."""
        if self.native is not None:
            return self.native.take()
        pending, self._pending = self._pending, None
        return pending

    def claim(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is pre's ``x`` (above), needs a gradient, and the link is not
        claimed yet: then it is the caller's."""
        if self.native is not None:
            return self.native.claim(x)
        ok = (not self._claimed and x.requires_grad and self.root() is _root(x)
              and _key(x) == self.geometry and x._version == self.version)
        self._claimed = self._claimed or ok
        return ok


def node_link(h_res: torch.Tensor) -> DxLink | None:
    """The link of the C++ pre node that made ``h_res`` (a pre called from its module's call
    site leaves no :class:`DxLink` on ``h_res``: the node holds it), or None (no extension,
    ``h_res`` not from such a node, or its ``x`` needed no gradient)."""
    native = native_autograd.node_link(h_res)
    return None if native is None else DxLink.of_native(native)
