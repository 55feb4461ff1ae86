"""Where mHC's host time goes (diagnostic for issue 16; prints, writes --out).

    python benchmarks/probe_host.py [--out probe.md] [--profile-steps 20]

1. Launch paths, host us per call (no sync): a Triton kernel through its JIT launcher
   (``kernel[grid](...)``), the same compiled kernel called directly
   (``compiled[grid](*args)``), and torch ops for scale (``torch.empty``, a small add, an
   empty ``autograd.Function.apply``).
2. A small model step (``bench_e2e``'s GPT, local specs, 4 layers, 64 tokens: the GPU idles)
   for baseline and mHC: the time until ``step()`` returns (host) and until the GPU is done
   (synced); if they are equal, the step is host-bound.
3. cProfile of those steps: the functions by own time, mHC against baseline.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from bench_e2e import _sync, build, emit_report, make_step  # noqa: E402
from bench_host import host_us, op_cases  # noqa: E402

from mhc_megatron.kernels import triton_mhc  # noqa: E402


def per_call_us(fn, iters=2000) -> float:
    """``bench_host.host_us`` after 20 warm-up calls."""
    for _ in range(20):
        fn()
    _sync()
    return host_us(fn, iters)


def launch_rows() -> list[str]:
    dev, bf16 = "cuda", torch.bfloat16
    T, n, C = 64, 4, 1024
    x = torch.randn(T, n, C, device=dev, dtype=bf16)
    h = torch.rand(T, n, device=dev)
    y = torch.empty(T, C, device=dev, dtype=bf16)
    bt, bc, warps = triton_mhc.TILES.sweep[0], triton_mhc._sweep_bc(n, C), triton_mhc.TILES.sweep[2]
    grid = (triton.cdiv(T, bt), triton.cdiv(C, bc))
    kern = triton_mhc._aggregate_fwd
    compiled = kern[grid](x, h, y, T, C, N=n, BT=bt, BC=bc, num_warps=warps)
    stream = torch.cuda.current_stream().cuda_stream
    a, b = torch.randn(64, 1024, device=dev), torch.randn(64, 1024, device=dev)

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g

    w = a.clone().requires_grad_()
    cases = [
        ("triton JIT launch kernel[grid](...)",
         lambda: kern[grid](x, h, y, T, C, N=n, BT=bt, BC=bc, num_warps=warps)),
        ("compiled[grid](*args, stream=s)",
         lambda: compiled[grid + (1,)](x, h, y, T, C, n, bt, bc, stream=stream)),
        ("compiled.run(...) (launcher itself)",
         lambda: compiled.run(grid[0], grid[1], 1, stream, compiled.function,
                              compiled.packed_metadata, None, None, None,
                              x, h, y, T, C, n, bt, bc)),
        ("torch.cuda.current_stream().cuda_stream",
         lambda: torch.cuda.current_stream().cuda_stream),
        ("torch.empty(64, 1024)", lambda: torch.empty(64, 1024, device=dev)),
        ("torch.add(a, b)", lambda: torch.add(a, b)),
        ("Noop.apply(w) (autograd Function)", lambda: Noop.apply(w)),
    ]
    rows = ["| launch path | host us / call | same, on another thread |", "|---|---|---|"]
    import threading

    def on_thread(fn):
        res = []
        th = threading.Thread(target=lambda: res.append(per_call_us(fn)))
        th.start()
        th.join()
        return res[0]

    for name, fn in cases + op_cases(64, 1024):
        rows.append(f"| {name} | {per_call_us(fn):.1f} | {on_thread(fn):.1f} |")
        print(rows[-1], flush=True)
    return rows


def step_rows(args) -> tuple[list[str], dict]:
    shape = dict(layers=4, hidden=1024, ffn=2048, heads=8, seq=64, mbs=1, vocab=1024)
    rows = ["| model (4 layers, local, 64 tokens) | host ms (step returns) | synced ms |",
            "|---|---|---|"]
    steps = {}
    for run, mhc in (("baseline", False), ("mHC", True)):
        model, _ = build(shape, "local", mhc, False, "cuda")
        steps[run] = make_step(model, shape, "local", "cuda")
    for _ in range(3):
        for run, step in steps.items():
            for _ in range(5):
                step()
    _sync()
    for run, step in steps.items():
        host, synced = [], []
        for _ in range(30):
            _sync()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            _sync()
            t2 = time.perf_counter()
            host.append(1e3 * (t1 - t0))
            synced.append(1e3 * (t2 - t0))
        rows.append(f"| {run} | {statistics.median(host):.2f} | {statistics.median(synced):.2f} |")
        print(rows[-1], flush=True)
    return rows, steps


def sublayer_rows() -> list[str]:
    """One mHC sublayer without its sublayer (f = y): the module's pre and combine forward,
    and forward + backward through autograd's engine, against the ops called directly."""
    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.layers.hyper_connection import HyperConnectionModule

    cfg = MHCTransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=8,
                               enable_hyper_connections=True, num_residual_streams=4,
                               params_dtype=torch.bfloat16, bf16=True)
    hc = HyperConnectionModule(cfg).cuda()
    streams = torch.randn(64, 1, 4 * 1024, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)

    def fwd():
        y, maps = hc.pre(streams)
        return hc.combine(streams, (y, None), maps, 0.0, True)

    def pre_only():
        return hc.pre(streams)

    def fwd_bwd():
        fwd().sum().backward()

    def sum_bwd():  # the part of fwd_bwd that is not mHC
        streams.sum().backward()

    rows = ["| sublayer piece (module level, 64 tokens) | host us / call |", "|---|---|"]
    for name, fn in (("hc.pre", pre_only), ("hc.pre + hc.combine", fwd),
                     ("pre + combine forward + backward (engine)", fwd_bwd),
                     ("a sum's forward + backward (subtract)", sum_bwd)):
        rows.append(f"| {name} | {per_call_us(fn, 500):.1f} |")
        print(rows[-1], flush=True)
    import threading

    inside = {}

    def timed(cls):
        orig = cls.backward

        def backward(ctx, *grads):
            t0 = time.perf_counter()
            out = orig(ctx, *grads)
            rec = inside.setdefault(cls.__name__, [0.0, 0, set()])
            rec[0] += time.perf_counter() - t0
            rec[1] += 1
            rec[2].add(threading.get_ident() == threading.main_thread().ident)
            return out

        cls.backward = staticmethod(backward)
        return orig

    origs = {cls: timed(cls) for cls in (triton_mhc._PreFn, triton_mhc._CombineFn)}
    for _ in range(200):
        fwd_bwd()
    _sync()
    for cls, orig in origs.items():
        cls.backward = staticmethod(orig)
    for name, (sec, cnt, main) in inside.items():
        rows.append(f"| inside {name}.backward via the engine (main thread: {main}) | "
                    f"{1e6 * sec / cnt:.1f} |")
        print(rows[-1], flush=True)
    from bench_e2e import profile_device

    for name, fn in (("hc.pre + hc.combine", fwd), ("forward + backward", fwd_bwd)):
        for _ in range(5):
            fn()
        prof = profile_device(fn)
        rows += ["", f"device time of one {name} call (profiled wall {prof['wall']:.3f} ms):", "",
                 "| kernel | us | launches |", "|---|---|---|"]
        for k, (ms, cnt) in sorted(prof["kernels"].items(), key=lambda kv: -kv[1][0]):
            rows.append(f"| {k[:60]} | {1e3 * ms:.1f} | {cnt} |")
        rows.append(f"| all | {1e3 * sum(v[0] for v in prof['kernels'].values()):.1f} | |")
        print("\n".join(rows[-12:]), flush=True)
    return rows


