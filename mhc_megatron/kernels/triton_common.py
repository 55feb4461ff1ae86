"""Shared pieces of the fused Triton mHC kernels: supported inputs and mapping forms, dot
precision, tile sizes, launch-shape helpers and the ``@triton.jit`` helpers the ops use (the
mapping logits, the paper's log-domain Sinkhorn and DeepSeek-V4's linear-domain one, forward
and backward). The ops are in :mod:`~mhc_megatron.kernels.triton_pre` (its kernels in
:mod:`~mhc_megatron.kernels.triton_pre_fwd` and :mod:`~mhc_megatron.kernels.triton_pre_bwd`),
:mod:`~mhc_megatron.kernels.triton_combine` and :mod:`~mhc_megatron.kernels.triton_head`;
:mod:`~mhc_megatron.kernels.triton_mhc` is the overview.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from mhc_megatron.kernels.launch import _compiling, cdiv, next_pow2

SUPPORTED_STREAMS = (1, 2, 4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def records_autograd(*tensors) -> bool:
    """Whether autograd records an op on ``tensors`` (None entries ignored): grad mode on,
    not in ``torch.inference_mode`` and one of them requires grad. Inference mode counts as
    no autograd also under ``torch.enable_grad``: Megatron runs its bias-dropout-add under
    ``enable_grad`` even inside its inference engines' ``inference_mode``, where no tensor can
    be saved for backward and built-in ops record nothing."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    for t in tensors:  # (a loop, not a generator: this runs on every op call)
        if t is not None and t.requires_grad:
            return True
    return False


MAPPING_FORMS = ("paper", "deepseek_v4")


def form_flags(form) -> tuple[bool, bool]:
    """``(DSV4, TRANSPOSED)``, the mapping kernels' constexprs for ``form`` (a
    :class:`~mhc_megatron.kernels.reference.MappingForm`); a ValueError for an unknown name."""
    if form.name not in MAPPING_FORMS:
        raise ValueError(f"mhc_mapping_form={form.name!r} is unknown to the Triton mHC kernels. "
                         f"Fix: use one of {MAPPING_FORMS}.")
    return form.name == "deepseek_v4", bool(form.transposed)


_FORCED_PRECISION = os.environ.get("MHC_TRITON_DOT_PRECISION")


def forced_precision() -> str | None:
    """``MHC_TRITON_DOT_PRECISION`` (``tf32``, ``tf32x3``, ``ieee``), or None: read when the
    kernels are imported (the ops ask on every call)."""
    return _FORCED_PRECISION


def _dot_precision(dtype: torch.dtype, forced: str | None = None) -> str:
    """TF32 products are exact for bf16/fp16 activations (<= 11 mantissa bits; only the fp32
    operand is rounded); fp32 activations get 3xTF32, close to full fp32 accuracy. ``forced``:
    :func:`forced_precision`."""
    return forced or ("tf32" if dtype in (torch.bfloat16, torch.float16) else "tf32x3")


def _projection_splits_phi(dtype: torch.dtype, forced: str | None = None) -> bool:
    """bf16 x: the projection runs on bf16 tensor cores with phi as hi + lo bf16 halves
    (~16 mantissa bits, more than TF32's 11, and x needs no widening). Not for fp16 (phi's
    small entries would lose bits in fp16's subnormal range) nor when the precision is
    forced (``forced``: :func:`forced_precision`)."""
    return dtype == torch.bfloat16 and forced is None


@functools.cache
def _padded_m(n: int) -> int:
    return max(16, next_pow2(2 * n + n * n))


# ------------------------------------------------------------------------------ helpers
@triton.jit
def _log_normalize(L, AXIS: tl.constexpr):
    """L - logsumexp(L, AXIS) (fp32)."""
    mx = tl.expand_dims(tl.max(L, axis=AXIS), AXIS)
    lse = mx + tl.log(tl.expand_dims(tl.sum(tl.exp(L - mx), axis=AXIS), AXIS))
    return L - lse


