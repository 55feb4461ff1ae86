"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) with a GPU's ``tl.dot`` property.

The interpreter runs ``tl.dot`` as numpy's ``matmul`` in the accumulator's dtype. numpy's
fp32 ``matmul`` (2.5) rounds each output element differently with the operands' shapes: an
element of ``[16, 32] @ [32, 128]`` and the same element of one of its ``[16, 32] @ [32, 32]``
column blocks differ in about a tenth of the elements. A GPU's MMA forms every output
element the same way whatever the tile's width, and the kernels rely on it: variants that
split a tile's columns differently (``TILES.dx_streams``) give the same bits, which the tests
assert. :func:`exact_fp32_dots` makes the interpreter's fp32 dots shape-independent: each
is accumulated in float64 and rounded once to float32.
"""

from __future__ import annotations

_INSTALLED = False


def exact_fp32_dots() -> None:
    """Make the interpreter's ``tl.dot`` into an fp32 accumulator (idempotent) the exact
    product rounded once: ``float32(a @ b + d)`` computed in float64, so an output element's
    bits do not depend on the tile it is in. Other dots (fp8 operands, fp16 or integer
    accumulators) run as the interpreter runs them."""
    global _INSTALLED
    if _INSTALLED:
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if (d.data.dtype != np.float32 or a.dtype.primitive_bitwidth == 8
                or b.dtype.primitive_bitwidth == 8):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data
        return interpreter.TensorHandle(exact.astype(np.float32), d.dtype.scalar)

    builder.create_dot = create_dot
    _INSTALLED = True
