"""Two modes of the ops' host path side by side in one process (``bench_host.py``'s
``--*-ab`` options): the op calls, the sublayers chained, the layers' sublayers and the dense
models' steps, the two modes alternating round by round."""

from __future__ import annotations

import contextlib
import statistics
from types import SimpleNamespace

from bench_e2e import build, make_step
from host_chain import layer_chain_cases
from host_ops import no_replay_rows, op_cases, sublayers_through_engine, switched_off
from host_timing import (DEVICE, ENGINE_DEPTH, WARMUP, dense_shape, gc_paused, host_us,
                         paired_growth, paired_steps)


@contextlib.contextmanager
def argument_keys():
    """The ops launch with the per-argument key on every launch (their signature None), as
    before launches by signature."""
    from mhc_megatron.kernels import triton_combine, triton_pre

    saved = triton_pre.signature, triton_combine.signature
    triton_pre.signature = triton_combine.signature = lambda *tensors, extra=(): None
    try:
        yield
    finally:
        triton_pre.signature, triton_combine.signature = saved


def launch_ab_rows(args) -> list[str]:
    """``--launch-ab``: launches by signature against the per-argument key (see
    :func:`ab_rows`)."""
    return ab_rows(args, (("by signature", contextlib.nullcontext),
                          ("per-argument key", argument_keys)))


def on_off_rows(args, on: str, off: str, switch) -> list[str]:
    """:func:`ab_rows` of a path ``switch`` turns on and off (``enabled()`` and
    ``set_enabled()``: a module or a namespace of the two), named ``on`` and ``off``; or the
    row that says why the ops' host replay cannot run here."""
    return no_replay_rows() or ab_rows(
        args, ((on, contextlib.nullcontext), (off, lambda: switched_off(switch))))


def native_ab_rows(args) -> list[str]:
    """``--native-ab``: the ops' C++ autograd nodes against their Python autograd functions,
    the replay on in both (the per-op rows call the Python functions directly in both modes,
    the chained sublayers and the model steps differ)."""
    from mhc_megatron.kernels import native_autograd

    return on_off_rows(args, "C++ nodes", "Python functions", native_autograd)


def site_ab_rows(args) -> list[str]:
    """``--site-ab``: the C++ nodes' calls replayed from their call sites against the same
    nodes called through the ops' Python path."""
    from mhc_megatron.kernels import native_autograd

    return on_off_rows(args, "call sites", "no call sites", SimpleNamespace(
        enabled=native_autograd.sites_enabled, set_enabled=native_autograd.set_sites_enabled))


def module_calls_ab_rows(args) -> list[str]:
    """``--module-calls-ab``: a module's pre and combine called from its call site in one call
    into the extension against the module calling the ops (whose calls replay from the same
    sites; the per-op rows call the ops directly in both modes)."""
    from mhc_megatron.kernels import native_autograd

    return on_off_rows(args, "module calls", "op calls", SimpleNamespace(
        enabled=native_autograd.module_calls_enabled,
        set_enabled=native_autograd.set_module_calls_enabled))


def hooks_ab_rows(args) -> list[str]:
    """``--hooks-ab``: ``mhc_recompute``'s saved-tensor hooks in C++ against the same hooks in
    Python (only the recompute's model step differs)."""
    from mhc_megatron.recompute import manager

    return on_off_rows(args, "C++ hooks", "Python hooks", SimpleNamespace(
        enabled=manager.native_hooks, set_enabled=manager.set_native_hooks))


def scope_ab_rows(args) -> list[str]:
    """``--scope-ab``: ``mhc_recompute``'s saved-tensor hooks on only where mHC outputs are
    saved (pre, the module that reads y, the combine) against on over each whole sublayer (only the
    recompute's model step differs)."""
    from mhc_megatron.recompute import manager

    return on_off_rows(args, "hooks where saved", "hooks over the sublayer", SimpleNamespace(
        enabled=manager.narrow_hooks, set_enabled=manager.set_narrow_hooks))