@triton.jit
def token_block(T, BT: tl.constexpr):
    """This program's block of ``BT`` tokens along grid axis 0: the indices, their mask
    (``< T``) and the indices as int64 (for offsets past 2^31 elements)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    return t, t < T, t.to(tl.int64)


@triton.jit
def token_rows(T, BT: tl.constexpr, INNER, DESCENDING: tl.constexpr):
    """A 1-D grid walked row by row: ``INNER`` consecutive programs share a block of ``BT``
    tokens (each takes its own channel block or K split: the first value returned), so the
    kernel moves through the tokens in time, ascending or (DESCENDING) from the last block.
    Consecutive kernels over one tensor walk it in opposite directions: each starts on the
    rows the kernel before it touched last, which are still in L2 (the forward's combine ->
    projection -> aggregate; ``benchmarks/RESULTS.md``, "Per kernel in a training step").
    Returns ``(inner index, token indices, their mask, the indices as int64)``."""
    pid = tl.program_id(0)
    blk = pid // INNER
    if DESCENDING:
        blk = tl.cdiv(T, BT) - 1 - blk
    t = blk * BT + tl.arange(0, BT)
    return pid % INNER, t, t < T, t.to(tl.int64)


@triton.jit
def stream_strides(N: tl.constexpr, C, X_BCAST: tl.constexpr):
    """(token stride, stream stride) of the streams operand ``x [T, N, C]``: ``(N*C, C)``
    for contiguous streams; ``(C, 0)`` when they are one broadcast row a token (X_BCAST,
    :func:`streams_operand`): every stream's loads then hit the same (cached) bytes."""
    if X_BCAST:
        return C, 0
    else:
        return N * C, C


@triton.jit
def projection_rows(part_ptr, ss_ptr, t64, tmask, T, K, SPLITS, rms_eps, MP: tl.constexpr,
                    BT: tl.constexpr):
    """A token block's projection from its split partials (``part [SPLITS, T, MP]``,
    ``ss [SPLITS, T]``, summed in split order): ``P [BT, MP]`` (fp32, unnormalised) and
    ``rstd [BT] = (sum(x^2) / K + rms_eps)^-1/2``; masked tokens read zeros."""
    mcol = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for s in range(SPLITS):
        row = s * T + t64
        acc += tl.load(part_ptr + row[:, None] * MP + mcol[None, :], mask=tmask[:, None], other=0.0)
        ss += tl.load(ss_ptr + row, mask=tmask, other=0.0)
    return acc, 1.0 / tl.sqrt(ss / K + rms_eps)


