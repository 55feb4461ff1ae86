"""The autograd nodes of "pre" and "combine" in C++, for op calls replayed from C++.

In a training step each sublayer makes two autograd nodes, pre's and combine's. As Python
autograd functions their backward runs in the interpreter on autograd's device thread: the
engine takes the GIL, builds the context's saved tensors, calls ``backward``, which looks its
plan and recipe up and replays it, and hands the gradients back; that is most of a
sublayer's host time in a step (``benchmarks/RESULTS.md``, "Host (CPU) time"). Here an op
call whose forward has a recipe (:func:`~mhc_megatron.kernels.host_replay.recorded`) runs as
one call into the extension (``csrc/autograd_nodes.cpp``): it replays the forward and records
a C++ node, which saves the same tensors through autograd's own saved variables (so
``saved_tensors_hooks``, ``mhc_recompute``'s and activation offloading's included, see them
as they see a Python function's) and, in backward, replays the recipe of its backward
variant without the interpreter.

The node's backward falls back to the op's Python backward (under the GIL), which records
the recipe the next call replays, wherever it cannot replay: the first call of each variant
(pre: with or without ``dh_pre``, with or without the combine's handed-over gradient;
combine: with or without the hand-over), gradients that are undefined, strided, misaligned
or of another dtype than recorded, another CUDA stream, and a CUDA graph being captured. So
the two paths run the same kernels on the same tensors: the same bits.

Used only where every condition of the replay holds and the op's inputs need no copy
(contiguous streams or global layer 1's broadcast view, contiguous parameters, fp32
mappings) and are plain tensors (no subclass), outside ``torch.compile`` and functorch
transforms; elsewhere the ops keep their
Python autograd functions. ``MHC_NATIVE_AUTOGRAD=0`` (or :func:`set_enabled`) turns the nodes
off.

Call sites (:class:`CallSite`): a pre call that replayed through its node leaves, on its
mapping parameter ``phi``, what it replayed (the node table and the temporaries) and what its
operands were (dtype, shape, strides, device, stream); the next pre call on that ``phi`` with
the same other arguments hands the site and its operands to the extension, which checks them
in C++ and replays, without the op's Python checks, plan and recipe lookup. The combine that
takes that pre's mappings (its ``x`` claimed by pre's link) keeps a site of its own beside
it. A call whose operands differ in anything the recipe depends on (a shape, a dtype, a
misaligned or strided operand, the device or stream), or that runs while a CUDA graph is
being captured, misses the site and takes the op's Python path, which makes a new one. A
node's gradients for the parameters are added to Megatron's ``main_grad`` buffers as the
Python function adds them (``gradient_accumulation_fusion``); the buffers are resolved
when the forward runs, which is right for Megatron's DDP (``main_grad`` is a fixed view of its
gradient buffer); parameters of Megatron-FSDP, which allocates ``main_grad`` in backward, keep
the Python function with that fusion.

The module's calls (:func:`pre_at_site`, :func:`combine_at_site`): a
:class:`~mhc_megatron.layers.hyper_connection.HyperConnectionModule` whose ``phi`` has a call
site calls it before it chooses its ops, in one call into the extension each
(``pre_fast``, ``combine_fast``: plain CPython calls, no argument casting), which checks the
operands against the site and that autograd records the call, as above. pre's link is made
there, in C++, from its ``x`` and held by its node; the combine finds it through ``h_res``'s
node and claims it in C++ (the claim :class:`~mhc_megatron.kernels.handoff.DxLink` makes, which
the C++ half of every link now makes, so a link is claimed once whichever path claims it).
Anything the site does not replay returns None, and the module calls the op as before: global
layer 1's first sublayer (its broadcast streams), another shape or layout, Python autograd
functions' mappings, ``main_grad`` buffers other than the site's, a CUDA graph being captured.
``MHC_MODULE_CALLS=0`` (or :func:`set_module_calls_enabled`) turns them off.
"""

from __future__ import annotations

import os
import weakref

import torch

from mhc_megatron.kernels import host_replay
from mhc_megatron.kernels.launch import _compiling, _launch_path_off, _signing_off
from mhc_megatron.kernels.triton_common import PLANS

_ENABLED = os.environ.get("MHC_NATIVE_AUTOGRAD", "1") != "0"
_SITES_ENABLED = os.environ.get("MHC_CALL_SITES", "1") != "0"
_transforms_active = torch._C._are_functorch_transforms_active


def set_enabled(enabled: bool) -> None:
    """Turn the C++ nodes on or off in this process (benchmarks and tests compare the two)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def enabled() -> bool:
    return _ENABLED


def set_sites_enabled(enabled: bool) -> None:
    """Turn the call sites (:class:`CallSite`) on or off in this process; off, every node call
    takes the op's Python path (``MHC_CALL_SITES=0`` at start-up)."""
    global _SITES_ENABLED
    _SITES_ENABLED = bool(enabled)