def replay_ab_rows(args) -> list[str]:
    """``--replay-ab``: the ops' host work replayed from C++ against the Python path."""
    from mhc_megatron.kernels import host_replay

    return on_off_rows(args, "C++ replay", "Python", host_replay)


def ab_rows(args, modes) -> list[str]:
    """Two modes of the ops' host path (``modes``: ``(name, context factory)`` each) in one
    process, alternating ``--rounds`` times: per op, for ``ENGINE_DEPTH`` sublayers chained
    through autograd (per sublayer), for the mHC models' sublayers as their layers run them
    (:func:`sublayers_as_layers_run_them`, per sublayer), and for the dense model's baseline,
    mHC and mHC +
    ``mhc_recompute`` steps (median of the rounds' medians for the ops; for the models, whose
    steps are interleaved one by one (:func:`paired_steps`), the minimum over the rounds'
    steps, each mHC step over the baseline's per sublayer by those minima, and the median of
    the paired steps' differences per sublayer)."""
    cases = op_cases(args.tokens, args.hidden)
    cases.append((f"one sublayer through autograd ({ENGINE_DEPTH} chained, one backward call; "
                  "per sublayer)", sublayers_through_engine(args.tokens, args.hidden,
                                                            ENGINE_DEPTH)))
    per_call = {name: (ENGINE_DEPTH if name.startswith("one sublayer") else 1)
                for name, _ in cases}
    shape = dense_shape(args)
    built = {name: build(shape, "local", mhc, recompute, DEVICE)[0]
             for name, mhc, recompute in (("baseline", False, False), ("mHC", True, False),
                                          ("mHC + recompute", True, True))}
    for label, run, count in layer_chain_cases(
            {name: built[name] for name in ("mHC", "mHC + recompute")}, args.tokens):
        cases.append((label, run))
        per_call[label] = count
    models = {name: make_step(model, shape, "local", DEVICE) for name, model in built.items()}
    ops = {(mode, name): [] for mode, _ in modes for name, _ in cases}
    steps = {(mode, name): [] for mode, _ in modes for name in models}
    for mode, ctx in modes:  # warm-up: compiles, fills every cache (and records)
        with ctx():
            for _, fn in cases:
                for _ in range(WARMUP):
                    fn()
            for step in models.values():
                for _ in range(3):
                    step()
    with gc_paused():
        for _ in range(args.rounds):
            for mode, ctx in modes:
                with ctx():
                    for name, fn in cases:
                        ops[mode, name].append(host_us(fn, max(args.iters // args.rounds, 1))
                                               / per_call[name])
                    for model, got in paired_steps(models, 10).items():
                        steps[mode, model] += got
    sub = 2 * shape["layers"]
    names = [m for m, _ in modes]
    lines = ["| host us | " + " | ".join(names) + " | difference |", "|---|---|---|---|"]
    for name, _ in cases:
        a, b = (statistics.median(ops[m, name]) for m in names)
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    for model in models:
        a, b = (min(steps[m, model]) for m in names)
        lines.append(f"| dense {model} model step (4 layers), ms, min | {a:.3f} | {b:.3f} | "
                     f"{1e3 * (a - b) / sub:+.0f} us a sublayer |")
    for model in ("mHC", "mHC + recompute"):
        over = [1e3 * (min(steps[m, model]) - min(steps[m, "baseline"])) / sub for m in names]
        lines.append(f"| {model}'s step over the baseline's, per sublayer, us (min) | "
                     f"{over[0]:.0f} | {over[1]:.0f} | {over[0] - over[1]:+.0f} |")
    for model, base in (("mHC", "baseline"), ("mHC + recompute", "mHC")):
        cells = [paired_growth(steps[m, model], steps[m, base], sub) for m in names]
        lines.append(f"| {model}'s step over the {base}'s, per sublayer, us (median of step "
                     f"pairs, interquartile range) | {cells[0]} | {cells[1]} | |")
    print("\n".join(lines), flush=True)
    return lines
