"""mHC's sublayers as the layers run them, chained around a null body (``bench_host.py``'s
chained rows, ``--recompute-chain-parts``, ``--chain-grad-accumulation``): the module's pre and
combine calls with, under ``mhc_recompute``, the layer's block, the sublayer's saving scope,
records, hooks and replays; and the switches that turn the recompute's parts off in turn (also
used by the model steps of :mod:`host_models`)."""

from __future__ import annotations

import contextlib
import statistics
from typing import Callable

import torch

from bench_e2e import build
from host_timing import (DEVICE, N, WARMUP, dense_shape, gc_paused, host_us,
                         launches_and_allocations)


def sublayers_as_layers_run_them(model, tokens: int, accumulate: bool = False):
    """The mHC sublayers of ``model``'s layers 2 and on (streams ``[s, b, n*C]`` in and out,
    ``tokens`` x 1), each as its layer runs it
    (:func:`~mhc_megatron.layers.transformer_layer.run_sublayer`: pre and the combine as the
    module's calls, with ``mhc_recompute`` the sublayer's saving scope and records, inside its
    layer's recompute block, entered once a layer as the layer's forward enters it) around a
    null body (the combine takes ``y`` as the sublayer's output), chained, then one
    ``torch.autograd.backward`` of the last streams; the mapping parameters' gradients dropped
    after each call (``accumulate``: kept, so that each call adds to them, as the model steps
    here do). What mHC's layer code and ops cost a sublayer, without the noise of Megatron's
    sublayers around them. Returns ``(run, sublayers)``."""
    from mhc_megatron.layers.transformer_layer import (_StreamCombine, recompute_scope,
                                                       run_sublayer)

    model.train()
    layers = []  # (layer, [(hyper-connection module, combine, body) a sublayer])
    for layer in model.decoder.layers[1:]:
        subs = []
        for hc in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
            combine = _StreamCombine(hc)  # (no reader of y to watch: the body is null)
            subs.append((hc, combine, lambda y, c=combine: c(True, False)((y, None), None, 0.0)))
        layers.append((layer, subs))
    config = model.config
    device = next(model.parameters()).device
    x0 = torch.randn(tokens, 1, N * config.hidden_size, device=device, dtype=torch.bfloat16,
                     requires_grad=True)
    dout = torch.randn_like(x0)
    leaves = [x0] + ([] if accumulate else
                     [p for _, subs in layers for hc, _, _ in subs for p in hc.parameters()])

    def run():
        x = x0
        for layer, subs in layers:
            with recompute_scope(layer):
                for hc, combine, body in subs:
                    x = run_sublayer(body, hc, combine, x)
        torch.autograd.backward(x, dout)
        for leaf in leaves:
            leaf.grad = None

    return run, sum(len(subs) for _, subs in layers)


def layer_chain_cases(models: dict, tokens: int) -> list[tuple[str, Callable, int]]:
    """``(label, run, sublayers)`` of :func:`sublayers_as_layers_run_them` for each of
    ``models`` (name -> an mHC model)."""
    cases = []
    for name, model in models.items():
        run, count = sublayers_as_layers_run_them(model, tokens)
        cases.append((f"one sublayer as {name}'s layer runs it (pre and the combine module "
                      f"calls around a null body; {count} chained, one backward call; per "
                      f"sublayer)", run, count))
    return cases


def layer_chain_rows(args) -> list[str]:
    """Per sublayer, the host time of :func:`sublayers_as_layers_run_them` for the dense
    model's mHC and mHC + ``mhc_recompute``, median over ``--iters`` calls."""
    shape = dense_shape(args)
    models = {name: build(shape, "local", True, recompute, DEVICE)[0]
              for name, recompute in (("mHC", False), ("mHC + recompute", True))}
    rows = []
    for label, run, count in layer_chain_cases(models, args.tokens):
        for _ in range(WARMUP):
            run()
        rows.append(f"| {label} | {host_us(run, args.iters) / count:.1f} | "
                    f"{launches_and_allocations(run)[0] // count} | |")
    return rows


# The recompute's parts, switched off in turn (:func:`recompute_parts_switched`): a run's
# label -> (model: "mHC" or "recompute", mode)
RECOMPUTE_PART_RUNS = {
    "mHC + recompute": ("recompute", "all"),
    "recompute, blocks replayed in Python": ("recompute", "python replays"),
    "recompute, hooks off (ops recorded)": ("recompute", "no hooks"),
    "recompute, hooks and records off (block scopes)": ("recompute", "no hooks, no records"),
}