def torch_profile_rows(steps: dict) -> list[str]:
    from bench_e2e import growth_lines, profile_host

    prof = {run: profile_host(step)["host"] for run, step in steps.items()}
    return ["", "host events growing most from baseline to mHC (torch profiler, one step, "
            "self CPU time with Python stacks):", ""] + growth_lines(
                "baseline", "mHC", prof["baseline"], prof["mHC"], "host event")


def profile_rows(steps: dict, n_steps: int) -> list[str]:
    rows = []
    for run, step in steps.items():
        prof = cProfile.Profile()
        _sync()
        prof.enable()
        for _ in range(n_steps):
            step()
        _sync()
        prof.disable()
        for order, top, label in (("tottime", 45, "by own time"), ("cumulative", 60, "cumulative")):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(top)
            rows += ["", f"### cProfile, {run}, {n_steps} steps ({label})", "", "```",
                     s.getvalue(), "```"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--profile-steps", type=int, default=20)
    args = p.parse_args(argv)
    from megatron.core import parallel_state

    from mhc_testing.cpu import init_single_process_group

    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    lines = [f"{torch.cuda.get_device_name()}; torch {torch.__version__}; "
             f"triton {triton.__version__}", ""]
    lines += launch_rows()
    rows, steps = step_rows(args)
    lines += [""] + rows
    lines += [""] + sublayer_rows()
    lines += torch_profile_rows(steps)
    lines += profile_rows(steps, args.profile_steps)
    emit_report(lines, args.out)


import triton  # noqa: E402

if __name__ == "__main__":
    main()
