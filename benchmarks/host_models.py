"""Host time inside the 4-layer models' steps (``bench_host.py``'s model rows and its
``--breakdown``, ``--grad-fusion``, ``--profile-models``, ``--recompute-split``,
``--sublayer-split``, ``--recompute-phases``): baseline, mHC and mHC + ``mhc_recompute`` built
side by side, their steps interleaved, and the pieces of a step timed where they run."""

from __future__ import annotations

import cProfile
import gc
import pstats
import statistics
import time

import torch

from bench_e2e import RUNS, _sync, build, fixed_batch, make_step
from host_chain import RECOMPUTE_PART_RUNS, recompute_parts_switched
from host_ops import counting_launch_paths, sublayers_through_engine, with_null_ops
from host_timing import (DEVICE, ENGINE_DEPTH, WARMUP, alternating_table, dense_shape,
                         gc_paused, host_us, paired_growth, paired_steps)


def model_rows(args) -> list[str]:
    """Baseline, mHC and mHC + recompute models built side by side and timed in ``--rounds``
    rounds of 10 steps each, the models' steps interleaved one by one (:func:`paired_steps`:
    a host that other work shares drifts; interleaving keeps them under the same conditions)."""
    rows = []
    for kind in ("dense", "moe"):
        shape = dense_shape(args)
        if kind == "moe":
            shape.update(experts=16, topk=4, ffn=args.hidden // 2, shared=args.hidden)
        steps = {run: make_step(build(shape, "local", mhc, recompute, DEVICE)[0], shape,
                                "local", DEVICE) for run, mhc, recompute in RUNS}
        for step in steps.values():  # Triton compiles; grads allocated; recipes recorded
            for _ in range(3):
                step()
        times = {run: [] for run in steps}
        medians = {run: [] for run in steps}
        with gc_paused():
            for _ in range(args.rounds):
                for run, got in paired_steps(steps, 10).items():
                    times[run] += got
                    medians[run].append(statistics.median(got))
        sub = 2 * shape["layers"]
        cells = " | ".join(f"{statistics.median(m):.2f} ({min(m):.2f}-{max(m):.2f})"
                           for m in medians.values())
        rows.append(f"| {kind} | {cells} | "
                    f"{paired_growth(times['mHC'], times['baseline'], sub)} | "
                    f"{paired_growth(times['mHC + recompute'], times['mHC'], sub)} |")
        print(rows[-1], flush=True)
        del steps
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def _func_name(key) -> str:
    path, line, func = key
    if path == "~":
        return func  # a builtin: "<method 'contiguous' of 'torch._C.TensorBase' objects>"
    parts = path.replace("\\", "/").split("/")
    short = "/".join(parts[parts.index("site-packages") + 1:] if "site-packages" in parts
                     else parts[-2:])
    return f"{short}:{line}({func})"


def profile_models(args, out_path: str, steps: int, recompute: bool = False) -> None:
    """The dense model's baseline and mHC steps under cProfile and torch's profiler; writes
    the per-step differences (mHC minus baseline) to ``out_path``. With ``recompute``
    (``--profile-recompute``): mHC's steps and mHC + ``mhc_recompute``'s, the differences
    the recompute's over mHC's."""
    from torch.profiler import ProfilerActivity, profile

    shape = dense_shape(args)
    sub = 2 * shape["layers"]
    pair = ((("mHC", True, False), ("mHC + recompute", True, True)) if recompute
            else (("baseline", False, False), ("mHC", True, False)))
    runs = {name: make_step(build(shape, "local", mhc, rec, DEVICE)[0], shape, "local", DEVICE)
            for name, mhc, rec in pair}
    stats, ops, device_us = {}, {}, {}
    for name, step in runs.items():
        for _ in range(WARMUP):
            step()
        _sync()
        gc.collect()
        gc.disable()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        _sync()
        stats[name] = pstats.Stats(prof).stats
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda"
                                               else [])
        with profile(activities=activities) as tprof:
            for _ in range(steps):
                step()
        _sync()
        gc.enable()
        averages = tprof.key_averages()
        ops[name] = {e.key: (e.count, e.self_cpu_time_total) for e in averages}
        device_us[name] = sum(getattr(e, "self_device_time_total", 0) for e in averages) / steps
    base_name, run_name = (name for name, _, _ in pair)
    base, mhc = stats[base_name], stats[run_name]
    per = 1e6 / steps
    rows = []
    for key in set(base) | set(mhc):
        b, m = base.get(key, (0, 0, 0.0, 0.0, {})), mhc.get(key, (0, 0, 0.0, 0.0, {}))
        rows.append(((m[2] - b[2]) * per, (m[1] - b[1]) / steps, (m[3] - b[3]) * per, key))
    total_b = sum(v[2] for v in base.values()) * per
    total_m = sum(v[2] for v in mhc.values()) * per
    lines = [f"cProfile, {steps} steps each (times inflated by the profiler), dense model, "
             f"{sub} sublayers: own time a step {base_name} {total_b:.0f} us, {run_name} "
             f"{total_m:.0f} us, +{(total_m - total_b) / sub:.0f} us a sublayer", "",
             "| function | extra calls / step | extra own us / step | extra cumulative us / step |",
             "|---|---|---|---|"]
    for tt, calls, ct, key in sorted(rows, key=lambda r: -r[0])[:45]:
        lines.append(f"| {_func_name(key)} | {calls:+.0f} | {tt:+.1f} | {ct:+.1f} |")
    lines += ["", f"{run_name}'s own functions (mhc_megatron), cumulative us a step:", "",
              "| function | calls / step | own us / step | cumulative us / step |",
              "|---|---|---|---|"]
    ours = [(v[3] * per, v[1] / steps, v[2] * per, k) for k, v in mhc.items()
            if "mhc_megatron" in k[0]]
    for ct, calls, tt, key in sorted(ours, key=lambda r: -r[0])[:40]:
        lines.append(f"| {_func_name(key)} | {calls:.0f} | {tt:.1f} | {ct:.1f} |")
    if DEVICE == "cuda":  # is the step host-bound? kernel time a step against the step time
        lines += ["", "GPU kernel time a step (torch profiler): " + ", ".join(
            f"{name} {us:.0f} us" for name, us in device_us.items()) + " (a step takes longer "
            "than this where the host is the bound)"]
    lines += ["", f"torch profiler: ops a step, {run_name} minus {base_name} (self CPU us a "
              "step)", "",
              "| op | extra calls / step | extra self CPU us / step |", "|---|---|---|"]
    keys = set(ops[base_name]) | set(ops[run_name])
    diff = [((ops[run_name].get(k, (0, 0))[0] - ops[base_name].get(k, (0, 0))[0]) / steps,
             (ops[run_name].get(k, (0, 0))[1] - ops[base_name].get(k, (0, 0))[1]) / steps, k)
            for k in keys]
    for calls, us, k in sorted(diff, key=lambda r: -abs(r[1]))[:40]:
        lines.append(f"| {k} | {calls:+.1f} | {us:+.1f} |")
    with open(out_path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines[:60]), flush=True)


