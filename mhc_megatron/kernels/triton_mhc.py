"""Fused Triton kernels for the mHC operations, forward and backward.

Same math and layouts as :mod:`mhc_megatron.kernels.reference` (which they are tested
against): ``x [T, n, C]`` stream-major and contiguous, ``phi [m, n*C]``, ``alpha [3]``,
``bias [m]`` (``m = 2n + n^2``), mappings fp32, in either mapping form
(:class:`~mhc_megatron.kernels.reference.MappingForm`: the paper's, or DeepSeek-V4's, with
``h_res`` transposed or not; ``pre``'s ``form=``). Also DeepSeek-V4's output head
(``output_head``: ``phi [n, n*C]``, ``alpha [1]``, ``bias [n]``). Supported: ``n`` in
{1, 2, 4, 8}, any ``T`` and ``C``, activations fp32 / bf16 / fp16, parameters of any float
dtype (math in fp32).
Non-contiguous inputs are made contiguous first (one copy), except streams that are one
broadcast row a token (``[T, n, C]`` with stream stride 0, global layer 1's expansion): the
kernels read those as they are (``X_BCAST``, ``triton_common.streams_operand``).

Kernels (no float atomics anywhere: every reduction split across programs writes fp32
partials that are summed in a fixed order, so results are bitwise identical run to run):

* forward "pre": ``_proj_partial`` (projection ``x @ phi^T`` with ``tl.dot`` and the sum of
  squares, on a (token block x K split) grid), ``_mappings_fwd`` (per token: sum of the
  partials, RMS, sigmoids, Sinkhorn in registers: the paper's log-domain one, or with the
  ``DSV4`` constexpr DeepSeek-V4's linear-domain one; ``TRANSPOSED`` stores ``M^T``; for
  small inputs, ``HAS_AGG``, also the aggregate of its tokens), ``_aggregate_fwd``
  (``y = sum_i H_pre[i] x[i]`` on a (token x channel) grid).
* ``_combine_fwd``: ``x' = H_res x + H_post (f + bias)``; with ``HAS_AGG`` also the next
  pre's aggregate of ``x'`` (``combine_aggregate``: ``mhc_recompute``'s replay of the pair,
  bit for bit the two ops, ``x'`` not read back).
* ``_combine_bwd``: ``dx`` (unless pre's dx pass forms it, see below), ``df``, ``dH_post``,
  ``dH_res`` for a token block, looping over C.
* backward "pre": ``_dhpre_partial`` (``dH_pre`` partials over C splits), ``_mappings_bwd``
  (sigmoid and Sinkhorn backward, either form, exact: the iterations are replayed once from
  the logits into an fp32 scratch and walked back; writes per token block the sums of the
  logit gradients for ``dalpha``/``dbias``, and ``dP`` and the RMS term), ``_pre_dx_dphi``
  (one more pass over x: ``dx``, with the combine's part where it is handed over, and the
  ``dphi`` partials together) and ``_param_grads`` (the partials summed into ``dphi``,
  ``dbias``, ``dalpha``).
* the output head: pre's projection (``n`` rows), aggregate, ``dw`` partials, dx + dphi pass
  and parameter sums, around its own per-token weight kernels ``_head_fwd`` / ``_head_bwd``.

Layout, per op: "pre"'s forward kernels and launch plans in
:mod:`~mhc_megatron.kernels.triton_pre_fwd`, its backward's in
:mod:`~mhc_megatron.kernels.triton_pre_bwd`, its autograd function in
:mod:`~mhc_megatron.kernels.triton_pre`; "combine"'s kernels, launch plan and autograd
function in :mod:`~mhc_megatron.kernels.triton_combine`; the output head's in
:mod:`~mhc_megatron.kernels.triton_head`; shared tiles, precisions and Sinkhorn helpers in
:mod:`~mhc_megatron.kernels.triton_common`; the launch path in
:mod:`~mhc_megatron.kernels.launch` (the compiled kernels are called directly once a launch
shape has been seen: a fraction of Triton's per-launch host work). This module is the entry
point: ``pre``, ``combine``, ``aggregate``, ``combine_aggregate``, ``output_head`` (and the
supported inputs and ``TILES``); the kernels and helpers are imported from the modules that
define them.

x feeds both "pre" and "combine": when combine's mappings come from our pre on the same x,
combine's backward writes no dx; pre's dx kernel forms combine's part, ``H_res^T g``, from
combine's upstream gradient ``g`` and adds it to its own, so autograd gets one x-gradient per
sublayer instead of adding two x-sized tensors (see :mod:`mhc_megatron.kernels.handoff`).

Dots run on tensor cores with fp32 accumulation. The projection: bf16 x as is against phi
split into bf16 hi + lo halves (~16 mantissa bits of phi); fp16 x widened and TF32 (exact for
x, phi rounded to TF32); fp32 x with 3xTF32. The backward dots use TF32 (16-bit x) or 3xTF32
(fp32 x). ``MHC_TRITON_DOT_PRECISION`` (``tf32``, ``tf32x3``, ``ieee``) overrides them all
(read when the kernels are imported).
"""

from __future__ import annotations

from mhc_megatron.kernels.triton_combine import combine, combine_aggregate
from mhc_megatron.kernels.triton_common import (
    SUPPORTED_DTYPES,
    SUPPORTED_STREAMS,
    TILES,
    KernelTiles,
)
from mhc_megatron.kernels.triton_head import output_head
from mhc_megatron.kernels.triton_pre import aggregate, pre

__all__ = ["SUPPORTED_DTYPES", "SUPPORTED_STREAMS", "TILES", "KernelTiles", "aggregate",
           "combine", "combine_aggregate", "output_head", "pre"]
