"""Where a model step's host time goes, down to C++ frames: the dense model of ``bench_host.py``
(4 layers, local specs, 64 tokens, hidden 1024) stepped in a loop under py-spy's native
sampler, and its samples summarised; and what a step's autograd graph holds, per model.

    pip install py-spy        # (optional: not a dependency of mhc-megatron)
    py-spy record --native --threads --rate 100 --format raw -o mhc.txt -- \\
        python benchmarks/profile_native.py run --model mhc --seconds 30
    python benchmarks/profile_native.py summarize mhc.txt [--out mhc.md]

``run``: builds the model (``baseline``, ``mhc`` or ``recompute``: mHC with
``mhc_recompute``), takes warm-up steps (Triton compiles, recipes recorded), then steps in a
loop for ``--seconds``, the device synced after each step, inside ``timed_loop`` (the summary
keeps the main thread's samples under it); prints the steps and ms a step. py-spy stops the
process for each native sample, so the profiled steps are slower than unprofiled ones (about
3x at 100 Hz on an H200 host); a sampler's shares, not its times, are what it measures.

``counts``: the autograd nodes a step evaluates and the kernel launches it makes, forward
(the calling thread) and backward (autograd's device thread), counted by torch's profiler, for
each model, per sublayer; the rows where the models differ (what mHC adds to a step's graph).

    python benchmarks/profile_native.py counts [--models baseline mhc recompute] [--steps 5]

``summarize``: a table of the shares of

* the main thread's samples in ``timed_loop`` (the forward, and the host's waits): each of
  mHC's forward pieces (pre, the module's call; the combine, the bias-dropout-add slot's call;
  the streams' expansion; the final norm with the streams' contraction), and within each, the
  frames its samples were in (a Python function's own work, or the C++ call it was in);
* autograd's device thread (every thread but the main one), busy samples only (not its queue
  waits), without the warm-up's (Triton's compiles, the ops' first calls in Python, imports):
  by the autograd node each sample runs, mHC's two nodes (``MHCPreBackward``,
  ``MHCCombineBackward``: their C++ ``apply``) among them, and the frames theirs were in.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# mHC's forward pieces: a label and the frame (py-spy's "function (file:line)") that starts it
FORWARD_PIECES = (
    ("pre (the module's call)", "HyperConnectionModule.pre "),
    ("the combine (the bias-dropout-add slot's call)", "_StreamCombine._combine "),
    ("the streams' expansion (layer 1)", "streams_in "),
    ("the final norm, with the streams' contraction", "StreamContractingNorm.forward "),
)
# frames of the warm-up on autograd's device thread: Triton's compiles, the ops' backward in
# Python (a variant's first call, which records the recipe the nodes replay), cuDNN's plans
WARM_UP_FRAMES = ("_do_compile", "compile (", "_first_launch", "build_plans", "_find_and_load",
                  "_pre_native_backward", "_combine_native_backward", "autotune")
IDLE_FRAMES = ("ReadyQueue::pop",)
MHC_NODES = ("mhc::(anonymous namespace)::PreBackward::apply",
             "mhc::(anonymous namespace)::CombineBackward::apply")
SHAPE = dict(layers=4, hidden=1024, ffn=2048, heads=8, seq=64, mbs=1, vocab=1024)


# -- run

@contextlib.contextmanager
def _one_rank():
    """A single-process group and model parallelism of 1 while open."""
    from megatron.core import parallel_state

    from mhc_testing.cpu import init_single_process_group

    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def _warmed_step(model: str, warmup: int, tokens: int, hidden: int):
    """The dense model's step (``model``: baseline, mhc or recompute, :data:`SHAPE` with
    ``tokens`` and ``hidden``) after ``warmup`` steps (Triton's compiles, the recipes, the call
    sites): ``(step, sync, shape, device)``."""
    import torch
    from bench_e2e import build, make_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(SHAPE, seq=tokens, hidden=hidden, ffn=2 * hidden)
    step = make_step(build(shape, "local", model != "baseline", model == "recompute", device)[0],
                     shape, "local", device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    return step, sync, shape, device


def run(model: str, seconds: float, warmup: int, tokens: int, hidden: int) -> str:
    with _one_rank():
        step, sync, _, device = _warmed_step(model, warmup, tokens, hidden)
        steps, elapsed = timed_loop(step, sync, seconds)
    return f"{model}: {steps} steps, {1e3 * elapsed / steps:.3f} ms a step ({device})"


def timed_loop(step, sync, seconds: float) -> tuple[int, float]:
    """Steps until ``seconds`` have passed (at least one): ``(steps, seconds taken)``. Its name
    is what :func:`summarize` keeps the main thread's samples by."""
    steps, start = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - start < seconds:
        step()
        sync()
        steps += 1
    return steps, time.perf_counter() - start


# -- counts

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
NODE_EVENT = "autograd::engine::evaluate_function: "


def count_events(events) -> collections.Counter:
    """Autograd nodes evaluated, by name, and kernel launches, forward (any thread but
    autograd's) and backward (the thread that evaluates the nodes), of torch profiler's
    ``events``."""
    counts: collections.Counter = collections.Counter()
    node_threads: collections.Counter = collections.Counter()
    launch_threads: collections.Counter = collections.Counter()
    for e in events:
        if e.name.startswith(NODE_EVENT):
            counts["node " + e.name[len(NODE_EVENT):]] += 1
            node_threads[e.thread] += 1
        elif e.name in LAUNCHES:
            launch_threads[e.thread] += 1
    backward = node_threads.most_common(1)[0][0] if node_threads else None
    counts["launches, forward"] = counts["launches, backward"] = 0
    for thread, n in launch_threads.items():
        counts["launches, backward" if thread == backward else "launches, forward"] += n
    return counts