def breakdown_rows(args) -> list[str]:
    """``--breakdown``: baseline, mHC and mHC with null ops, the dense model, alternating
    rounds; per run the minimum and the median step time, and per sublayer the layer code's
    and the ops' share of mHC's extra time."""
    shape = dense_shape(args)
    sub = 2 * shape["layers"]
    models = {name: build(shape, "local", mhc, False, DEVICE)[0]
              for name, mhc in (("baseline", False), ("mHC", True), ("mHC, null ops", True))}
    ops = with_null_ops(models["mHC, null ops"])
    steps = {name: make_step(m, shape, "local", DEVICE) for name, m in models.items()}
    lines, lo = alternating_table(steps, args.rounds, sub, "dense, 4 layers, local specs")
    wrap = (lo["mHC, null ops"] - lo["baseline"]) / sub * 1e3
    kern = (lo["mHC"] - lo["mHC, null ops"]) / sub * 1e3
    # the null ops are Python autograd functions with allocations: their own host time is
    # part of "null minus baseline", measured here alone (8 sublayers chained, as in a step)
    null_alone, ops_alone = (host_us(sublayers_through_engine(args.tokens, args.hidden,
                                                              ENGINE_DEPTH, chained), args.iters)
                             / ENGINE_DEPTH for chained in (ops, None))
    with counting_launch_paths() as paths:
        for _ in range(10):
            steps["mHC"]()
    _sync()
    lines += ["", f"per sublayer (minimum): layer code around the ops {wrap:.0f} us, the ops "
              f"{kern:.0f} us",
              "", f"per sublayer, {ENGINE_DEPTH} sublayers chained through autograd alone: the "
              f"null ops {null_alone:.0f} us, the ops {ops_alone:.0f} us; the layer code "
              f"around the ops less the null ops' own time: {wrap - null_alone:.0f} us",
              "", "the ops' launches in 10 mHC steps, by path: "
              + ", ".join(f"{k} {v}" for k, v in paths.items())]
    print("\n".join(lines), flush=True)
    return lines


