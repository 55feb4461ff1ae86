"""The backward kernels of the fused Triton "pre" op (:mod:`~mhc_megatron.kernels.triton_pre`)
and their launch plan.

``_dhpre_partial`` (``dH_pre`` partials over C splits), ``_mappings_bwd`` (sigmoid and Sinkhorn
backward, the paper's form or DeepSeek-V4's, exact: the iterations are replayed once from the
logits into an fp32 scratch and walked back; writes per token block the sums of the logit
gradients for ``dalpha``/``dbias``, and ``dP`` and the RMS term), ``_pre_dx_dphi`` (one more
pass over x: ``dx`` and the ``dphi`` partials together; adds the combine's ``dx``,
``H_res^T g``, from the upstream gradient ``g`` the combine hands over by
:class:`~mhc_megatron.kernels.handoff.DxLink`) and ``_param_grads`` (the fixed-order sums of the
partials into ``dphi``, ``dbias``, ``dalpha`` in the parameters' dtypes).

``_dhpre_partial``, ``_pre_dx_dphi`` and ``_param_grads`` also run the output head's backward
(:mod:`~mhc_megatron.kernels.triton_head`, with ``M = n`` projection rows and one alpha).

Host side: the launch shapes of a (T, n, C, dtype, form) (:class:`_PreBackwardPlan`, computed
once by :func:`~mhc_megatron.kernels.triton_common.plan`; the shapes it shares with the head's
in :class:`_BackwardShapes`), a
:class:`~mhc_megatron.kernels.launch.Launcher` per kernel, and :func:`_launch_dx_dphi` and
:func:`_launch_param_grads` (the dx pass and the parameter-gradient sums at as many loop stages
as fit in shared memory).
"""

