"""The study preset's training step, baseline against mHC (and mHC + ``mhc_recompute``).

    python benchmarks/bench_study_step.py [--recompute] [--profile] [--spans] [--module-spans]
                                          [--python-hooks] [--python-replays]
                                          [--whole-sublayer-hooks]
                                          [--phases] [--null-ops] [--rounds 4] [--steps 10]

The step of ``examples/mhc_study.py --preset study --precision bf16 --mhc-params fp32
--attention sdpa`` (85M GPT, 12 x 768, seq 512, batch 32; the study's mHC variant
``static:zero,gating:0.01``): forward, backward, the example's ``MasterWeightAdamW`` step and
``loss.item()`` right after it (a loop that reads every step's loss), on random bytes. The
models are built side by side and timed in alternating rounds (``--rounds`` x ``--steps``
steps each, after warm-up): per run the median and minimum step time and the host time until
the step returns (before ``loss.item()``); where the host time is as long as the step, the
step is host-bound. The ratio to the baseline is
given twice: of the medians over all rounds, and paired, the median of the rounds' own ratios
(each round's median step against the baseline's in that round), which a slow drift of the
host's speed does not bias; many short rounds (``--rounds 20 --steps 3``) pair closest.

``--overlap``: each step's loss is read after the next step's work is issued, not right after
its own step, so the host issues step k+1 while the GPU runs step k, as in the example's loop,
which reads its losses back at its evaluations (a step's time is then the interval between
two loss reads, its host time the part of it until its work is issued).
``--profile``: the GPU time a step (torch profiler, kernels only) and each run's top kernels.
``--spans``: a second table, the host time of each step's phases (forward, backward,
optimiser) and of the calls inside the forward (a layer, mHC's pre and combine, Megatron's
attention and MLP bodies, the combine inside them), median per call, from timers wrapped
around those methods for this process (Megatron's classes included: a measurement, not the
library's path). ``--phases``: a table of each phase's host time and, on a GPU, its GPU
time from CUDA events recorded between the phases (which phases the host paces and which the
GPU). ``--null-ops``: also mHC with null ops (``host_ops.null_ops``: its layer code, ops
that allocate and launch nothing). ``--python-hooks`` (with ``--recompute``): also mHC +
recompute with ``mhc_recompute``'s saved-tensor hooks in Python (``set_native_hooks(False)``
during its steps), to compare with the C++ hooks in the same process. ``--python-replays``
(with ``--recompute``): also mHC + recompute with its blocks replayed in Python
(``set_native_replay(False)``), to compare with their replay from C++ by the ops' replay
sites. ``--whole-sublayer-hooks`` (with
``--recompute``): also mHC + recompute with the hooks on over each whole sublayer
(``set_narrow_hooks(False)``), not only where mHC outputs are saved.
Every run's timed steps count Python's garbage collections (a step's collections of each
generation, and the host ms a step spent in them); every run's steps of a round start after a
``gc.collect()``.
Extra arguments go to the example's parser (``--preset``, ``--precision`` ...).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import train_gpt_mhc as demo  # noqa: E402

STUDY_FLAGS = ["--preset", "study", "--precision", "bf16", "--mhc-params", "fp32",
               "--attention", "sdpa"]
MHC_VARIANT = {"mhc_init_static_mapping": "zero", "mhc_init_gating_factor": 0.01}


# run name suffix -> the recompute hooks' switch ((get, set) of mhc_megatron.recompute.manager)
# that is off during that run's steps
HOOK_VARIANTS = {", Python hooks": ("native_hooks", "set_native_hooks"),
                 ", blocks replayed in Python": ("native_replay", "set_native_replay"),
                 ", hooks over the sublayer": ("narrow_hooks", "set_narrow_hooks")}


def make_step(model, args, data, name: str = "", phases: list | None = None,
              gpu_spans: list | None = None):
    """The study loop's step for ``model`` (without the loss check and evaluations).
    ``phases``: each step's host seconds of forward, backward and optimiser appended, and the
    forward's calls timed under ``name`` (:class:`Spans`). ``gpu_spans`` (CUDA): CUDA events
    recorded between the phases; after the step's loss is read, ``step.read_gpu_spans()``
    appends the GPU ms of each phase (from the GPU reaching the phase's start to its work
    done: kernels and the GPU's idle waits for the host alike). A run named with a suffix of
    ``HOOK_VARIANTS`` runs its steps with that switch of the recompute's hooks off."""
    from mhc_megatron.recompute import manager

    switch = next((names for suffix, names in HOOK_VARIANTS.items() if name.endswith(suffix)),
                  None)
    get, put = (getattr(manager, n) for n in switch) if switch else (None, None)
    opt = demo.MasterWeightAdamW(demo.param_groups(model, 0.1, True), clip=1.0, lr=1e-4,
                                 betas=(0.9, 0.95))
    batches = demo.make_batches(data, args, args.seed)
    events = ([torch.cuda.Event(enable_timing=True) for _ in range(4)]
              if gpu_spans is not None else None)
    mark = (lambda i: events[i].record()) if events else (lambda i: None)

    def step():
        if switch:
            was = get()
            put(False)
        t0 = time.perf_counter()
        mark(0)
        ids, labels = batches.next()
        Spans.run = name if phases is not None else None
        loss = model(ids, batches.position_ids, batches.mask, labels=labels).float().mean()
        Spans.run = None
        t1 = time.perf_counter()
        mark(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        mark(2)
        opt.step()
        mark(3)
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        if switch:
            put(was)
        return loss

    def read_gpu_spans():
        if events:
            gpu_spans.append(tuple(events[i].elapsed_time(events[i + 1]) for i in range(3)))

    step.read_gpu_spans = read_gpu_spans
    return step


class Spans:
    """Host time of calls inside a forward (``--spans``): :meth:`install` wraps each method
    of ``TIMED`` in a timer that records, while ``Spans.run`` names a run, the call's host
    microseconds under ``(run, label)``."""

    run: str | None = None
    times: dict = {}

    @staticmethod
    def timed():
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from mhc_megatron.layers.hyper_connection import HyperConnectionModule

        return ((TransformerLayer, "forward", "a layer's forward"),
                (HyperConnectionModule, "forward", "mHC pre"),
                (HyperConnectionModule, "combine", "mHC combine"),
                (TransformerLayer, "_forward_attention",
                 "Megatron's attention body (with the combine)"),
                (TransformerLayer, "_forward_mlp", "Megatron's MLP body (with the combine)"))

    @classmethod
    def install(cls) -> None:
        for owner, method, label in cls.timed():
            fn = getattr(owner, method)

            def timer(*args, _fn=fn, _label=label, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    if cls.run is not None:
                        cls.times.setdefault((cls.run, _label), []).append(
                            1e6 * (time.perf_counter() - t0))

            setattr(owner, method, timer)

    @classmethod
    def rows(cls, names: list, phases: dict) -> list[str]:
        lines = ["", "Host time (median): each step's phases, and the calls inside its forward",
                 "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines.append("| forward / backward / optimiser, ms | " + " | ".join(
            " / ".join(f"{1e3 * statistics.median(p[i] for p in phases[n]):.2f}"
                       for i in range(3)) for n in names) + " |")
        for _, _, label in cls.timed():
            cells = [cls.times.get((n, label)) for n in names]
            lines.append(f"| {label}, us a call | " + " | ".join(
                f"{statistics.median(c):.1f}" if c else "-" for c in cells) + " |")
        return lines


class ModuleSpans:
    """Host time of every module's forward call, by the module's class (``--module-spans``):
    process-wide forward pre- and post-hooks (``torch.nn.modules.module``'s global hooks) time
    each call while ``Spans.run`` names a run. The hooks take every module call off torch's fast
    path, so the steps of such a run are slower than without them; the table compares runs."""

    starts: list = []
    times: dict = {}

    @classmethod
    def install(cls) -> None:
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        def pre(module, args):
            cls.starts.append(time.perf_counter())

        def post(module, args, output):
            t0 = cls.starts.pop()
            if Spans.run is not None:
                cls.times.setdefault((Spans.run, type(module).__name__), []).append(
                    1e6 * (time.perf_counter() - t0))

        register_module_forward_pre_hook(pre)
        register_module_forward_hook(post)

    @classmethod
    def rows(cls, names: list, steps: dict) -> list[str]:
        """Per module class: calls a step and median us a call in each run, the classes
        ordered by how much more host time a step the last run spends in them than the
        first."""
        classes = {c for _, c in cls.times}

        def per_step(run, c):
            got = cls.times.get((run, c), [])
            return sum(got) / max(steps[run], 1)

        order = sorted(classes, key=lambda c: per_step(names[0], c) - per_step(names[-1], c))
        lines = ["", "Host time of each module class's forward calls (calls a step; median us a "
                 "call), most grown first", "", "| module | " + " | ".join(names) + " |",
                 "|---|" + "---|" * len(names)]
        for c in order:
            cells = []
            for run in names:
                got = cls.times.get((run, c))
                cells.append(f"{len(got) / max(steps[run], 1):.0f}; {statistics.median(got):.1f}"
                             if got else "-")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        return lines


class GCStats:
    """Python's garbage collections while ``run`` names a run (``gc.callbacks``): their count
    by ``(run, generation)`` and host ms by run."""

    run: str | None = None
    counts: dict = {}
    ms: dict = {}
    _start = 0.0

    @classmethod
    def install(cls) -> None:
        gc.callbacks.append(cls._callback)

    @classmethod
    def _callback(cls, phase: str, info: dict) -> None:
        if cls.run is None:
            return
        if phase == "start":
            cls._start = time.perf_counter()
            return
        key = (cls.run, info["generation"])
        cls.counts[key] = cls.counts.get(key, 0) + 1
        cls.ms[cls.run] = cls.ms.get(cls.run, 0.0) + 1e3 * (time.perf_counter() - cls._start)

    @classmethod
    def cell(cls, run: str, steps: int) -> str:
        per_gen = " / ".join(f"{cls.counts.get((run, g), 0) / steps:.1f}" for g in range(3))
        return f"{per_gen}; {cls.ms.get(run, 0.0) / steps:.2f}"


NULL_OPS_RUN = "mHC, null ops"


def phase_rows(names: list, phases: dict, gpu_spans: dict) -> list[str]:
    """``--phases``: per run, each phase's host time and GPU time (medians; the GPU's from the
    CUDA events between the phases, "-" without a GPU). A phase whose GPU time is about its
    host time is paced by the host (the GPU waits for its launches); one whose GPU time is
    longer is paced by the GPU (the host runs ahead), and its extra GPU time shows in the
    next phase or in the loss read."""
    lines = ["", "Each phase's host time and GPU time (median ms; the GPU's measured by CUDA "
             "events between the phases, from the GPU reaching a phase to its work done)", "",
             "| run | forward, host / GPU | backward, host / GPU | optimiser, host / GPU |",
             "|---|---|---|---|"]
    for name in names:
        cells = []
        for i in range(3):
            host = statistics.median(p[i] for p in phases[name]) * 1e3
            gpu = (f"{statistics.median(g[i] for g in gpu_spans[name]):.2f}"
                   if gpu_spans[name] else "-")
            cells.append(f"{host:.2f} / {gpu}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def synced_steps(step, count: int, host: list) -> list[float]:
    """``count`` steps, each loss read right after its step: the steps' times in ms; their
    host times (until the step's work is issued) appended to ``host``."""
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        loss.item()
        times.append(1e3 * (time.perf_counter() - t0))
        host.append(1e3 * (t1 - t0))
        step.read_gpu_spans()
    return times


def overlapped_steps(step, count: int, host: list) -> list[float]:
    """``count`` steps, each loss read after the next step's work is issued (``--overlap``):
    the intervals between consecutive loss reads in ms, each step's host time appended to
    ``host``. Two untimed steps first, so that every timed interval starts at a read made with
    the next step already issued."""
    previous = step()
    loss = step()
    previous.item()
    previous, start = loss, time.perf_counter()
    times = []
    for _ in range(count):
        loss = step()
        issued = time.perf_counter()
        previous.item()
        previous, end = loss, time.perf_counter()
        times.append(1e3 * (end - start))
        host.append(1e3 * (issued - start))
        start = end
    previous.item()
    return times


def paired_ratios(run: list[float], baseline: list[float]) -> list[float]:
    """Each round's ratio of ``run``'s median step to the baseline's median step of the same
    round (the runs alternate within a round, so a drift of the host's speed over minutes,
    several per cent on some hosts, hits both terms of a ratio alike)."""
    return [r / b for r, b in zip(run, baseline)]


def profile_rows(steps: dict, count: int = 5, top: int = 12) -> list[str]:
    """GPU kernel time a step and the top kernels of each run (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    lines = []
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(count):
                step().item()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events) / count
        lines += ["", f"{name}: GPU time a step {total / 1e3:.2f} ms", "",
                  "| kernel | ms a step | calls a step |", "|---|---|---|"]
        for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
            lines.append(f"| {e.key[:80]} | {e.device_time_total / count / 1e3:.3f} | "
                         f"{e.count // count} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recompute", action="store_true", help="also mHC + mhc_recompute")
    p.add_argument("--overlap", action="store_true",
                   help="read each step's loss after the next step is issued")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--spans", action="store_true",
                   help="also the host time of the phases and of the calls in the forward")
    p.add_argument("--module-spans", action="store_true",
                   help="also the host time of every module class's forward calls")
    p.add_argument("--python-hooks", action="store_true",
                   help="also mHC + recompute with the recompute's hooks in Python")
    p.add_argument("--python-replays", action="store_true",
                   help="also mHC + recompute with its blocks replayed in Python")
    p.add_argument("--whole-sublayer-hooks", action="store_true",
                   help="also mHC + recompute with the hooks on over each whole sublayer")
    p.add_argument("--phases", action="store_true",
                   help="also each phase's host time and, on a GPU, its GPU time (CUDA events)")
    p.add_argument("--null-ops", action="store_true",
                   help="also mHC with null ops (its layer code; ops that launch nothing)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default=None)
    args, rest = p.parse_known_args(argv)
    if (args.python_hooks or args.python_replays or args.whole_sublayer_hooks) \
            and not args.recompute:
        p.error("--python-hooks / --python-replays / --whole-sublayer-hooks compare the "
                "recompute's hooks and replays: add --recompute")
    if args.phases and args.overlap:
        p.error("--phases reads each step's CUDA events after its loss: drop --overlap")
    run_args = demo.parse_args(STUDY_FLAGS + rest)
    demo.setup_megatron(run_args.device, run_args.seed)
    data = np.random.default_rng(0).integers(0, 256, size=4_000_000).astype(np.uint8)
    variants = {"baseline": None, "mHC": MHC_VARIANT}
    if args.recompute:
        variants["mHC + recompute"] = {**MHC_VARIANT, "mhc_recompute": True}
    if args.python_hooks:
        variants["mHC + recompute, Python hooks"] = variants["mHC + recompute"]
    if args.python_replays:
        variants["mHC + recompute, blocks replayed in Python"] = variants["mHC + recompute"]
    if args.whole_sublayer_hooks:
        variants["mHC + recompute, hooks over the sublayer"] = variants["mHC + recompute"]
    if args.null_ops:
        variants[NULL_OPS_RUN] = MHC_VARIANT
    if args.spans:
        Spans.install()
    if args.module_spans:
        ModuleSpans.install()
    phases = {name: [] for name in variants}
    cuda = run_args.device == "cuda"
    gpu_spans = {name: [] for name in variants}
    timers = args.spans or args.module_spans or args.phases
    models = {name: demo.build_model(over is not None, run_args, over)
              for name, over in variants.items()}
    if args.null_ops:  # (host_ops' null ops: autograd functions that allocate the ops'
        #              outputs and gradients and launch nothing)
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from host_ops import with_null_ops

        with_null_ops(models[NULL_OPS_RUN])
    steps = {name: make_step(model, run_args, data, name, phases[name] if timers else None,
                             gpu_spans[name] if args.phases and cuda else None)
             for name, model in models.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step().item()
    Spans.times.clear()
    ModuleSpans.times.clear()
    for runs in (*phases.values(), *gpu_spans.values()):
        runs.clear()
    wall = {name: [] for name in steps}
    host = {name: [] for name in steps}
    round_medians = {name: [] for name in steps}
    timed = overlapped_steps if args.overlap else synced_steps
    GCStats.install()
    for _ in range(args.rounds):
        for name, step in steps.items():
            gc.collect()
            GCStats.run = name
            try:
                times = timed(step, args.steps, host[name])
            finally:
                GCStats.run = None
            wall[name] += times
            round_medians[name].append(statistics.median(times))
    base = statistics.median(wall["baseline"])
    sub = 2 * run_args.layers
    device = torch.cuda.get_device_name() if cuda else "CPU"
    lines = [f"{device}; torch {torch.__version__}; preset {run_args.preset}, "
             f"{run_args.precision}, {args.rounds} x {args.steps} steps a run, "
             f"{'losses read a step later (--overlap)' if args.overlap else 'losses read at once'}",
             "",
             "| run | step ms, median | step ms, min | host ms until the step returns, median "
             "| over the baseline | per sublayer over the baseline, us | over the baseline, "
             "paired: median of the rounds' ratios (range) | GC collections a step, "
             "generation 0 / 1 / 2; ms a step in them |",
             "|---|---|---|---|---|---|---|---|"]
    for name in steps:
        med = statistics.median(wall[name])
        paired = paired_ratios(round_medians[name], round_medians["baseline"])
        lines.append(f"| {name} | {med:.2f} | {min(wall[name]):.2f} | "
                     f"{statistics.median(host[name]):.2f} | {med / base:.3f}x | "
                     f"{1e3 * (med - base) / sub:+.0f} | {statistics.median(paired):.3f}x "
                     f"({min(paired):.3f}-{max(paired):.3f}) | "
                     f"{GCStats.cell(name, len(wall[name]))} |")
    if args.spans:
        lines += Spans.rows(list(steps), phases)
    if args.phases:
        lines += phase_rows(list(steps), phases, gpu_spans)
    if args.module_spans:
        lines += ModuleSpans.rows(list(steps), {name: len(p) for name, p in phases.items()})
    print("\n".join(lines), flush=True)
    if args.profile and cuda:
        rows = profile_rows(steps)
        print("\n".join(rows), flush=True)
        lines += rows
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