def counts(models: list[str], steps: int, warmup: int, tokens: int, hidden: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    per_sublayer = {}
    with _one_rank():
        for model in models:
            step, sync, shape, device = _warmed_step(model, warmup, tokens, hidden)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
                sync()
            got = count_events(prof.events())
            sublayers = 2 * shape["layers"]
            per_sublayer[model] = {k: v / (steps * sublayers) for k, v in got.items()}
            del step
    names = sorted({k for c in per_sublayer.values() for k in c},
                   key=lambda k: (not k.startswith("launches"), k))
    first, last = models[0], models[-1]
    lines = [f"| per sublayer ({sublayers} a step, {steps} steps, {device}) | "
             + " | ".join(models) + f" | {last} - {first} |",
             "|---|" + "---|" * (len(models) + 1)]
    for name in names:
        cells = [per_sublayer[m].get(name, 0.0) for m in models]
        if len(set(cells)) > 1 or name.startswith("launches"):
            lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells)
                         + f" | {cells[-1] - cells[0]:+.2f} |")
    return lines


# -- summarize

def read_raw(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw output: ``(frames, count)`` a line, the thread's name first."""
    rows = []
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            rows.append((stack.split(";"), int(count)))
    return rows


def frame_name(frame: str) -> str:
    """``function (file)`` of a Python frame (no directory, no line); a C++ frame's function."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if m is None:
        return frame
    function, where = m.groups()
    return f"{function} ({where.rsplit('/', 1)[-1]})" if where.endswith(".py") else function


def _thread(frames: list[str]) -> str:
    """The thread id of a sample (py-spy names a thread only where it sees its Python state:
    ``thread (ID): MainThread``, or ``thread (ID)``)."""
    m = re.match(r"thread \((\w+)\)", frames[0])
    return m.group(1) if m else frames[0]


def _share(count: int, total: int) -> str:
    return f"{100 * count / max(total, 1):.1f}%"


def _own_frames(rows, top: int) -> list[tuple[str, int]]:
    """Where the samples ``rows`` ``(frames, count)`` were: each sample's deepest named frame
    (addresses in stripped libraries skipped), by samples."""
    counts: collections.Counter = collections.Counter()
    for frames, count in rows:
        named = [f for f in frames if not f.startswith("0x")]
        counts[frame_name(named[-1])] += count
    return counts.most_common(top)


def summarize(path: str, top: int = 8) -> list[str]:
    rows = read_raw(path)
    if not any(f[0].startswith("thread (") for f, _ in rows):
        raise SystemExit(f"{path}: no thread names in the samples. Fix: record with py-spy's "
                         "--threads (and --native, --format raw), as the module docstring shows.")
    main_ids = {_thread(f) for f, _ in rows if "MainThread" in f[0]}
    main = [(f, c) for f, c in rows
            if _thread(f) in main_ids and any("timed_loop " in x for x in f)]
    total = sum(c for _, c in main)
    lines = [f"py-spy samples of {path}", "",
             f"| main thread, samples in the step loop: {total} | share |", "|---|---|"]
    for label, start in FORWARD_PIECES:
        inside = [(f, c) for f, c in main if any(x.startswith(start) for x in f)]
        count = sum(c for _, c in inside)
        lines.append(f"| {label} | {_share(count, total)} |")
        for name, n in _own_frames(inside, top):
            lines.append(f"| . {name[:120]} | {_share(n, total)} |")
    background = [(f, c) for f, c in rows if _thread(f) not in main_ids
                  and not any(w in x for x in f for w in WARM_UP_FRAMES + IDLE_FRAMES)]
    busy = sum(c for _, c in background)
    nodes: collections.Counter = collections.Counter()
    in_mhc = []
    for frames, count in background:
        at = next((i for i, x in enumerate(frames) if x.startswith("torch::autograd::Node::"
                                                                     "operator()")), None)
        node = frame_name(frames[at + 1]) if at is not None and at + 1 < len(frames) else \
            "(the engine's own work)"
        nodes[node] += count
        if node in MHC_NODES:
            in_mhc.append((frames, count))
    lines += ["", f"| autograd's device thread, busy samples after the warm-up: {busy} | share |",
              "|---|---|"]
    lines += [f"| {name[:120]} | {_share(n, busy)} |" for name, n in nodes.most_common(top)]
    mhc = sum(nodes[name] for name in MHC_NODES)
    lines.append(f"| mHC's nodes (MHCPreBackward, MHCCombineBackward) | {_share(mhc, busy)} |")
    for name, n in _own_frames(in_mhc, top):
        lines.append(f"| . {name[:120]} | {_share(n, busy)} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="step the model in a loop (under py-spy)")
    r.add_argument("--model", choices=("baseline", "mhc", "recompute"), default="mhc")
    r.add_argument("--seconds", type=float, default=30.0)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--tokens", type=int, default=SHAPE["seq"])
    r.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    c = sub.add_parser("counts", help="autograd nodes and kernel launches a step, per model")
    c.add_argument("--models", nargs="+", choices=("baseline", "mhc", "recompute"),
                   default=["baseline", "mhc", "recompute"])
    c.add_argument("--steps", type=int, default=5)
    c.add_argument("--warmup", type=int, default=5)
    c.add_argument("--tokens", type=int, default=SHAPE["seq"])
    c.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    s = sub.add_parser("summarize", help="summarise py-spy's raw output")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=8)
    s.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.command == "run":
        print(run(args.model, args.seconds, args.warmup, args.tokens, args.hidden), flush=True)
        return
    if args.command == "counts":
        print("\n".join(counts(args.models, args.steps, args.warmup, args.tokens, args.hidden)),
              flush=True)
        return
    text = "\n".join(summarize(args.raw, args.top)) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
