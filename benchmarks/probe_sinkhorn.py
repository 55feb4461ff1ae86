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
    TRITON_INTERPRET=1 python benchmarks/probe_sinkhorn.py --check   # correctness only
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
from mhc_megatron.kernels.triton_common import (  # noqa: E402
    _log_normalize,
    _sinkhorn_log,
    _sinkhorn_log_bwd,
    token_block,
)


@triton.jit
def _fwd_first(z_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t, tmask, t64 = token_block(T, BT)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = t64[:, None, None] * (N * N) + ij[None, :, :]
    L = _sinkhorn_log(tl.load(z_ptr + offs, mask=tmask[:, None, None], other=0.0), iters)
    tl.store(out_ptr + offs, tl.exp(L), mask=tmask[:, None, None])


@triton.jit
def _fwd_last(z_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t, tmask, t64 = token_block(T, BT)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = ij[:, :, None].to(tl.int64) * T + t64[None, None, :]
    L = tl.load(z_ptr + offs, mask=tmask[None, None, :], other=0.0)
    for _ in range(iters):
        L = _log_normalize(L, 1)
        L = _log_normalize(L, 0)
    tl.store(out_ptr + offs, tl.exp(L), mask=tmask[None, None, :])


@triton.jit
def _bwd_first(z_ptr, d_ptr, hist_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t, tmask, t64 = token_block(T, BT)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = t64[:, None, None] * (N * N) + ij[None, :, :]
    z = tl.load(z_ptr + offs, mask=tmask[:, None, None], other=0.0)
    d = tl.load(d_ptr + offs, mask=tmask[:, None, None], other=0.0)
    G = _sinkhorn_log_bwd(z, d, hist_ptr, t64, tmask, T, iters, N)  # the product's own
    tl.store(out_ptr + offs, G, mask=tmask[:, None, None])


@triton.jit
def _bwd_last(z_ptr, d_ptr, hist_ptr, out_ptr, T, iters, N: tl.constexpr, BT: tl.constexpr):
    t, tmask, t64 = token_block(T, BT)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    offs = ij[:, :, None].to(tl.int64) * T + t64[None, None, :]
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


def check(n: int, iters: int, T: int = 37, device: str = "cpu") -> None:
    """The four probe kernels against the reference Sinkhorn, forward and backward (CPU
    under ``TRITON_INTERPRET=1``, or CUDA): what the timings time is the real chain."""
    from mhc_megatron.kernels.reference import sinkhorn

    z = torch.randn(T, n, n, device=device) * 3
    d = torch.randn(T, n, n, device=device)
    leaf = z.clone().requires_grad_()
    want_fwd = sinkhorn(leaf, iters)
    want_fwd.backward(d)
    want = {"fwd": want_fwd.detach().reshape(T, -1), "bwd": leaf.grad.reshape(T, -1)}
    z2, d2 = z.reshape(T, -1), d.reshape(T, -1)
    hist = torch.empty(iters, T, n * n, device=device)
    for name, kernel, args, last in (("fwd", _fwd_first, (z2,), False),
                                     ("bwd", _bwd_first, (z2, d2, hist), False),
                                     ("fwd", _fwd_last, (z2.t().contiguous(),), True),
                                     ("bwd", _bwd_last, (z2.t().contiguous(), d2.t().contiguous(),
                                                         hist), True)):
        out = torch.empty((n * n, T) if last else (T, n * n), device=device)
        kernel[(triton.cdiv(T, 16),)](*args, out, T, iters, N=n, BT=16)
        got = out.t() if last else out
        torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-5,
                                   msg=f"{kernel.fn.__name__} != reference")
    print(f"probe kernels equal the reference Sinkhorn (n={n}, {iters} iterations, T={T})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--check", action="store_true",
                    help="only check the probe kernels against the reference (no GPU needed "
                         "with TRITON_INTERPRET=1)")
    a = ap.parse_args()
    n, iters = a.n, a.iters
    if a.check:
        check(n, iters, device="cuda" if torch.cuda.is_available() else "cpu")
        return
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
        launches = {("token-first", "fwd"): (_fwd_first, (z, out_first)),
                    ("token-first", "bwd"): (_bwd_first, (z, d, hist, out_first)),
                    ("token-last", "fwd"): (_fwd_last, (zt, out_last)),
                    ("token-last", "bwd"): (_bwd_last, (zt, dt, hist, out_last))}
        for pass_ in ("fwd", "bwd"):
            ref = None
            for layout, configs in (("token-first", [(16, 1), (64, 4), (64, 2), (32, 1)]),
                                    ("token-last", [(32, 1), (64, 2), (128, 4), (64, 1),
                                                    (128, 1), (256, 2)])):
                kernel, args = launches[(layout, pass_)]
                out = args[-1]
                for bt, warps in configs:
                    grid = (triton.cdiv(T, bt),)

                    def fn(kernel=kernel, args=args, grid=grid, bt=bt, warps=warps):
                        kernel[grid](*args, T, iters, N=n, BT=bt, num_warps=warps)

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
