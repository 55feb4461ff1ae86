"""``Function.apply`` for the ops' autograd functions without torch's Python wrapper.

Up to torch 2.13, ``torch.autograd.Function.apply`` is a Python classmethod that, on every
call, checks whether the function defines ``setup_context``, asks whether functorch
transforms are active and, when none is, passes every argument through
``torch._functorch.utils.unwrap_dead_wrappers`` (a generator over the arguments: a tensor
that escaped a functorch transform is unwrapped) before it calls the C ``apply`` of
``torch._C._FunctionBase``. For the ops' two functions, called twice a sublayer with up to
ten arguments, that wrapper is a measurable part of their host time. Later torch versions
make ``apply`` C code themselves.

:func:`applier` returns, for a function class, a callable that does what the wrapper does for
it, with less Python: where no functorch transform is active and ``torch.compile`` is not
tracing, it unwraps the call's tensor arguments (named by position) only if they are
functorch tensors (never, outside of functorch), then calls the C ``apply`` directly;
otherwise it calls the class's own ``apply``. Used only where torch's ``apply`` is the wrapper
read above (:data:`WRAPPER_SKIPPED`, checked against its code at import); elsewhere the class's
own ``apply`` is returned unchanged. ``MHC_DIRECT_APPLY=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from mhc_megatron.kernels.launch import _compiling


def _is_python_wrapper() -> bool:
    """Whether ``torch.autograd.Function.apply`` is the Python wrapper described above (its
    code calls ``unwrap_dead_wrappers`` and ``_are_functorch_transforms_active``), and the C
    ``apply`` and the functorch helpers it uses are where it finds them."""
    apply = getattr(torch.autograd.Function, "apply", None)
    code = getattr(getattr(apply, "__func__", None), "__code__", None)
    if code is None:
        return False
    names = set(code.co_names)
    return ({"unwrap_dead_wrappers", "_are_functorch_transforms_active"} <= names
            and "apply" in vars(torch._C._FunctionBase)
            and hasattr(torch._C, "_are_functorch_transforms_active")
            and hasattr(torch._C._functorch, "is_functorch_wrapped_tensor")
            and hasattr(torch._C._functorch, "unwrap_if_dead"))


WRAPPER_SKIPPED = os.environ.get("MHC_DIRECT_APPLY", "1") != "0" and _is_python_wrapper()


def applier(cls, tensor_positions: tuple[int, ...]) -> Callable:
    """``cls.apply``, or where :data:`WRAPPER_SKIPPED` its equivalent without torch's Python
    wrapper. ``tensor_positions``: where ``cls.forward`` takes tensors (the others are never
    tensors: ints, floats, forms, links, None)."""
    if not WRAPPER_SKIPPED or getattr(cls, "setup_context", None) is not \
            torch.autograd.function._SingleLevelFunction.setup_context:
        return cls.apply
    c_apply = vars(torch._C._FunctionBase)["apply"].__get__(None, cls)
    transforms_active = torch._C._are_functorch_transforms_active
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    unwrap = torch._C._functorch.unwrap_if_dead
    fallback = cls.apply

    def apply(*args):
        if transforms_active() or _compiling():
            return fallback(*args)
        for i in tensor_positions:
            t = args[i]
            if t is not None and wrapped(t):  # (a tensor that escaped a transform: unwrap)
                args = (*args[:i], unwrap(t), *args[i + 1:])
        return c_apply(*args)

    return apply