@triton.jit
def _aggregate_tile(x_ptr, hpre_ptr, t64, tmask, c, m2, XT, XS, N: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    """``y [BT, BC] = sum_i h_pre[t, i] x[t, i, c]`` (fp32) for the tokens ``t64`` and
    channels ``c`` of the streams at ``x_ptr`` (token stride ``XT``, stream stride ``XS``),
    the streams loaded and added one by one in stream order. Every kernel that forms pre's
    ``y`` does it through this helper, so that they agree bit for bit whatever their tiles
    (a ``tl.sum`` over a stream axis would order the additions by the tile's layout)."""
    y = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(N):
        h_s = tl.load(hpre_ptr + t64 * N + s, mask=tmask, other=0.0)
        xs = tl.load(x_ptr + t64[:, None] * XT + s * XS + c[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        y += h_s[:, None] * xs
    return y


@triton.jit
def _sinkhorn_log(L, iters):
    """``iters`` row-then-column log-normalisations of ``L [BT, N, N]``."""
    for _ in range(iters):
        L = _log_normalize(L, 2)
        L = _log_normalize(L, 1)
    return L


@triton.jit
def _sinkhorn_log_bwd(z, d_h, hist_ptr, t64, tmask, T, iters, N: tl.constexpr):
    """The gradient of the logits ``z [BT, N, N]`` of ``exp(_sinkhorn_log(z, iters))`` given
    the gradient ``d_h`` of that result (fp32, exact): the iterations are replayed once from
    ``z``, each row-normalised state going to the scratch ``hist [iters, T, N*N]`` (rows
    ``t64``, written and read back by this program), then walked in reverse. A forward step
    ``L' = L - lse(L, axis)`` has ``dL = dL' - exp(L') * sum(dL', axis)``."""
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    L = z
    for k in range(iters):
        L = _log_normalize(L, 2)
        row = t64 + k * T  # int64
        tl.store(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :], L,
                 mask=tmask[:, None, None])
        L = _log_normalize(L, 1)
    tl.debug_barrier()
    G = d_h * tl.exp(L)
    for kk in range(iters):
        row = t64 + (iters - 1 - kk) * T
        L_mid = tl.load(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :],
                        mask=tmask[:, None, None], other=0.0)
        L_out = _log_normalize(L_mid, 1)
        G = G - tl.exp(L_out) * tl.expand_dims(tl.sum(G, axis=1), 1)
        G = G - tl.exp(L_mid) * tl.expand_dims(tl.sum(G, axis=2), 2)
    return G


@triton.jit
def _sum_eps(A, eps, AXIS: tl.constexpr):
    """``sum(A, AXIS) + eps``, kept as a size-1 axis (fp32): the divisor of one normalisation
    step of DeepSeek-V4's Sinkhorn, ``A / _sum_eps(A, eps, AXIS)``."""
    return tl.expand_dims(tl.sum(A, axis=AXIS), AXIS) + eps


@triton.jit
def _softmax_rows(L):
    """The softmax of ``L [BT, N, N]`` over each row (axis 2) (fp32)."""
    e = tl.exp(L - tl.expand_dims(tl.max(L, axis=2), 2))
    return e / tl.expand_dims(tl.sum(e, axis=2), 2)


@triton.jit
def _sinkhorn_dsv4(L, iters, eps):
    """DeepSeek-V4's Sinkhorn of the logits ``L [BT, N, N]`` (axis 1 the row index ``i``,
    axis 2 the column ``j``), in the linear domain:
    ``M = softmax(L, rows) + eps; M /= (column sums + eps)``, then ``iters - 1`` times
    ``M /= (row sums + eps); M /= (column sums + eps)`` (fp32)."""
    M = _softmax_rows(L) + eps
    M = M / _sum_eps(M, eps, 1)
    for _ in range(iters - 1):
        M = M / _sum_eps(M, eps, 2)
        M = M / _sum_eps(M, eps, 1)
    return M


@triton.jit
def _normalize_bwd(B, S, dB, AXIS: tl.constexpr):
    """The gradient of ``A`` of ``B = A / S``, ``S = sum(A, AXIS) + eps``, given ``dB``:
    ``dA = (dB - sum(dB * B, AXIS)) / S``."""
    return (dB - tl.expand_dims(tl.sum(dB * B, axis=AXIS), AXIS)) / S


@triton.jit
def _sinkhorn_dsv4_bwd(z, d_m, hist_ptr, t64, tmask, T, iters, eps, N: tl.constexpr):
    """The gradient of the logits ``z [BT, N, N]`` of ``_sinkhorn_dsv4(z, iters, eps)`` given
    the gradient ``d_m`` of that result (fp32, exact). The iterations are replayed once from
    ``z``; the input of each row + column pair ``k = 1 .. iters-1`` (the state after the
    pair before) goes to the scratch ``hist [iters, T, N*N]`` at row ``k - 1`` (rows ``t64``,
    written and read back by this program). The walk back recomputes each pair's two
    normalisations from its input (:func:`_normalize_bwd`), then the first column
    normalisation from ``A_0 = P + eps`` and the softmax ``P``:
    ``dz = P * (dA_0 - sum(dA_0 * P, over each row))``."""
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    P = _softmax_rows(z)
    M = P + eps
    M = M / _sum_eps(M, eps, 1)
    for k in range(iters - 1):
        row = t64 + k * T  # int64
        tl.store(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :], M,
                 mask=tmask[:, None, None])
        M = M / _sum_eps(M, eps, 2)
        M = M / _sum_eps(M, eps, 1)
    tl.debug_barrier()
    G = d_m
    for kk in range(iters - 1):
        row = t64 + (iters - 2 - kk) * T
        A = tl.load(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :],
                    mask=tmask[:, None, None], other=1.0)  # (no 0/0 for masked tokens)
        s_row = _sum_eps(A, eps, 2)
        R = A / s_row
        s_col = _sum_eps(R, eps, 1)
        G = _normalize_bwd(R, s_row, _normalize_bwd(R / s_col, s_col, G, 1), 2)
    A0 = P + eps
    s_col = _sum_eps(A0, eps, 1)
    G = _normalize_bwd(A0 / s_col, s_col, G, 1)
    return P * (G - tl.expand_dims(tl.sum(G * P, axis=2), 2))


@triton.jit
def _mapping_logits(ht_ptr, alpha_ptr, bias_ptr, t64, tmask, N: tl.constexpr, MP: tl.constexpr):
    """Load Ht for a token block and return the pre/post/res logits (fp32)."""
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    row = ht_ptr + t64 * MP
    ht_pre = tl.load(row[:, None] + i[None, :], mask=tmask[:, None], other=0.0)
    ht_post = tl.load(row[:, None] + N + i[None, :], mask=tmask[:, None], other=0.0)
    ht_res = tl.load(row[:, None, None] + 2 * N + ij[None, :, :], mask=tmask[:, None, None],
                     other=0.0)
    z_pre = a_pre * ht_pre + tl.load(bias_ptr + i).to(tl.float32)[None, :]
    z_post = a_post * ht_post + tl.load(bias_ptr + N + i).to(tl.float32)[None, :]
    z_res = a_res * ht_res + tl.load(bias_ptr + 2 * N + ij).to(tl.float32)[None, :, :]
    return z_pre, z_post, z_res, ht_pre, ht_post, ht_res, a_pre, a_post, a_res


