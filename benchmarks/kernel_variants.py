"""Variants of a product Triton kernel for the probes, built from its own source.

``edited_kernel(kernel, edits, imports)``: the ``@triton.jit`` function ``kernel`` with each
``(old, new)`` of ``edits`` applied to its source (``old`` must occur exactly once), compiled
from a temporary module that starts with ``imports`` (the names the kernel's body uses besides
``triton`` and ``tl``). The product code is not touched.
"""

from __future__ import annotations

import importlib.util
import inspect
import tempfile
import textwrap


def edited_kernel(kernel, edits, imports: str = ""):
    fn = kernel.fn
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in edits:
        assert src.count(old) == 1, f"not exactly once in {fn.__name__}: {old!r}"
        src = src.replace(old, new)
    module_src = ("import triton\nimport triton.language as tl\n" + imports + "\n\n\n" + src)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(module_src)
    spec = importlib.util.spec_from_file_location(f"{fn.__name__}_variant_{abs(hash(src))}",
                                                  f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn.__name__)