def sites_enabled() -> bool:
    return _SITES_ENABLED


def extension():
    """The extension whose nodes an op call may use now, or None (off, the replay off or not
    built, ``torch.compile`` tracing, a functorch transform active)."""
    if not _ENABLED or _compiling() or _transforms_active():
        return None
    return host_replay.extension()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain(*tensors) -> bool:
    """Whether ``tensors`` (None entries ignored) are plain tensors or parameters, not tensor
    subclasses (DTensors, wrapper subclasses), which keep the Python functions."""
    for t in tensors:  # (a loop: this runs on every op call)
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def table(recipe: host_replay.Recipe, python_backward) -> object:
    """The node table of an op's forward recipe (made on first use): the recipes of the
    backward variants seen so far, and ``python_backward``, the op's backward in Python that
    the nodes call where they have no recipe (it returns the gradients, the id of the recipe
    it ran or recorded, -1 if none, and what else the op's node needs)."""
    if recipe.table is None:
        recipe.table = host_replay.extension().OpTable(recipe.rid, recipe.device,
                                                       python_backward)
    return recipe.table


def replay_generation() -> int | None:
    """The launch plans' generation (``PLANS.generation``) while op calls may replay from C++
    without the ops' Python (the host replay on and built, no launch hook set, nothing
    traced), else None: what ``mhc_recompute``'s replay sites are learned and used at."""
    if not host_replay.enabled() or host_replay._extension is None or _signing_off():
        return None
    return PLANS.generation


def link(x: torch.Tensor):
    """The C++ half of a :class:`~mhc_megatron.kernels.handoff.DxLink` (combine's gradient
    handed to pre) of pre's ``x``, or None where the extension is not loaded."""
    ext = host_replay._extension
    return None if ext is None else ext.Link(x)


def node_link(h_res: torch.Tensor):
    """The C++ half of the link held by the C++ pre node ``h_res`` comes from, or None (no
    extension, another node, or no link)."""
    ext = host_replay._extension
    return None if ext is None else ext.node_link(h_res)


class CallSite:
    """A call site of pre (one mapping's ``phi``) and of the combine after it: ``pre`` and
    ``combine`` are the extension's sites (``csrc/autograd_nodes.cpp``: ``Site``), ``args``
    pre's other arguments ``(iterations, eps, n, form)``, ``combine_n`` the combine's ``n``;
    ``generation``: the launch plans' (a change of the kernels' tiles ends every site)."""

    __slots__ = ("phi", "args", "pre", "combine", "combine_n", "generation", "mains",
                 "pre_capsule", "combine_capsule")

    def __init__(self, phi: torch.Tensor, args: tuple, pre, mains: tuple | None):
        self.phi = weakref.ref(phi)
        self.args = args
        self.pre = pre
        self.combine = None
        self.combine_n = None
        self.generation = PLANS.generation
        self.mains = mains  # the parameters' main_grad buffers the call added to, or None
        self.pre_capsule = pre.capsule()  # (the sites as the module's calls take them)
        self.combine_capsule = None

    def current(self) -> bool:
        """Whether the site may replay now: the plans it was made from are still held, and
        no launch hook is set and nothing is traced."""
        return self.generation == PLANS.generation and not _signing_off()


# id(phi) -> its CallSite (dropped with phi)
_SITES: dict[int, CallSite] = {}


def site_of(phi: torch.Tensor, args: tuple) -> CallSite | None:
    """The call site pre's last call on ``phi`` made, if it was made with ``args`` and the
    launches replay now (no launch hook set, not traced), else None."""
    site = _SITES.get(id(phi)) if _SITES_ENABLED else None
    if site is None or site.phi() is not phi or site.args != args or not site.current():
        return None
    return site


def remember_pre(phi: torch.Tensor, args: tuple, table, scratch, operands,
                 mains: tuple | None) -> CallSite | None:
    """Make ``phi``'s call site from a pre call that just replayed ``table``'s forward recipe
    with the plan's reused temporaries ``scratch`` on ``operands`` ``(x, phi, alpha, bias)``,
    adding the parameters' gradients to ``mains`` (their ``main_grad`` buffers) or not (None)
    (None where the sites are off)."""
    if not _SITES_ENABLED:
        return None
    key = id(phi)
    if key not in _SITES:
        weakref.finalize(phi, _SITES.pop, key, None)
    site = _SITES[key] = CallSite(phi, args, host_replay.extension().Site(
        table, list(scratch), list(operands)), mains)
    return site


