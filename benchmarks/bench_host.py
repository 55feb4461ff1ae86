"""Host (CPU) cost of mHC: what a training step pays when it is launch-bound.

    python benchmarks/bench_host.py [--tokens 64] [--hidden 1024] [--iters 300]
                                    [--profile-out host_profile.txt] [--out host.md]

A step whose GPU work is short, or that syncs with the host (Megatron's MoE dispatchers copy
the tokens per expert to the host every layer), exposes every microsecond of Python and
launch work. Measured on a GPU with so few tokens that the device is idle most of the time,
so wall time is host time:

* per op (Triton backend, n=4, bf16): the host time of one call of ``pre`` and ``combine``
  forward and of their backward (the backward functions called on the main thread with the
  saved context, as autograd's engine calls them), median over ``--iters`` calls, and the
  kernel launches and tensor allocations each makes;
* per model step (``bench_e2e``'s GPT, local specs, 4 layers, dense and MoE): baseline, mHC
  and mHC + ``mhc_recompute`` step time (forward + backward, synced), the models alive
  together and timed in alternating rounds (``--rounds`` x 10 steps): the differences are
  mHC's (and the recompute's) host cost per step; divided by the sublayers, per sublayer;
* ``--profile-out``: cProfile of the per-op calls (the top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from bench_e2e import RUNS, _sync, emit_report, interleaved_runs  # noqa: E402

from mhc_megatron.kernels.triton_combine import _CombineFn  # noqa: E402
from mhc_megatron.kernels.triton_pre import _PreFn  # noqa: E402

N, ITERS, EPS = 4, 20, 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 smoke only


def host_us(fn, iters: int) -> float:
    """Median host time of ``fn()`` in microseconds (no device sync inside the timing)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
        if len(times) % 64 == 0:
            _sync()  # keep the launch queue short
    _sync()
    return statistics.median(times)


def launches_and_allocations(fn) -> tuple[int, int]:
    """Kernel launches and tensor allocations of one call of ``fn`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    launches = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx") for n in names)
    allocs = sum(n in ("aten::empty", "aten::empty_strided") for n in names)
    return launches, allocs


class RecordingCtx(SimpleNamespace):
    """Stands in for autograd's ctx: keeps what a forward saves, as its backward reads it."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass


def op_cases(tokens: int, hidden: int):
    """(name, callable) of one call of each op's forward (through autograd) and of each
    backward (called directly on this thread with the context its forward filled)."""
    dev, bf16 = DEVICE, torch.bfloat16
    m = 2 * N + N * N
    x = torch.randn(tokens, N, hidden, device=dev, dtype=bf16, requires_grad=True)
    phi = (0.02 * torch.randn(m, N * hidden, device=dev)).requires_grad_()
    alpha = torch.full((3,), 0.1, device=dev, requires_grad=True)
    bias = torch.zeros(m, device=dev, requires_grad=True)
    f = torch.randn(tokens, hidden, device=dev, dtype=bf16, requires_grad=True)
    pre_ctx, comb_ctx = RecordingCtx(), RecordingCtx(needs_input_grad=(True,) * 6)
    with torch.no_grad():
        y, h_pre, h_post, h_res = _PreFn.forward(pre_ctx, x, phi, alpha, bias, ITERS, EPS,
                                                 None)
        out = _CombineFn.forward(comb_ctx, x, f, None, h_res, h_post, None)
    dy, dout = torch.randn_like(y), torch.randn_like(out)
    dh_post, dh_res = torch.randn_like(h_post), torch.randn_like(h_res)
    return [
        ("pre forward (autograd apply)",
         lambda: _PreFn.apply(x, phi, alpha, bias, ITERS, EPS, None)),
        ("pre backward", lambda: _PreFn.backward(pre_ctx, dy, None, dh_post, dh_res)),
        ("combine forward (autograd apply)",
         lambda: _CombineFn.apply(x, f, None, h_res, h_post, None)),
        ("combine backward", lambda: _CombineFn.backward(comb_ctx, dout)),
    ]


def model_rows(args) -> list[str]:
    """Baseline, mHC and mHC + recompute models built side by side and timed in alternating
    rounds (a host that other work shares drifts; alternating keeps them under the same
    conditions)."""
    rows = []
    for kind in ("dense", "moe"):
        shape = dict(layers=4, hidden=args.hidden, ffn=2 * args.hidden, heads=8,
                     seq=args.tokens, mbs=1, vocab=1024)
        if kind == "moe":
            shape.update(experts=16, topk=4, ffn=args.hidden // 2, shared=args.hidden)
        # bench_e2e's runs (baseline, mHC, mHC + recompute), built together, alternating rounds
        res = interleaved_runs(shape, "local", [(*r, False) for r in RUNS], DEVICE,
                               SimpleNamespace(interleave=args.rounds, steps=10, warmup=3))
        med = {run: r["ms"] for run, r in res.items()}
        sub = 2 * shape["layers"]
        cells = " | ".join(f"{r['ms']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})"
                           for r in res.values())
        rows.append(f"| {kind} | {cells} | "
                    f"{1e3 * (med['mHC'] - med['baseline']) / sub:.0f} | "
                    f"{1e3 * (med['mHC + recompute'] - med['mHC']) / sub:.0f} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-models", action="store_true")
    p.add_argument("--profile-out", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from megatron.core import parallel_state

    from mhc_testing.cpu import init_single_process_group

    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke only)"
    lines = [f"{name}; torch {torch.__version__}; n={N}, bf16, "
             f"{args.tokens} tokens, hidden {args.hidden}", "",
             "| op | host us / call | kernel launches | allocations |", "|---|---|---|---|"]
    cases = op_cases(args.tokens, args.hidden)
    for name, fn in cases:
        for _ in range(5):
            fn()
        us = host_us(fn, args.iters)
        launches, allocs = launches_and_allocations(fn)
        lines.append(f"| {name} | {us:.1f} | {launches} | {allocs} |")
        print(lines[-1], flush=True)
    if args.profile_out:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            for _, fn in cases:
                fn()
        prof.disable()
        _sync()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
        with open(args.profile_out, "w") as fh:
            fh.write(s.getvalue())
    if not args.no_models:
        lines += ["", "step (ms): median of the rounds' medians (the rounds' range); per "
                  "sublayer: the growth / sublayers, us", "",
                  "| model (4 layers, local specs) | baseline | mHC | mHC + recompute | "
                  "mHC - baseline per sublayer | recompute - mHC per sublayer |",
                  "|---|---|---|---|---|---|"]
        lines += model_rows(args)
    emit_report(lines, args.out)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