# --------------------------------------------------------------------- tiles, launch shapes
@dataclass
class KernelTiles:
    """Tile sizes and launch shapes; n=4 values from ``benchmarks/tune_tiles.py``, the
    H100's best at M x C = 4096 x 4096 and 16384 x 4096 in bf16 (``benchmarks/RESULTS.md``,
    "Tile search").

    The projection streams phi once per token block (L2), so blocks of 64 tokens keep phi's
    traffic below x's. The mapping kernels are a serial chain of log-normalisations per program
    (latency, not bandwidth): one warp a program keeps every reduction in shuffles (no
    cross-warp round trips), and 16 tokens a program spread the chains over the SMs at short
    sequences (64 tokens and 4 warps a program are slower: ``benchmarks/RESULTS.md``, "Tried and
    dropped"). The output head's weight kernels have no such chain (a sigmoid a weight): larger
    blocks (not tuned). n=8 pads the mapping to 128 columns and needs smaller projection tiles
    to fit shared memory. Reductions over K / C / T are split across programs (fp32 partials,
    summed in a fixed order) so that about ``target_programs`` programs are in flight. "loop
    stages": the streaming loops of the combine's backward and of pre's dx pass are
    software-pipelined as a whole (``tl.range(..., num_stages=...)``): a launch's ``num_stages``
    pipelines only the loads that feed a ``tl.dot``. "maps_agg": for small inputs, where a step
    is bound by host time, pre's mapping kernel also forms the aggregate ``y`` of its tokens
    (one launch fewer; the same bits, :func:`_aggregate_tile`); larger inputs keep the
    aggregate's own, wider kernel. "dx_streams": a program of pre's dx pass covers that many
    streams of ``dx[1] / dx_streams`` channels each, reading the dy tile and the n tiles of
    the combine's ``g`` once for them (1: one stream a program, the n programs of a channel
    block sharing those through L2; 2, the default, halves those reads and needs less shared
    memory)."""

    proj: dict = field(default_factory=lambda: {  # n: (tokens, K step, warps, stages)
        1: (64, 64, 8, 3), 2: (64, 64, 8, 3), 4: (64, 128, 4, 3), 8: (16, 32, 4, 2)})
    target_programs: int = 512
    maps: tuple = (16, 1)                   # per-token mapping math (Sinkhorn): (tokens, warps)
    maps_agg: tuple = (1 << 20, 8192, 128)  # pre's aggregate inside the mapping kernel for x of
    #                  at most this many elements, n*C at most this wide: (elements, n*C, channels
    #                  a step; one warp a program walks n*C for each of its tokens)
    head: tuple = (64, 4)                   # output head's per-token weights: (tokens, warps)
    sweep: tuple = (8, 1024, 8)             # aggregate, dH_pre: (tokens, n*channels, warps)
    combine_fwd: tuple = (2, 512, 4)        # (tokens, channels, warps)
    combine_bwd: tuple = (8, 128, 4, 2)     # (tokens, channels per step, warps, loop stages)
    dx: tuple = (64, 64, 4, 3)              # dx + dphi: (tokens/step, channels, warps, loop stages)
    dx_streams: int = 2                     # streams a dx + dphi program covers: its tile's
    #                  channels split among them (a power of 2; n at most)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        PLANS.clear()  # launch plans are derived from the tiles
        _SCRATCH_HELD.clear()  # and their temporaries go with them


class _Plans(dict):
    """The launch plans' dict; ``generation`` counts its clears, so that what was made from
    the plans it held (the ops' call sites, :class:`~mhc_megatron.kernels.native_autograd.
    CallSite`) can tell it is out of date."""

    generation = 0

    def clear(self):
        super().clear()
        self.generation += 1


PLANS: _Plans = _Plans()  # launch plans of the ops by (op, shape, dtype, precision): see plan()
# the reused temporaries' sets (Scratch): (Scratch, key) -> bytes, least recently used first
_SCRATCH_HELD: OrderedDict = OrderedDict()
TILES = KernelTiles()


def plan(make, *key):
    """``make(*key)``, computed once per key until ``TILES`` changes: the ops look their
    launch shapes (grids, tiles, splits, precisions) up instead of deriving them per call."""
    entry = PLANS.get((make, *key))
    if entry is None:
        entry = PLANS[(make, *key)] = make(*key)
    return entry