def grad_fusion_rows(args) -> list[str]:
    """``--grad-fusion``: the dense model's training step inside Megatron's DDP (fp32 main
    grads), baseline, mHC, and mHC with ``gradient_accumulation_fusion`` for its mapping
    parameters (the pre's backward adds their gradients to the main grads; DDP's hook adds
    nothing for them), alternating rounds. The flag is set on the mHC model's config after it
    is built: Megatron's own linear layers would need Apex for it, and only the mHC modules
    read it at run time."""
    shape = dense_shape(args)
    sub = 2 * shape["layers"]
    built = {name: build(shape, "local", mhc, False, DEVICE, ddp=True)
             for name, mhc in (("baseline", False), ("mHC", True))}
    mhc_config = built["mHC"][1]

    def with_fusion(step, fused: bool):
        def run():
            mhc_config.gradient_accumulation_fusion = fused
            step()
        return run

    mhc_step = make_step(built["mHC"][0], shape, "local", DEVICE)
    steps = {"baseline": make_step(built["baseline"][0], shape, "local", DEVICE),
             "mHC": with_fusion(mhc_step, False),
             "mHC, gradient_accumulation_fusion": with_fusion(mhc_step, True)}
    try:
        lines, lo = alternating_table(steps, args.rounds, sub,
                                       "dense, 4 layers, local specs, Megatron's DDP")
    finally:
        mhc_config.gradient_accumulation_fusion = False
    saved = (lo["mHC"] - lo["mHC, gradient_accumulation_fusion"]) / sub * 1e3
    lines += ["", f"per sublayer (minimum): the fusion saves {saved:.0f} us"]
    print("\n".join(lines), flush=True)
    return lines


class _PieceTimers:
    """Host time spent in functions inside a model's step: :meth:`wrap` replaces
    ``owner.attribute`` (and the same function held by other owners) with a call that adds its
    time and a call to ``spans[label][run]`` while ``run`` names the step being timed
    (:meth:`timing`; None: not timing); :meth:`restore` puts the functions back."""

    def __init__(self):
        self.spans: dict[str, dict[str, list]] = {}
        self.run: str | None = None
        self._saved: list = []

    def timed(self, fn, label: str):
        spans = self.spans.setdefault(label, {})

        def call(*a, **k):
            run = self.run
            if run is None:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cell = spans.setdefault(run, [0.0, 0])
                cell[0] += time.perf_counter() - t0
                cell[1] += 1
        return call

    def replace(self, owner, attr: str, value) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def wrap(self, label: str, owner, attr: str, others=()) -> None:
        timed = self.timed(getattr(owner, attr), label)
        for o in (owner, *others):
            self.replace(o, attr, timed)

    def timing(self, run: str, step):
        """``step`` with its pieces timed under ``run``."""
        def timed_step():
            self.run = run
            try:
                step()
            finally:
                self.run = None
        return timed_step

    def reset(self) -> None:
        for cells in self.spans.values():
            cells.clear()

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def us_a_sublayer(self, label: str, run: str, steps: int, sublayers: int) -> tuple:
        total, calls = self.spans[label].get(run, (0.0, 0))
        return 1e6 * total / steps / sublayers, calls / steps / sublayers


def _timed_paired_steps(args, steps: dict, timers: _PieceTimers) -> tuple[dict, int]:
    """Warm-up steps, then :func:`paired_steps` of ``steps`` (their pieces timed only there):
    ``(times, steps each)``."""
    for step in steps.values():  # compiles, records, allocates the grads
        for _ in range(WARMUP):
            step()
    timers.reset()
    count = 10 * args.rounds
    with gc_paused():
        return paired_steps(steps, count), count