def remember_combine(site: CallSite, n, table, operands) -> None:
    """Give ``site`` the combine's own, from a combine call that just replayed ``table``'s
    forward recipe on ``operands`` ``(x, f, f_bias, h_res, h_post)`` with ``n``."""
    site.combine = host_replay.extension().Site(table, [], list(operands))
    site.combine_n = n
    site.combine_capsule = site.combine.capsule()


def combine_site(site: CallSite | None, n):
    """The extension's combine site of ``site`` for a combine with ``n``, or None."""
    if site is None or site.combine is None or site.combine_n != n or not site.current():
        return None
    return site.combine


# -- the module's calls

_MODULE_CALLS = os.environ.get("MHC_MODULE_CALLS", "1") != "0"


def set_module_calls_enabled(enabled: bool) -> None:
    """Turn the module's calls (:func:`pre_at_site`, :func:`combine_at_site`) on or off in
    this process; off, the module calls the op (``MHC_MODULE_CALLS=0`` at start-up)."""
    global _MODULE_CALLS
    _MODULE_CALLS = bool(enabled)


def module_calls_enabled() -> bool:
    return _MODULE_CALLS


def _module_site(phi: torch.Tensor) -> CallSite | None:
    """``phi``'s call site where a module's call may replay from it now, else None."""
    if (not (_MODULE_CALLS and _ENABLED and _SITES_ENABLED and host_replay._ENABLED)
            or _compiling() or _launch_path_off() or _transforms_active()):
        return None  # (_compiling first: torch.compile traces no further)
    site = _SITES.get(id(phi))
    if site is None or site.generation != PLANS.generation or site.phi() is not phi:
        return None  # (CallSite.current, with the launch checks made above)
    return site


def pre_at_site(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                args: tuple, main_grads: bool, record: tuple | None = None) -> tuple | None:
    """A :class:`~mhc_megatron.layers.hyper_connection.HyperConnectionModule`'s pre (the
    Triton op's ``pre(x, phi, alpha, bias, *args[:2], n=args[2], form=args[3],
    main_grads=main_grads)``) in one call into the extension, from the site its last call on
    ``phi`` made: ``(y, h_pre, h_post, h_res)``, the same node, link and bits as the op's
    path; or None where that call is not one the site replays (the module then calls the op,
    which checks everything and makes a new site where it can). The extension checks the
    operands against the site (plain tensors, dtypes, shapes, strides, alignment, device,
    stream, no CUDA graph capture) and that autograd records the call; here: the other
    arguments and the ``main_grad`` buffers, which must be the ones the site was made with.
    ``record``: None, or ``(ranges, fn, kwargs)``, the open ``mhc_recompute`` block's C++ ranges
    and the op to record the call as there, ``fn(x, h_pre, **kwargs)`` returning ``y`` (what
    :func:`~mhc_megatron.recompute.manager.record_as` records), in the same call."""
    site = _module_site(phi)
    if site is None or site.args != args:
        return None
    mains = site.mains
    if main_grads:
        # (the op's _main_grads held when the site was made: these buffers, all three needing
        # a gradient)
        if (mains is None or getattr(phi, "main_grad", None) is not mains[0]
                or getattr(alpha, "main_grad", None) is not mains[1]
                or getattr(bias, "main_grad", None) is not mains[2]
                or not (phi.requires_grad and alpha.requires_grad and bias.requires_grad)):
            return None
        return host_replay._extension.pre_fast(site.pre_capsule, x, phi, alpha, bias, mains,
                                               (phi, alpha, bias), record)
    if mains is not None:
        return None
    return host_replay._extension.pre_fast(site.pre_capsule, x, phi, alpha, bias, None, None,
                                           record)


def combine_at_site(x: torch.Tensor, f: torch.Tensor, f_bias: torch.Tensor | None,
                    h_res: torch.Tensor, h_post: torch.Tensor, phi: torch.Tensor,
                    n: int | None, record: tuple | None = None) -> torch.Tensor | None:
    """The module's combine (the Triton op's ``combine(x, f, f_bias, h_res, h_post, n=n)``) in
    one call into the extension, from the combine's site beside ``phi``'s: ``x'``, the same
    node, link and bits as the op's path; or None where the call is not one the site replays,
    or ``h_res`` does not come from one of the C++ pre nodes (the module then calls the op).
    The extension takes the link of ``h_res``'s pre node where ``x`` is that pre's ``x``.
    ``record``: as :func:`pre_at_site`'s, the call recorded as ``fn(x, f, f_bias, h_res,
    h_post, **kwargs)`` returning ``x'``."""
    site = _module_site(phi)
    if site is None or site.combine_capsule is None or site.combine_n != n:
        return None
    return host_replay._extension.combine_fast(site.combine_capsule, x, f, f_bias, h_res, h_post,
                                               record)
