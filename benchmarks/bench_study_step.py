"""The study preset's training step, baseline against mHC (and mHC + ``mhc_recompute``).

    python benchmarks/bench_study_step.py [--recompute] [--profile] [--rounds 4] [--steps 10]

The step of ``examples/mhc_study.py --preset study --precision bf16 --mhc-params fp32
--attention sdpa`` (85M GPT, 12 x 768, seq 512, batch 32; the study's mHC variant
``static:zero,gating:0.01``): forward, backward, the example's ``MasterWeightAdamW`` step and
``loss.item()``, on random bytes. The models are built side by side and timed in alternating
rounds (``--rounds`` x ``--steps`` steps each, after warm-up): per run the median and
minimum step time and the host time until the step returns (before ``loss.item()``); where
the host time is as long as the step, the step is host-bound. The ratio to the baseline is
given twice: of the medians over all rounds, and paired, the median of the rounds' own ratios
(each round's median step against the baseline's in that round), which a slow drift of the
host's speed does not bias; many short rounds (``--rounds 20 --steps 3``) pair closest.

``--overlap``: each step's loss is read after the next step's work is issued, not right after
its own step, so the host issues step k+1 while the GPU runs step k (a step's time is then the
interval between two loss reads, its host time the part of it until its work is issued).
``--profile``: the GPU time a step (torch profiler, kernels only) and each run's top kernels.
Extra arguments go to the example's parser (``--preset``, ``--precision`` ...).
"""

from __future__ import annotations

import argparse
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


def make_step(model, args, data):
    """The study loop's step for ``model`` (without the loss check and evaluations)."""
    opt = demo.MasterWeightAdamW(demo.param_groups(model, 0.1, True), clip=1.0, lr=1e-4,
                                 betas=(0.9, 0.95))
    batches = demo.make_batches(data, args, args.seed)

    def step():
        ids, labels = batches.next()
        loss = model(ids, batches.position_ids, batches.mask, labels=labels).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def synced_steps(step, count: int, host: list) -> list[float]:
    """``count`` steps, each loss read right after its step (the example's loop): the steps'
    times in ms; their host times (until the step's work is issued) appended to ``host``."""
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        loss.item()
        times.append(1e3 * (time.perf_counter() - t0))
        host.append(1e3 * (t1 - t0))
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
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default=None)
    args, rest = p.parse_known_args(argv)
    run_args = demo.parse_args(STUDY_FLAGS + rest)
    demo.setup_megatron(run_args.device, run_args.seed)
    data = np.random.default_rng(0).integers(0, 256, size=4_000_000).astype(np.uint8)
    variants = {"baseline": None, "mHC": MHC_VARIANT}
    if args.recompute:
        variants["mHC + recompute"] = {**MHC_VARIANT, "mhc_recompute": True}
    steps = {name: make_step(demo.build_model(over is not None, run_args, over), run_args, data)
             for name, over in variants.items()}
    cuda = run_args.device == "cuda"
    for step in steps.values():
        for _ in range(args.warmup):
            step().item()
    wall = {name: [] for name in steps}
    host = {name: [] for name in steps}
    round_medians = {name: [] for name in steps}
    timed = overlapped_steps if args.overlap else synced_steps
    for _ in range(args.rounds):
        for name, step in steps.items():
            times = timed(step, args.steps, host[name])
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
             "paired: median of the rounds' ratios (range) |",
             "|---|---|---|---|---|---|---|"]
    for name in steps:
        med = statistics.median(wall[name])
        paired = paired_ratios(round_medians[name], round_medians["baseline"])
        lines.append(f"| {name} | {med:.2f} | {min(wall[name]):.2f} | "
                     f"{statistics.median(host[name]):.2f} | {med / base:.3f}x | "
                     f"{1e3 * (med - base) / sub:+.0f} | {statistics.median(paired):.3f}x "
                     f"({min(paired):.3f}-{max(paired):.3f}) |")
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