from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from mhc_megatron.kernels.launch import Launcher, LaunchPlan, Meta, cdiv, next_pow2
from mhc_megatron.kernels.log import log_rank0
from mhc_megatron.kernels.triton_common import (
    TILES,
    Scratch,
    _dot_precision,
    _mapping_logits,
    _padded_m,
    _sinkhorn_dsv4_bwd,
    _sinkhorn_log_bwd,
    _splits,
    _sweep_bc,
    stream_strides,
    token_block,
)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _dhpre_partial(x_ptr, dy_ptr, part_ptr, T, C, C_PER_SPLIT, N: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, X_BCAST: tl.constexpr):
    """part[s, t, i] = sum over channels of C-split s of dy[t, c] x[t, i, c]."""
    XT, XS = stream_strides(N, C, X_BCAST)
    t, tmask, t64 = token_block(T, BT)
    split = tl.program_id(1)
    i = tl.arange(0, N)
    acc = tl.zeros([BT, N], dtype=tl.float32)
    c_start = split * C_PER_SPLIT
    for c0 in range(c_start, c_start + C_PER_SPLIT, BC):
        c = c0 + tl.arange(0, BC)
        m2 = tmask[:, None] & (c < C)[None, :]
        x3 = tl.load(x_ptr + t64[:, None, None] * XT + i[None, :, None] * XS + c[None, None, :],
                     mask=m2[:, None, :], other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + t64[:, None] * C + c[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(x3 * dy[:, None, :], axis=2)
    row = split.to(tl.int64) * T + t64
    tl.store(part_ptr + row[:, None] * N + i[None, :], acc, mask=tmask[:, None])


@triton.jit
def _mappings_bwd(part_ptr, SPLITS, dhpre_ptr, dhpost_ptr, dhres_ptr, ht_ptr, rstd_ptr,
                  alpha_ptr, bias_ptr, red_ptr, dp_ptr, coef_ptr, hist_ptr, T, K, iters, form_eps,
                  HAS_DHPRE: tl.constexpr, N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr,
                  DSV4: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Per token block: sigmoid and Sinkhorn backward, then the logit grads dz, dP [T, MP]
    (its padding columns zeroed) and the RMS coefficient [T] for dx. The mappings' form as in
    ``triton_pre_fwd._mappings_fwd`` (DSV4, TRANSPOSED: ``dh_res [T, N, N]`` is then the
    gradient of ``M^T``, read transposed; ``form_eps``).

    dz is only summed over tokens: this program writes its block's sums to
    ``red [program, MP]``, columns ``[0, M)`` the bias grads (sum of dz) and ``[M, M+3)``
    the alpha grads (sum of dz * Ht per pre / post / res group); the caller sums the rows.

    The Sinkhorn backward (:func:`~mhc_megatron.kernels.triton_common._sinkhorn_log_bwd`, or
    with DSV4 :func:`~mhc_megatron.kernels.triton_common._sinkhorn_dsv4_bwd`) replays the
    iterations once from the logits into the scratch ``hist [iters, T, N*N]`` (fp32, written
    and read back by the same program), then walks them in reverse."""
    t, tmask, t64 = token_block(T, BT)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    if TRANSPOSED:
        ij_res = i[:, None] + i[None, :] * N
    else:
        ij_res = ij
    d_pre = tl.zeros([BT, N], dtype=tl.float32)
    for s in range(SPLITS):
        d_pre += tl.load(part_ptr + (s * T + t64)[:, None] * N + i[None, :], mask=tmask[:, None],
                         other=0.0)
    if HAS_DHPRE:
        d_pre += tl.load(dhpre_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)

    z_pre, z_post, z_res, ht_pre, ht_post, ht_res, a_pre, a_post, a_res = _mapping_logits(
        ht_ptr, alpha_ptr, bias_ptr, t64, tmask, N, MP)
    s_pre = tl.sigmoid(z_pre)
    s_post = tl.sigmoid(z_post)
    dz_pre = d_pre * s_pre * (1.0 - s_pre)
    d_post = tl.load(dhpost_ptr + t64[:, None] * N + i[None, :], mask=tmask[:, None], other=0.0)
    dz_post = d_post * 2.0 * s_post * (1.0 - s_post)

    d_res = tl.load(dhres_ptr + t64[:, None, None] * (N * N) + ij_res[None, :, :],
                    mask=tmask[:, None, None], other=0.0)
    if DSV4:
        dz_res = _sinkhorn_dsv4_bwd(z_res, d_res, hist_ptr, t64, tmask, T, iters, form_eps, N)
    else:
        dz_res = _sinkhorn_log_bwd(z_res, d_res, hist_ptr, t64, tmask, T, iters, N)

    # masked tokens have dz = 0 (their upstream grads load as 0) and Ht = 0
    M: tl.constexpr = 2 * N + N * N
    red = red_ptr + tl.program_id(0).to(tl.int64) * MP
    tl.store(red + i, tl.sum(dz_pre, axis=0))
    tl.store(red + N + i, tl.sum(dz_post, axis=0))
    tl.store(red + 2 * N + ij, tl.sum(dz_res, axis=0))
    g = tl.arange(0, 4)
    a_grads = tl.where(g == 0, tl.sum(tl.sum(dz_pre * ht_pre, axis=1), axis=0),
                       tl.where(g == 1, tl.sum(tl.sum(dz_post * ht_post, axis=1), axis=0),
                                tl.sum(tl.sum(tl.sum(dz_res * ht_res, axis=2), axis=1),
                                       axis=0)))
    tl.store(red + M + g, a_grads, mask=g < 3)

    # Ht = P * rstd, rstd = (sum(x^2)/K + eps)^-1/2:
    #   dP = dHt * rstd;  dx += dP @ phi - (sum_m dHt_m Ht_m) * rstd^2 / K * x
    rstd = tl.load(rstd_ptr + t, mask=tmask, other=0.0)
    dht_pre = dz_pre * a_pre
    dht_post = dz_post * a_post
    dht_res = dz_res * a_res
    dsum = (tl.sum(dht_pre * ht_pre, axis=1) + tl.sum(dht_post * ht_post, axis=1)
            + tl.sum(tl.sum(dht_res * ht_res, axis=2), axis=1))
    tl.store(coef_ptr + t, -dsum * rstd * rstd / K, mask=tmask)
    prow = dp_ptr + t64 * MP
    tl.store(prow[:, None] + i[None, :], dht_pre * rstd[:, None], mask=tmask[:, None])
    tl.store(prow[:, None] + N + i[None, :], dht_post * rstd[:, None], mask=tmask[:, None])
    tl.store(prow[:, None, None] + 2 * N + ij[None, :, :], dht_res * rstd[:, None, None],
             mask=tmask[:, None, None])
    if MP > M:  # _pre_dx_dphi reads dP's padding columns: zeros
        pad = tl.arange(0, MP)
        tl.store(prow[:, None] + pad[None, :], tl.zeros([BT, MP], dtype=tl.float32),
                 mask=tmask[:, None] & (pad >= M)[None, :])


@triton.jit
def _per_stream(v, SP: tl.constexpr, BC: tl.constexpr):
    """``v [BT, SP]`` (a value per token and stream) as ``[BT, SP * BC]``: column ``j`` holds
    stream ``j // BC``'s."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (v.shape[0], SP, BC)),
                      (v.shape[0], SP * BC))


@triton.jit
def _per_channel(v, SP: tl.constexpr, BC: tl.constexpr):
    """``v [BT, BC]`` (a value per token and channel) as ``[BT, SP * BC]``: column ``j``
    holds channel ``j % BC``'s."""
    return tl.reshape(tl.broadcast_to(v[:, None, :], (v.shape[0], SP, BC)),
                      (v.shape[0], SP * BC))


@triton.jit
def _pre_dx_dphi(x_ptr, dy_ptr, hpre_ptr, dp_ptr, coef_ptr, phi_ptr, g_ptr, hres_ptr, dx_ptr,
                 dphi_ptr, T, C, TOKENS_PER_SPLIT, HAS_G: tl.constexpr, N: tl.constexpr,
                 M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 SP: tl.constexpr, PREC: tl.constexpr, X_BCAST: tl.constexpr,
                 LOOP_STAGES: tl.constexpr):
    """One pass over x for both x and phi gradients of "pre".

    Program (``SP`` streams, a block of ``BC`` channels, token split) walks its tokens:
    ``dx[t, s, c] = (dP @ phi)[t, s*C+c] + coef[t] x[t, s, c] + h_pre[t, s] dy[t, c]
    (+ sum_i H_res[t, i, s] g[t, i, c], the combine's dx from its upstream gradient ``g``
    [T, N, C] and ``H_res`` [T, N, N], when HAS_G: the fold of
    :class:`~mhc_megatron.kernels.handoff.DxLink`)`` and accumulates
    ``dphi_part[split, :, s*C+c] = sum_t dP[t, :]^T x[t, s, c]``. ``SP`` = 1: stream ``s``;
    the stream index varies fastest in the launch order, so the N programs sharing a dy tile
    (and the N tiles of ``g``) run together and share them through L2. ``SP`` > 1: the tile's
    column ``j`` is stream ``s0 + j // BC``, channel ``c0 + j % BC`` (``SP * BC`` columns), so
    one program reads the dy tile and the N tiles of ``g`` once for its SP streams (dP's rows
    are read once a program either way, by as many programs a token); those tiles and the
    per-stream ``h_pre`` and ``H_res`` are loaded at their own width and widened to the
    tile's columns in registers (loaded at the tile's width, each would take a pipelined
    buffer of the tile's size in shared memory).
    The token loop is software-pipelined as a whole (``LOOP_STAGES``): the launch's
    ``num_stages`` would pipeline only the loads that feed a ``tl.dot`` (dP, x), not those of
    dy and of the combine's ``g``."""
    if SP == 1:  # s: the program's stream
        s = tl.program_id(0) % N
        c = (tl.program_id(0) // N) * BC + tl.arange(0, BC)
    else:  # s, c: each column's stream and channel; s0: the first stream, cb: the BC channels
        j = tl.arange(0, SP * BC)
        s0 = (tl.program_id(0) % (N // SP)) * SP
        c0 = (tl.program_id(0) // (N // SP)) * BC
        cb = c0 + tl.arange(0, BC)
        s = s0 + j // BC
        c = c0 + j % BC
    split = tl.program_id(1)
    cmask = c < C
    K = N * C
    XT, XS = stream_strides(N, C, X_BCAST)
    k = s * C + c
    mcol = tl.arange(0, MP)
    ph = tl.load(phi_ptr + mcol[:, None].to(tl.int64) * K + k[None, :],
                 mask=(mcol[:, None] < M) & cmask[None, :], other=0.0).to(tl.float32)
    dphi = tl.zeros([MP, SP * BC], dtype=tl.float32)
    t_start = split * TOKENS_PER_SPLIT
    for t0 in tl.range(t_start, t_start + TOKENS_PER_SPLIT, BT, num_stages=LOOP_STAGES):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        m2 = tmask[:, None] & cmask[None, :]
        dp = tl.load(dp_ptr + t64[:, None] * MP + mcol[None, :], mask=tmask[:, None], other=0.0)
        coef = tl.load(coef_ptr + t, mask=tmask, other=0.0)
        if SP == 1:
            h_s = tl.load(hpre_ptr + t64 * N + s, mask=tmask, other=0.0)[:, None]
            dy = tl.load(dy_ptr + t64[:, None] * C + c[None, :], mask=m2,
                         other=0.0).to(tl.float32)
        else:  # [BT, SP] and [BT, BC] loads, widened to the tile's columns in registers
            h_s = _per_stream(tl.load(hpre_ptr + t64[:, None] * N + s0
                                      + tl.arange(0, SP)[None, :], mask=tmask[:, None],
                                      other=0.0), SP, BC)
            dy = _per_channel(tl.load(dy_ptr + t64[:, None] * C + cb[None, :],
                                      mask=tmask[:, None] & (cb < C)[None, :],
                                      other=0.0).to(tl.float32), SP, BC)
        offs = t64[:, None] * K + k[None, :]  # dx: [T, N, C]
        xs = tl.load(x_ptr + t64[:, None] * XT + s * XS + c[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        dxs = tl.dot(dp, ph, input_precision=PREC) + coef[:, None] * xs + h_s * dy
        if HAS_G:  # g's N stream tiles (SP = 1: shared by the N programs of a block, in L2)
            for i in tl.static_range(N):
                if SP == 1:
                    g_i = tl.load(g_ptr + t64[:, None] * K + i * C + c[None, :], mask=m2,
                                  other=0.0).to(tl.float32)
                    h_is = tl.load(hres_ptr + t64 * (N * N) + i * N + s, mask=tmask,
                                   other=0.0)[:, None]
                else:
                    g_i = _per_channel(tl.load(g_ptr + t64[:, None] * K + i * C + cb[None, :],
                                               mask=tmask[:, None] & (cb < C)[None, :],
                                               other=0.0).to(tl.float32), SP, BC)
                    h_is = _per_stream(tl.load(hres_ptr + t64[:, None] * (N * N) + i * N + s0
                                               + tl.arange(0, SP)[None, :],
                                               mask=tmask[:, None], other=0.0), SP, BC)
                dxs += h_is * g_i
        tl.store(dx_ptr + offs, dxs.to(dx_ptr.dtype.element_ty), mask=m2)
        dphi = tl.dot(tl.trans(dp), xs, dphi, input_precision=PREC)
    tl.store(dphi_ptr + split.to(tl.int64) * MP * K + mcol[:, None] * K + k[None, :], dphi,
             mask=cmask[None, :])


@triton.jit
def _param_grads(dphi_part_ptr, red_ptr, dphi_ptr, dbias_ptr, dalpha_ptr, SPLITS, SPLIT_STRIDE,
                 MK, ROWS, M: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr,
                 ROWS_STEP: tl.constexpr, NALPHA: tl.constexpr, ACCUMULATE: tl.constexpr,
                 GRAD_ROUND: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """The parameter gradients from their partials, summed in a fixed order.

    Programs ``0 .. P-2``: ``dphi.flat[i] = sum_s dphi_part[s].flat[i]`` for ``i < M*K``
    (``dphi_part [SPLITS, MP, K]``: its first ``M`` rows, flattened, are ``dphi``'s layout).
    The last program: ``dbias[j] = sum_r red[r, j]`` and ``dalpha[g] = sum_r red[r, M + g]``
    for the ``NALPHA`` alphas (``red [ROWS, MP]``, ``M + NALPHA <= MP``, written by
    ``_mappings_bwd``: 3 alphas, or the output head's weight kernel: 1).

    ``ACCUMULATE`` (gradient-accumulation fusion): the outputs are the parameters'
    ``main_grad`` buffers, and each gradient is added to them as Megatron's DDP hook adds a
    parameter's gradient, ``main_grad += grad``: the sum rounded to the parameters' dtype
    (``GRAD_ROUND``, :func:`_to_grad_dtype`) first, then added in fp32 and rounded once to the
    buffer's dtype: the same bits."""
    pid = tl.program_id(0)
    if pid == tl.num_programs(0) - 1:
        j = tl.arange(0, MP)
        r = tl.arange(0, ROWS_STEP)
        red2 = tl.zeros([ROWS_STEP, MP], dtype=tl.float32)
        # ROWS_STEP rows a load, not one row a latency; the loads pipelined LOOP_STAGES deep
        # (the sums in row order)
        for r0 in tl.range(0, ROWS, ROWS_STEP, num_stages=LOOP_STAGES):
            red2 += tl.load(red_ptr + (r0 + r)[:, None] * MP + j[None, :],
                            mask=(r0 + r < ROWS)[:, None], other=0.0)
        red = tl.sum(red2, axis=0)
        _store_grad(dbias_ptr + j, red, j < M, ACCUMULATE, GRAD_ROUND)
        _store_grad(dalpha_ptr + (j - M), red, (j >= M) & (j < M + NALPHA), ACCUMULATE,
                    GRAD_ROUND)
    else:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MK
        dphi = tl.zeros([BLOCK], dtype=tl.float32)
        src = dphi_part_ptr + i
        # pointer steps (no int32 product of the split and its stride); the loads pipelined
        # LOOP_STAGES deep, the sums still in split order
        for _ in tl.range(SPLITS, num_stages=LOOP_STAGES):
            dphi += tl.load(src, mask=mask, other=0.0)
            src += SPLIT_STRIDE
        _store_grad(dphi_ptr + i, dphi, mask, ACCUMULATE, GRAD_ROUND)


@triton.jit
def _to_grad_dtype(v, GRAD_ROUND: tl.constexpr):
    """fp32 ``v`` rounded to the parameters' dtype and back: ``GRAD_ROUND`` 0 fp32 (as is),
    1 bf16, 2 fp16 (:data:`GRAD_ROUND_CODES`)."""
    if GRAD_ROUND == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif GRAD_ROUND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _store_grad(ptr, g, mask, ACCUMULATE: tl.constexpr, GRAD_ROUND: tl.constexpr):
    """A parameter gradient ``g`` (fp32 sums) stored at ``ptr`` in its dtype, or with
    ``ACCUMULATE`` added to the ``main_grad`` there (see :func:`_param_grads`)."""
    if ACCUMULATE:
        prev = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (prev + _to_grad_dtype(g, GRAD_ROUND)).to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, g.to(ptr.dtype.element_ty), mask=mask)



# ------------------------------------------------------------------------------- host side
_DHPRE, _MAPS_BWD = Launcher(_dhpre_partial), Launcher(_mappings_bwd)
_DX_DPHI, _PARAM_GRADS = Launcher(_pre_dx_dphi), Launcher(_param_grads)
_PARAM_GRADS_BLOCK = 1024
# _param_grads' loads in flight: its last program sums the mappings' per-block rows alone, one
# load after another, the kernel's critical path at long sequences (one row block a program of
# 16 tokens)
_PARAM_GRADS_STAGES = 8
logger = logging.getLogger(__name__)


class _BackwardShapes(LaunchPlan):
    """The launch shapes pre's backward and the output head's
    (:mod:`~mhc_megatron.kernels.triton_head`) share, for ``x [T, n, C]`` of ``dtype``: the
    ``dH_pre`` (head: ``dw``) partials (``dh_*``), the dx + dphi pass (``dx_*``, ``m``
    projection rows padded to ``mp``) and the parameter gradients (``grads_*``: ``nalpha``
    alphas, ``map_programs`` rows of block sums)."""

    def _shapes(self, T: int, n: int, C: int, m: int, mp: int, map_programs: int,
                dtype: torch.dtype, forced: str | None, has_g: bool, bcast: bool, nalpha: int):
        LaunchPlan.__init__(self)
        self.m, self.mp, self.K, self.map_programs = m, mp, n * C, map_programs
        bt, bc, warps = TILES.sweep[0], _sweep_bc(n, C), TILES.sweep[2]
        self.dh_splits, per = _splits(cdiv(T, bt), C, bc)
        self.dh_grid = (cdiv(T, bt), self.dh_splits)
        self.dh_per = per
        self.dh_meta = Meta(N=n, BT=bt, BC=bc, X_BCAST=bcast, num_warps=warps)
        bt_dx, width_dx, warps_dx, stages_dx = TILES.dx
        sp = math.gcd(n, TILES.dx_streams)  # streams a program: the tile's width split among
        bc_dx = min(width_dx // sp, max(cdiv(16, sp), next_pow2(C)))  # them (16 for tl.dot)
        dx_blocks = n // sp * cdiv(C, bc_dx)
        self.dx_splits, self.dx_per = _splits(dx_blocks, max(T, 1), bt_dx)
        self.dx_grid = (dx_blocks, self.dx_splits)
        self.dx_meta = Meta(HAS_G=has_g, N=n, M=m, MP=mp, BT=bt_dx, BC=bc_dx, SP=sp,
                            PREC=_dot_precision(dtype, forced), X_BCAST=bcast,
                            LOOP_STAGES=stages_dx, num_warps=warps_dx, num_stages=stages_dx)
        mk = m * self.K
        self.grads_grid = (cdiv(mk, _PARAM_GRADS_BLOCK) + 1,)
        self.grads_meta = Meta(M=m, MP=mp, BLOCK=_PARAM_GRADS_BLOCK,
                               ROWS_STEP=max(1, min(32, next_pow2(map_programs))),
                               NALPHA=nalpha, ACCUMULATE=False, GRAD_ROUND=0,
                               LOOP_STAGES=_PARAM_GRADS_STAGES, num_warps=4)
        self._accumulate_metas: dict = {}

    def accumulate_meta(self, grad_dtype: torch.dtype) -> Meta:
        """``grads_meta`` with ``ACCUMULATE`` for parameters of ``grad_dtype``."""
        meta = self._accumulate_metas.get(grad_dtype)
        if meta is None:
            meta = self._accumulate_metas[grad_dtype] = Meta(**{
                **self.grads_meta.kwargs, "ACCUMULATE": True,
                "GRAD_ROUND": GRAD_ROUND_CODES[grad_dtype]})
        return meta


# _param_grads' GRAD_ROUND: the parameters' dtype, to which a gradient is rounded before it is
# added to a main_grad
GRAD_ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _PreBackwardPlan(_BackwardShapes):
    """Launch shapes of pre's backward for ``x [T, n, C]`` of ``dtype``, the mappings in the
    form ``dsv4`` / ``transposed``
    (:func:`~mhc_megatron.kernels.triton_common.form_flags`)."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, forced: str | None,
                 has_dhpre: bool, has_g: bool, bcast: bool, dsv4: bool = False,
                 transposed: bool = False):
        map_bt, map_warps = TILES.maps
        self._shapes(T, n, C, 2 * n + n * n, _padded_m(n), max(cdiv(T, map_bt), 1), dtype,
                     forced, has_g, bcast, 3)
        self.history_shape = (T, n * n)  # (the Sinkhorn history's rows, per iteration)
        self.map_meta = Meta(HAS_DHPRE=has_dhpre, N=n, MP=self.mp, BT=map_bt, DSV4=dsv4,
                             TRANSPOSED=transposed, num_warps=map_warps)
        # temporaries: dP [T, mp] and its coefficient [T], the dphi partials, the mappings'
        # per-program sums, dH_pre's partials
        f32 = torch.float32
        self.scratch = Scratch(((T, self.mp), f32), ((T,), f32),
                               ((self.dx_splits, self.mp, self.K), f32),
                               ((self.map_programs, self.mp), f32), ((self.dh_splits, T, n), f32))
        self._history: dict = {}

    def sinkhorn_history(self, iters: int) -> Scratch:
        """The mappings backward's Sinkhorn history ``hist [iters, T, n*n]`` (fp32; each
        program writes and reads back its own tokens' rows) as a reused temporary, one set
        per iteration count."""
        found = self._history.get(iters)
        if found is None:
            found = self._history[iters] = Scratch(
                ((max(iters, 1), *self.history_shape), torch.float32))
        return found


def _launch_dx_dphi(p: _BackwardShapes, sig: tuple | None, *args) -> None:
    """``_pre_dx_dphi`` at its plan's loop stages, fewer where they do not fit
    (:func:`_with_fewer_stages`): with the combine's ``g`` a stage buffers n stream tiles of
    it, too many for 3 stages at n=8 in fp32 on an H100."""

    def fewer(stages: int) -> None:
        p.dx_meta = Meta(**{**p.dx_meta.kwargs, "LOOP_STAGES": stages, "num_stages": stages})

    _with_fewer_stages("dx pass", lambda: _DX_DPHI.signed(p, sig, p.dx_grid, p.dx_meta, *args),
                       lambda: p.dx_meta.kwargs["LOOP_STAGES"], fewer)


def _launch_param_grads(p: _BackwardShapes, sig: tuple | None, grad_dtype: torch.dtype | None,
                        *args) -> None:
    """``_param_grads`` at its plan's loop stages (``grads_meta``, or with ``grad_dtype`` the
    gradient-accumulation fusion's :meth:`~_BackwardShapes.accumulate_meta`), fewer where
    they do not fit (:func:`_with_fewer_stages`)."""

    def launch() -> None:
        meta = p.grads_meta if grad_dtype is None else p.accumulate_meta(grad_dtype)
        _PARAM_GRADS.signed(p, sig, p.grads_grid, meta, *args)

    def fewer(stages: int) -> None:
        p.grads_meta = Meta(**{**p.grads_meta.kwargs, "LOOP_STAGES": stages})
        p._accumulate_metas.clear()

    _with_fewer_stages("parameter gradients", launch, lambda: p.grads_meta.kwargs["LOOP_STAGES"],
                       fewer)


def _with_fewer_stages(what: str, launch, stages, fewer) -> None:
    """``launch()``; each time the GPU's shared memory cannot hold the kernel's pipelined
    loop stages (``stages()``), ``fewer(stages() - 1)`` (kept in the launch plan) and again."""
    while True:
        try:
            launch()
            return
        except OutOfResources:
            have = stages()
            if have <= 1:
                raise
            fewer(have - 1)
            log_rank0(logger, logging.INFO, "mHC %s: %d loop stages do not fit in shared "
                      "memory here; %d", what, have, have - 1)