class Scratch:
    """The temporaries of one launch plan (``specs``: ``(shape, dtype)`` each), reused from call
    to call: an op's split partials and per-program sums live only between its own launches,
    and its kernels write every element they read, as with ``torch.empty``.

    One set per device and CUDA stream: on one stream the next call's kernels run after this
    call's, so a set is never in use twice at once. Fresh tensors while a CUDA graph is being
    captured (they then belong to the graph's memory pool), while ``torch.compile`` traces, and
    for a plan whose temporaries exceed ``SCRATCH_LIMIT`` bytes (large inputs: the GPU time
    dwarfs an allocation's host time there). The sets of all plans together hold at most
    ``SCRATCH_BUDGET`` bytes: past it the least recently used sets are dropped (inputs whose
    token count keeps changing, as in inference, make a plan per count)."""

    __slots__ = ("specs", "nbytes", "reuse", "_sets")

    def __init__(self, *specs: tuple[tuple[int, ...], torch.dtype]):
        self.specs = specs
        self.nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs)
        self.reuse = self.nbytes <= SCRATCH_LIMIT
        self._sets: dict = {}

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if not self.reuse or _compiling():
            return self._fresh(device)
        if device.type != "cuda":
            key = device.type
        elif torch._C._cuda_isCurrentStreamCapturing():  # (torch.cuda's, unwrapped)
            return self._fresh(device)
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            key = (index, torch._C._cuda_getCurrentRawStream(index))
        found = self._sets.get(key)
        if found is None:
            found = self._sets[key] = self._fresh(device)
            _SCRATCH_HELD[(self, key)] = self.nbytes
            _drop_least_recent_scratch()
        else:
            _SCRATCH_HELD.move_to_end((self, key))
        return found

    def _fresh(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(shape, device=device, dtype=dtype) for shape, dtype in self.specs)


SCRATCH_LIMIT = 64 << 20  # bytes of one plan's temporaries reused (see Scratch)
SCRATCH_BUDGET = 256 << 20  # bytes of all the reused sets together


def _drop_least_recent_scratch() -> None:
    """Drop the least recently used scratch sets while they hold more than SCRATCH_BUDGET (the
    newest set stays). A dropped set's memory goes back to torch's allocator, which hands it
    out again only after the kernels queued on its stream have used it."""
    while len(_SCRATCH_HELD) > 1 and sum(_SCRATCH_HELD.values()) > SCRATCH_BUDGET:
        (scratch, key), _ = _SCRATCH_HELD.popitem(last=False)
        scratch._sets.pop(key, None)


def _sweep_bc(n: int, C: int) -> int:
    """Channels per program of the [tokens, n, channels] sweeps."""
    return max(16, min(TILES.sweep[1] // n, next_pow2(C)))


def _splits(blocks: int, length: int, step: int) -> tuple[int, int]:
    """(splits, length per split, a multiple of ``step``) for ``blocks * splits`` programs
    ~ ``TILES.target_programs``."""
    want = max(1, min(cdiv(TILES.target_programs, max(blocks, 1)), cdiv(length, step)))
    per = cdiv(cdiv(length, want), step) * step
    return cdiv(length, per), per


def _check(x: torch.Tensor, n: int) -> None:
    if n not in SUPPORTED_STREAMS:
        raise ValueError(f"Triton mHC kernels support n in {SUPPORTED_STREAMS}, got n={n}. "
                         "Fix: use mhc_kernel_backend='reference' (or 'auto') for this n.")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Triton mHC kernels support {SUPPORTED_DTYPES}, got {x.dtype}. "
                         "Fix: use mhc_kernel_backend='reference' (or 'auto') for this dtype.")


def streams_operand(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(x, broadcast)``: the streams as the kernels read them. ``x [T, n, C]`` whose n
    streams are one copy, a view ``h.view(T, 1, C).expand(T, n, C)`` of contiguous rows
    (stream stride 0: global layer 1's expansion,
    :func:`~mhc_megatron.layers.streams.broadcast_streams`), is read as it is (``broadcast``
    True), never materialised; anything else is made contiguous (``broadcast`` False)."""
    if (x.dim() == 3 and x.shape[1] > 1 and x.stride(1) == 0 and x.stride(2) == 1
            and x.stride(0) == x.shape[2]):
        return x, True
    return x.contiguous(), False


def contiguous_f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous fp32 (itself when it already is)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()
