"""What the per-token mapping kernels cost at short sequences: the Sinkhorn chain in two
register layouts (GPU only; probe kernels here, the product code is not touched).

At T = 4096 tokens the mapping kernels run 64 programs, fewer than the SMs, and each is a
serial chain of ``2 * iters`` log-normalisations (forward) or three times that (backward:
replay, then walk back). Their time is that chain's latency. This probe times the chain in

* ``token-first``: ``[BT, n, n]`` tiles (the product's layout: tokens on the slow axis, the
  n x n matrix spread over threads, so each normalisation reduces across threads);
* ``token-last``: ``[n, n, BT]`` tiles loaded from a token-contiguous ``[n*n, T]`` copy, so
  each thread holds whole n x n matrices and reduces in registers;

for several tokens per program and warps, forward (Sinkhorn, then exp) and backward (replay
into a scratch, then the reverse walk), and prints a table. Checks the two layouts agree.

    python benchmarks/probe_sinkhorn.py [--tokens 4096 16384] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import bench  # noqa: E402
from mhc_megatron.kernels.triton_common import _log_normalize  # noqa: E402


@triton.jit
def _fwd_first(z_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = t.to(tl.int64)[:, None, None] * (N * N) + ij[None, :, :]
    L = tl.load(z_ptr + offs, mask=tmask[:, None, None], other=0.0)
    for _ in range(iters):
        L = _log_normalize(L, 2)
        L = _log_normalize(L, 1)
    tl.store(out_ptr + offs, tl.exp(L), mask=tmask[:, None, None])


@triton.jit
def _fwd_last(z_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = ij[:, :, None].to(tl.int64) * T + t[None, None, :]
    L = tl.load(z_ptr + offs, mask=tmask[None, None, :], other=0.0)
    for _ in range(iters):
        L = _log_normalize(L, 1)
        L = _log_normalize(L, 0)
    tl.store(out_ptr + offs, tl.exp(L), mask=tmask[None, None, :])


@triton.jit
def _bwd_first(z_ptr, d_ptr, hist_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = t64[:, None, None] * (N * N) + ij[None, :, :]
    L = tl.load(z_ptr + offs, mask=tmask[:, None, None], other=0.0)
    for k in range(iters):
        L = _log_normalize(L, 2)
        tl.store(hist_ptr + (t64 + k * T)[:, None, None] * (N * N) + ij[None, :, :], L,
                 mask=tmask[:, None, None])
        L = _log_normalize(L, 1)
    tl.debug_barrier()
    G = tl.load(d_ptr + offs, mask=tmask[:, None, None], other=0.0) * tl.exp(L)
    for kk in range(iters):
        row = t64 + (iters - 1 - kk) * T
        L_mid = tl.load(hist_ptr + row[:, None, None] * (N * N) + ij[None, :, :],
                        mask=tmask[:, None, None], other=0.0)
        L_out = _log_normalize(L_mid, 1)
        G = G - tl.exp(L_out) * tl.expand_dims(tl.sum(G, axis=1), 1)
        G = G - tl.exp(L_mid) * tl.expand_dims(tl.sum(G, axis=2), 2)
    tl.store(out_ptr + offs, G, mask=tmask[:, None, None])


@triton.jit
def _bwd_last(z_ptr, d_ptr, hist_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = ij[:, :, None].to(tl.int64) * T + t[None, None, :]
    m3 = tmask[None, None, :]
    L = tl.load(z_ptr + offs, mask=m3, other=0.0)
    for k in range(iters):
        L = _log_normalize(L, 1)
        tl.store(hist_ptr + k * (N * N) * T + offs, L, mask=m3)
        L = _log_normalize(L, 0)
    tl.debug_barrier()
    G = tl.load(d_ptr + offs, mask=m3, other=0.0) * tl.exp(L)
    for kk in range(iters):
        L_mid = tl.load(hist_ptr + (iters - 1 - kk) * (N * N) * T + offs, mask=m3, other=0.0)
        L_out = _log_normalize(L_mid, 0)
        G = G - tl.exp(L_out) * tl.expand_dims(tl.sum(G, axis=0), 0)
        G = G - tl.exp(L_mid) * tl.expand_dims(tl.sum(G, axis=1), 1)
    tl.store(out_ptr + offs, G, mask=m3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--n", type=int, default=4)
    a = ap.parse_args()
    n, iters = a.n, a.iters
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(f"n={n}, iters={iters}; median us per launch (triton do_bench)\n")
    print("| T | pass | layout | tokens/program | warps | programs | us |")
    print("|---|---|---|---|---|---|---|")
    for T in a.tokens:
        g = torch.Generator(device="cuda").manual_seed(0)
        z = torch.randn(T, n * n, device="cuda", generator=g) * 3
        d = torch.randn(T, n * n, device="cuda", generator=g)
        zt, dt = z.t().contiguous(), d.t().contiguous()
        hist = torch.empty(iters, T, n * n, device="cuda")
        out_first = torch.empty_like(z)
        out_last = torch.empty_like(zt)
        for pass_ in ("fwd", "bwd"):
            ref = None
            for layout, configs in (("token-first", [(16, 1), (64, 4), (64, 2), (32, 1)]),
                                    ("token-last", [(32, 1), (64, 2), (128, 4), (64, 1),
                                                    (128, 1), (256, 2)])):
                for bt, warps in configs:
                    grid = (triton.cdiv(T, bt),)
                    if layout == "token-first":
                        out = out_first
                        if pass_ == "fwd":
                            fn = lambda: _fwd_first[grid](z, out, T, iters, N=n, BT=bt,  # noqa
                                                          num_warps=warps)
                        else:
                            fn = lambda: _bwd_first[grid](z, d, hist, out, T, iters, N=n,  # noqa
                                                          BT=bt, num_warps=warps)
                    else:
                        out = out_last
                        if pass_ == "fwd":
                            fn = lambda: _fwd_last[grid](zt, out, T, iters, N=n, BT=bt,  # noqa
                                                         num_warps=warps)
                        else:
                            fn = lambda: _bwd_last[grid](zt, dt, hist, out, T, iters, N=n,  # noqa
                                                         BT=bt, num_warps=warps)
                    fn()
                    torch.cuda.synchronize()
                    got = out if layout == "token-first" else out.t()
                    if ref is None:
                        ref = got.clone()
                    err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                    us = bench(fn) * 1e3
                    print(f"| {T} | {pass_} | {layout} | {bt} | {warps} | {grid[0]} | {us:.1f} |"
                          + ("" if err < 1e-4 else f" MISMATCH rel {err:.2e}"))


if __name__ == "__main__":
    main()
