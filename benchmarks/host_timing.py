"""The host-time benchmarks' shared measure (``bench_host.py`` and the modules it runs): the
device and the op shapes, how a callable's host time is taken (median of calls, the device
synced now and then so the launch queue stays short), its launches and allocations, and the
model steps timed in lockstep or in alternating rounds."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from bench_e2e import _sync

N, ITERS, EPS = 4, 20, 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 smoke only
WARMUP = 5 if DEVICE == "cuda" else 1  # calls before timing (compiles, fills the launch caches)
# sublayers chained into one backward call, as in a model's step (2 on the CPU interpreter:
# a smoke test of the rows, where each sublayer takes a fraction of a second)
ENGINE_DEPTH = 8 if DEVICE == "cuda" else 2


@contextlib.contextmanager
def gc_paused():
    """Device synchronised, garbage collected, then Python's automatic collection off for the
    timed rounds (as Megatron's training loop with ``--manual-gc``)."""
    _sync()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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


def paired_steps(steps: dict, count: int) -> dict:
    """``count`` steps of each model in ``steps`` (name -> step), interleaved step by step
    (every model's i-th step in turn), each timed alone between two device syncs: ms a step,
    in lists that run in lockstep, so that the i-th steps of two models were measured within
    one cycle of the models (a drift of the host's speed hits both alike)."""
    times = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def paired_growth(run: list, base: list, sublayers: int) -> str:
    """``run``'s growth over ``base`` per sublayer, us: the median of the paired steps'
    differences (their interquartile range)."""
    diffs = [1e3 * (r - b) / sublayers for r, b in zip(run, base)]
    q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
    return f"{statistics.median(diffs):.0f} ({q1:.0f} to {q3:.0f})"


def dense_shape(args) -> dict:
    return dict(layers=4, hidden=args.hidden, ffn=2 * args.hidden, heads=8, seq=args.tokens,
                mbs=1, vocab=1024)


def alternating_table(steps: dict, rounds: int, sub: int, what: str):
    """``steps`` timed in alternating rounds (10 steps each, synced; after ``WARMUP`` warm-up
    steps): a table of each run's step time (minimum, median), its host time until the step
    returns and its process CPU time over that span, and per sublayer over the first run
    (``sub`` sublayers); ``(lines, minimum step ms by run)``."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    host: dict[str, list[float]] = {name: [] for name in steps}  # until step() returns
    cpu: dict[str, list[float]] = {name: [] for name in steps}  # process CPU time, the same span
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    with gc_paused():
        for _ in range(rounds):
            for name, step in steps.items():
                for _ in range(10):
                    _sync()
                    c0, t0 = time.process_time(), time.perf_counter()
                    step()
                    t1, c1 = time.perf_counter(), time.process_time()
                    _sync()
                    times[name].append(1e3 * (time.perf_counter() - t0))
                    host[name].append(1e3 * (t1 - t0))
                    cpu[name].append(1e3 * (c1 - c0))
    lo = {name: min(t) for name, t in times.items()}
    med = {name: statistics.median(t) for name, t in times.items()}
    cpu_med = {name: statistics.median(t) for name, t in cpu.items()}
    first = next(iter(steps))
    lines = [f"| run ({what}) | step ms, min | step ms, median | "
             "host ms (until the step returns), min | process CPU ms (same span), median | "
             f"per sublayer over the {first}, us (min / median / CPU median) |",
             "|---|---|---|---|---|---|"]
    for name in steps:
        lines.append(f"| {name} | {lo[name]:.2f} | {med[name]:.2f} | {min(host[name]):.2f} | "
                     f"{cpu_med[name]:.2f} | "
                     f"{1e3 * (lo[name] - lo[first]) / sub:+.0f} / "
                     f"{1e3 * (med[name] - med[first]) / sub:+.0f} / "
                     f"{1e3 * (cpu_med[name] - cpu_med[first]) / sub:+.0f} |")
    return lines, lo