def recompute_split_rows(args) -> list[str]:
    """``--recompute-split``: where ``mhc_recompute``'s host time goes in the dense model's
    step. The mHC model with and without recompute, their steps interleaved one by one
    (:func:`paired_steps`); in the recompute's steps the host time spent in each piece of
    :mod:`mhc_megatron.recompute.manager` (forward: a sublayer's saving scope, the hooks'
    switches, the ops' records made after their calls, those of calls that missed their site
    (a module's call at its site records inside the call); backward, on autograd's device
    thread: the unpack hook's
    calls, of which the block replays), per sublayer, beside the paired steps' difference."""
    from mhc_megatron.layers import hyper_connection, transformer_layer
    from mhc_megatron.recompute import manager as rm

    shape = dense_shape(args)
    sub = 2 * shape["layers"]
    steps = {name: make_step(build(shape, "local", True, recompute, DEVICE)[0], shape, "local",
                             DEVICE) for name, recompute in (("mHC", False),
                                                             ("mHC + recompute", True))}
    timers = _PieceTimers()
    run = "mHC + recompute"  # (timed in the recompute's steps only: mHC's calls some pieces)
    unpack = "backward: the saved tensors' unpack hook (with the block replays)"
    labels = ["forward: SublayerSaving (hooks pushed)", "forward: hooks on / off / close",
              "forward: records of pre's aggregate and the combine after the call (record_as:"
              " a call that missed its site; a site call records inside the call)", unpack,
              "backward: the block replays alone"]
    try:
        timers.wrap(labels[0], rm, "sublayer_saving", (transformer_layer,))
        for attr in ("on", "off", "close"):
            timers.wrap(labels[1], rm.SublayerSaving, attr)
        timers.wrap(labels[2], rm, "record_as", (hyper_connection,))

        def timed_hooks(_hooks=rm._hooks):  # the blocks' unpack hook, as _hooks hands it out
            ranges, unpack_hook = _hooks()
            return ranges, timers.timed(unpack_hook, unpack)

        timers.replace(rm, "_hooks", timed_hooks)
        timers.wrap(labels[4], rm._BlockState, "recompute")
        # (backward returns once autograd's thread has run the replays)
        steps[run] = timers.timing(run, steps[run])
        times, count = _timed_paired_steps(args, steps, timers)
    finally:
        timers.restore()
    lines = [f"| recompute's host time, dense model, local specs ({count} steps) | us a "
             "sublayer | calls a sublayer |", "|---|---|---|"]
    for label in labels:
        us, calls = timers.us_a_sublayer(label, run, count, sub)
        lines.append(f"| {label} | {us:.1f} | {calls:.1f} |")
    lines.append(f"| mHC + recompute's step over mHC's (median of step pairs, interquartile "
                 f"range) | {paired_growth(times[run], times['mHC'], sub)} | |")
    print("\n".join(lines), flush=True)
    return lines


def sublayer_split_rows(args) -> list[str]:
    """``--sublayer-split``: where mHC's forward host time goes in the dense model's step (no
    recompute). The baseline's and mHC's steps interleaved one by one (:func:`paired_steps`),
    each timed around the pieces of its sublayers' forward: Megatron's sublayer method
    (``TransformerLayer._forward_attention`` / ``_forward_mlp``: the input norm, the attention
    or MLP, and the bias-dropout-add slot, which mHC's combine fills), and in mHC's steps also
    the whole sublayer as mHC runs it (``run_sublayer``: pre, then Megatron's method), pre (the
    module's call) and the combine (the slot's call); per sublayer, beside the paired steps'
    growth. mHC's own forward host time a sublayer is the whole sublayer minus the baseline's
    Megatron method. (Pre and the combine do not split it further: the combine takes the place
    of Megatron's bias-dropout-add, whose own time is inside the baseline's method.)"""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mhc_megatron.layers import hyper_connection, transformer_layer

    shape = dense_shape(args)
    sub = 2 * shape["layers"]
    steps = {name: make_step(build(shape, "local", mhc, False, DEVICE)[0], shape, "local",
                             DEVICE) for name, mhc in (("baseline", False), ("mHC", True))}
    timers = _PieceTimers()
    megatron = "forward: Megatron's sublayer method (norm, body, bias-dropout-add slot)"
    whole = "forward: the whole sublayer as mHC runs it (run_sublayer)"
    pre = "forward: pre (the module's call)"
    combine = "forward: the combine (the bias-dropout-add slot's call)"
    try:
        for attr in ("_forward_attention", "_forward_mlp"):
            timers.wrap(megatron, TransformerLayer, attr)
        timers.wrap(whole, transformer_layer, "run_sublayer")
        timers.wrap(pre, hyper_connection.HyperConnectionModule, "pre")
        timers.wrap(combine, transformer_layer._StreamCombine, "_combine")
        steps = {name: timers.timing(name, step) for name, step in steps.items()}
        times, count = _timed_paired_steps(args, steps, timers)
    finally:
        timers.restore()
    lines = [f"| forward host time, dense model, local specs ({count} steps each), us a "
             "sublayer (calls) | baseline | mHC |", "|---|---|---|"]
    for label in (megatron, whole, pre, combine):
        cells = [timers.us_a_sublayer(label, run, count, sub) for run in ("baseline", "mHC")]
        lines.append(f"| {label} | " + " | ".join(
            f"{us:.1f} ({calls:.1f})" if calls else "-" for us, calls in cells) + " |")
    whole_us = timers.us_a_sublayer(whole, "mHC", count, sub)[0]
    base_us = timers.us_a_sublayer(megatron, "baseline", count, sub)[0]
    lines += [f"| forward: mHC's own (the whole sublayer minus the baseline's Megatron method) "
              f"| | {whole_us - base_us:.1f} |",
              f"| mHC's step over the baseline's, forward and backward (median of step pairs, "
              f"interquartile range) | | {paired_growth(times['mHC'], times['baseline'], sub)} |"]
    print("\n".join(lines), flush=True)
    return lines