@contextlib.contextmanager
def recompute_parts_switched():
    """While open, the recompute's parts are switched by the function yielded, ``switch(mode)``
    (read at each call of the model): ``"all"``; ``"python replays"`` (the blocks' C++ replay
    sites off, :func:`~mhc_megatron.recompute.manager.set_native_replay`); ``"no hooks"`` (no
    sublayer saving scope: no placeholders, no replays; the ops still recorded); ``"no hooks,
    no records"`` (the layers' block scopes alone). Everything is restored on exit."""
    from mhc_megatron.layers import hyper_connection, transformer_layer
    from mhc_megatron.recompute import manager as rm

    mode = ["all"]
    native_replay = rm.native_replay()
    saving, record_as, run_recorded = (transformer_layer.sublayer_saving,
                                       hyper_connection.record_as, hyper_connection.run_recorded)
    site_record = hyper_connection.HyperConnectionModule._site_record

    def no_records(fn, *a, **k):
        return fn(*a, **k)

    def switch(value: str) -> None:
        mode[0] = value
        rm.set_native_replay(native_replay and value != "python replays")

    transformer_layer.sublayer_saving = lambda: None if mode[0].startswith("no") else saving()
    hyper_connection.record_as = lambda *a, **k: (None if mode[0] == "no hooks, no records"
                                                  else record_as(*a, **k))
    # (the module's site calls record inside the call: no record handed to them either)
    hyper_connection.HyperConnectionModule._site_record = lambda self, block, fn: (
        None if mode[0] == "no hooks, no records" else site_record(self, block, fn))
    hyper_connection.run_recorded = lambda *a, **k: (
        no_records if mode[0] == "no hooks, no records" else run_recorded)(*a, **k)
    try:
        yield switch
    finally:
        transformer_layer.sublayer_saving = saving
        hyper_connection.record_as, hyper_connection.run_recorded = record_as, run_recorded
        hyper_connection.HyperConnectionModule._site_record = site_record
        rm.set_native_replay(native_replay)


def _chain_rounds(runs: dict, args, prepare: Callable | None = None) -> dict:
    """Host us a sublayer of each of ``runs`` (label -> ``(run, sublayers)``, as
    :func:`sublayers_as_layers_run_them` returns), ``WARMUP`` calls each first, then
    ``--rounds`` alternating rounds of ``--iters`` calls; ``prepare(label)`` before each
    label's calls. Label -> the rounds' values."""
    def timed(name, iters):
        if prepare is not None:
            prepare(name)
        run, count = runs[name]
        return host_us(run, iters) / count

    for name in runs:
        timed(name, WARMUP)
    times = {name: [] for name in runs}
    with gc_paused():
        for _ in range(args.rounds):
            for name in runs:
                times[name].append(timed(name, args.iters))
    return times


def _chain_table(times: dict, sublayers: int, args, base: str | None = None) -> list[str]:
    """:func:`_chain_rounds`'s ``times`` as a table: median of the rounds (their range), and
    with ``base`` each label's median over ``base``'s."""
    over = "" if base is None else f" over {base} |"
    lines = [f"| one sublayer as the layers run it ({sublayers} chained, one backward call), us "
             f"a sublayer: median of {args.rounds} rounds of {args.iters} calls (range) | us |"
             + over, "|---|---|" + ("---|" if base else "")]
    ref = None if base is None else statistics.median(times[base])
    for name, got in times.items():
        med = statistics.median(got)
        lines.append(f"| {name} | {med:.1f} ({min(got):.1f} to {max(got):.1f}) |"
                     + ("" if ref is None else f" {med - ref:+.1f} |"))
    print("\n".join(lines), flush=True)
    return lines


def recompute_chain_parts_rows(args) -> list[str]:
    """``--recompute-chain-parts``: where ``mhc_recompute``'s host time goes in mHC's sublayers
    as the layers run them (:func:`sublayers_as_layers_run_them`, per sublayer): mHC without
    recompute, the recompute, and the recompute with its parts switched off in turn
    (:data:`RECOMPUTE_PART_RUNS`), in ``--rounds`` alternating rounds of ``--iters`` calls
    each; median of the rounds (their range), and each over mHC's."""
    shape = dense_shape(args)
    chains = {name: sublayers_as_layers_run_them(
        build(shape, "local", True, recompute, DEVICE)[0], args.tokens)
        for name, recompute in (("mHC", False), ("recompute", True))}
    parts = {"mHC": ("mHC", "all"), **RECOMPUTE_PART_RUNS}
    with recompute_parts_switched() as switch:
        times = _chain_rounds({name: chains[model] for name, (model, _) in parts.items()}, args,
                              lambda name: switch(parts[name][1]))
    return _chain_table(times, chains["mHC"][1], args, base="mHC")


def chain_grad_accumulation_rows(args) -> list[str]:
    """``--chain-grad-accumulation``: mHC's sublayers as the layers run them
    (:func:`sublayers_as_layers_run_them`, per sublayer), with and without ``mhc_recompute``,
    the mapping parameters' gradients dropped after each call against accumulated into
    ``.grad`` (an ``AccumulateGrad`` add a parameter, three a sublayer), in ``--rounds``
    alternating rounds of ``--iters`` calls; median of the rounds (their range)."""
    shape = dense_shape(args)
    runs = {}
    for name, recompute in (("mHC", False), ("mHC + recompute", True)):
        model = build(shape, "local", True, recompute, DEVICE)[0]
        for accumulate in (False, True):
            label = f"{name}, gradients {'accumulated' if accumulate else 'dropped'}"
            runs[label] = sublayers_as_layers_run_them(model, args.tokens, accumulate)
    return _chain_table(_chain_rounds(runs, args), next(iter(runs.values()))[1], args)