def recompute_phases_rows(args) -> list[str]:
    """``--recompute-phases``: ``mhc_recompute``'s host time in the dense model's forward and
    backward apart, and what its parts add: the recompute's steps, the same model with the
    blocks' saved-tensor hooks off (its ops still recorded, nothing recomputed: no
    placeholders, no replays) and with the records off too (the layers' block scopes and the
    hooks' switch on the input norm alone), and the recompute with its blocks replayed in
    Python (their C++ replay sites off), each against mHC's steps without recompute, and mHC's
    against the baseline's (Megatron's plain model), all interleaved one by one. Each phase is
    timed between device syncs; per sublayer, the median of the paired differences."""
    shape = dense_shape(args)
    sub = 2 * shape["layers"]
    models = {name: build(shape, "local", mhc, recompute, DEVICE)[0]
              for name, mhc, recompute in (("baseline", False, False), ("mHC", True, False),
                                           ("recompute", True, True))}
    ids, pos, mask = fixed_batch(shape, "local", DEVICE)
    runs = {"baseline": ("baseline", "all"), "mHC": ("mHC", "all"), **RECOMPUTE_PART_RUNS}
    times = {name: [] for name in runs}

    def step(name, out=None):
        model = models[runs[name][0]]
        switch(runs[name][1])
        _sync()
        t0 = time.perf_counter()
        loss = model(ids, pos, mask, labels=ids).float().mean()
        _sync()
        t1 = time.perf_counter()
        loss.backward()
        _sync()
        if out is not None:
            out.append((t1 - t0, time.perf_counter() - t1))

    with recompute_parts_switched() as switch:
        for name in runs:
            for _ in range(WARMUP):
                step(name)
        with gc_paused():
            for _ in range(10 * args.rounds):
                for name in runs:
                    step(name, times[name])
    lines = [f"{name}'s step (medians): forward "
             f"{1e3 * statistics.median(t[0] for t in times[name]):.2f} ms, backward "
             f"{1e3 * statistics.median(t[1] for t in times[name]):.2f} ms "
             f"({len(times[name])} steps)" for name in ("baseline", "mHC")]
    lines += ["", "| us a sublayer, median of step pairs: over mHC's step (the first row: mHC's "
              "over the baseline's) | forward | backward | step |", "|---|---|---|---|"]
    for name, over in [("mHC", "baseline")] + [(name, "mHC") for name in list(runs)[2:]]:
        diffs = [[1e6 * (r[i] - b[i]) / sub for r, b in zip(times[name], times[over])]
                 for i in (0, 1)]
        steps = [f + b for f, b in zip(*diffs)]
        label = "mHC over the baseline" if over == "baseline" else name
        lines.append(f"| {label} | {statistics.median(diffs[0]):.1f} | "
                     f"{statistics.median(diffs[1]):.1f} | {statistics.median(steps):.1f} |")
    print("\n".join(lines), flush=True)
    return lines
