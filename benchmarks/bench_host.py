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
* the same sublayer's ops as a model runs them: forward through the autograd functions and
  ``torch.autograd.backward`` (on a GPU the backward functions run on autograd's device
  thread), one sublayer a backward call and 8 chained into one call (a model's step pays
  the call's own cost once), per sublayer, against the sum of the direct calls; and what a
  Python autograd node costs through the engine, on this device and on the CPU;
* mHC's sublayers of the dense model (layers 2 to 4) as their layers run them, pre and the
  combine as the module's calls around a null body, chained, one backward call, per
  sublayer: for mHC and for mHC + ``mhc_recompute`` (its saving scopes, records, hooks and
  replays), so their difference is the recompute's host cost a sublayer without the noise of
  Megatron's sublayers around it;
* the physical floor: the host time of as many empty Triton kernel launches as one
  sublayer's ops make (forward and backward), through our launcher and through Triton's own,
  beside the sum of the four ops' host times (CUDA only);
* per model step (``bench_e2e``'s GPT, local specs, 4 layers, dense and MoE): baseline, mHC
  and mHC + ``mhc_recompute`` step time (forward + backward, synced), the models alive
  together, their steps interleaved one by one (``--rounds`` x 10 steps each): the paired
  steps' differences are mHC's (and the recompute's) host cost per step; their median divided
  by the sublayers, per sublayer, with its interquartile range;
* ``--profile-out``: cProfile of the per-op calls (the top functions by own time);
* ``--breakdown``: the dense model's step as baseline, mHC, and mHC with *null ops* (autograd
  functions that allocate the ops' outputs and gradients and launch nothing): null minus
  baseline is the layer code around the ops (Python, autograd nodes, the mHC parameters'
  gradient accumulation), mHC minus null the ops; per step the minimum and the median over
  alternating rounds (host noise only adds time, so the minimum is the steadier estimate),
  the host time until the step returns (all launched, before the sync) and the process CPU
  time over that span (every thread's: the autograd engine's too; a busy neighbour on the
  host stretches wall time more than CPU time); and the null ops' own host time (Python
  autograd functions and their allocations, 8 sublayers chained through autograd), which
  "null minus baseline" includes, beside the real ops' in the same chain;
* ``--grad-fusion``: the dense model's step inside Megatron's DDP, baseline, mHC, and mHC
  with ``gradient_accumulation_fusion`` (the mapping parameters' gradients added to DDP's
  main grads by pre's backward kernel), alternating rounds;
* ``--replay-ab``: the ops' host work (allocations and launches) replayed from C++
  (:mod:`mhc_megatron.kernels.host_replay`) against the Python path, in this process, the two
  alternating: the four ops, 8 sublayers chained through autograd, and the dense model's
  baseline, mHC and mHC + recompute steps (mHC's growth per sublayer in each mode);
* ``--native-ab``: the ops' C++ autograd nodes
  (:mod:`mhc_megatron.kernels.native_autograd`) against their Python autograd functions, in
  this process, the two alternating, as ``--replay-ab``;
* ``--site-ab``: the nodes' calls replayed from their call sites
  (``native_autograd.CallSite``) against the same nodes reached through the ops' Python path
  (``MHC_CALL_SITES=0``), as ``--replay-ab``;
* ``--module-calls-ab``: a module's pre and combine called from its call site in one call
  into the extension, against the module calling the ops (``MHC_MODULE_CALLS=0``), as
  ``--replay-ab``;
* ``--hooks-ab``: ``mhc_recompute``'s saved-tensor hooks in C++ (the extension's
  ``SavedRanges``) against the same in Python (``MHC_RECOMPUTE_NATIVE_HOOKS=0``), as
  ``--replay-ab``;
* ``--scope-ab``: ``mhc_recompute``'s saved-tensor hooks on only where mHC outputs are saved
  (pre, the module that reads ``y``, the combine) against on over each whole sublayer
  (``MHC_RECOMPUTE_NARROW_HOOKS=0``), as ``--replay-ab``;
* ``--split``: with the replay on, each op call's host time as a whole, its Python alone (its
  allocations and launches skipped: the call returns the tensors a captured call returned) and
  its C++ replay alone (the recorded recipe run with the call's tensors), per op and for
  sublayers chained through autograd;
* ``--recompute-split``: where ``mhc_recompute``'s host time goes: the recompute's dense model
  step timed around the pieces of its manager (forward: saving scopes, records, placeholders;
  backward: the placeholders' unpacks and the block replays), per sublayer, beside its
  paired steps' growth over mHC's without recompute;
* ``--sublayer-split``: where mHC's forward host time goes in the dense model's step: the
  baseline's and mHC's steps interleaved, timed around Megatron's sublayer method, the whole
  sublayer as mHC runs it, pre and the combine, per sublayer;
* ``--recompute-phases``: ``mhc_recompute``'s host time in the forward and in the backward
  apart, over mHC's without recompute, and with its parts switched off in turn (the blocks'
  saved-tensor hooks: no placeholders, no replays; then the records too: the block scopes
  alone), and mHC's own forward and backward over the baseline's, the steps interleaved one
  by one;
* ``--recompute-chain-parts``: the same parts of ``mhc_recompute`` switched off in turn in
  mHC's sublayers as the layers run them, chained around a null body (the chained rows of the
  op table), in alternating rounds: steadier than the model steps, without Megatron's sublayers;
* ``--chain-grad-accumulation``: the same chained sublayers with the mapping parameters'
  gradients dropped after each call against accumulated into ``.grad`` (as the model steps
  here accumulate them), with and without ``mhc_recompute``, in alternating rounds;
* ``--launch-ab``: the ops' launches by signature (``Launcher.signed``: the compiled kernel
  looked up once per op call) against the per-argument key on every launch, in this process:
  the four ops and the dense model's mHC step, the two modes in alternating rounds;
* ``--profile-models OUT``: where a model step's extra host time goes: the dense model's
  baseline and mHC steps under cProfile (Python functions and the torch calls they make, per
  step: mHC minus baseline, by own time and by cumulative time in mhc_megatron's files) and
  under torch's profiler (aten ops and CUDA launches a step, mHC minus baseline);
  ``--profile-recompute``: the same for mHC + ``mhc_recompute``'s steps against mHC's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Callable

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from bench_e2e import RUNS, _sync, build, emit_report, fixed_batch, make_step  # noqa: E402

from mhc_megatron.kernels.triton_combine import _apply_combine, _CombineFn  # noqa: E402
from mhc_megatron.kernels.triton_pre import _apply_pre, _PreFn  # noqa: E402

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
         lambda: _apply_pre(x, phi, alpha, bias, ITERS, EPS, None)),
        ("pre backward", lambda: _PreFn.backward(pre_ctx, dy, None, dh_post, dh_res)),
        ("combine forward (autograd apply)",
         lambda: _apply_combine(x, f, None, h_res, h_post, None)),
        ("combine backward", lambda: _CombineFn.backward(comb_ctx, dout)),
    ]


def capture_replays(fn) -> tuple[dict, list]:
    """Run ``fn()`` with :func:`host_replay.run <mhc_megatron.kernels.host_replay.run>`
    recording every op call: ``(returned, calls)``, the tensors each (plan, key) returned and
    every call's recipe and tensors, in order."""
    from mhc_megatron.kernels import host_replay

    real, returned, calls = host_replay.run, {}, []

    def recording(plan, key, inputs, scratch, python, shared=()):
        out = returned[id(plan), key] = real(plan, key, inputs, scratch, python, shared)
        calls.append((plan.recipes.get(key), tuple(inputs), tuple(scratch)))
        return out

    host_replay.run = recording
    try:
        fn()
    finally:
        host_replay.run = real
    return returned, calls


def _with_replays_skipped(fn, returned):
    """``fn`` as a callable whose op calls skip their allocations and launches: each returns
    the tensors its (plan, key) returned when captured (``returned``), so an op costs only its
    Python (and its autograd function's)."""
    from mhc_megatron.kernels import host_replay

    def stub(plan, key, inputs, scratch, python, shared=()):
        return returned[id(plan), key]

    def run():
        real = host_replay.run
        host_replay.run = stub
        try:
            fn()
        finally:
            host_replay.run = real

    return run


def split_rows(args) -> list[str]:
    """``--split``: where an op call's host time goes, with the replay on: the whole call, its
    Python alone (the allocations and launches skipped, :func:`_with_replays_skipped`) and its
    C++ replay alone (the recorded recipes run with the calls' tensors, every call of the
    case), per op and for ``ENGINE_DEPTH`` sublayers chained through autograd (per sublayer),
    medians of ``--rounds`` alternating rounds; and the host's own speed: an empty Python call
    and one ``torch.empty`` of a mapping's size. The ops run through their Python autograd
    functions (the C++ nodes off: a node's replay is not a Python call to skip)."""
    from mhc_megatron.kernels import native_autograd

    no_replay = _no_replay_rows()
    if no_replay:
        return no_replay
    with switched_off(native_autograd):
        return _split_rows(args)


def _no_replay_rows() -> list[str] | None:
    """The row that says why the ops' host replay (and so their C++ nodes) cannot run here,
    or None where it can."""
    from mhc_megatron.kernels import host_replay

    reason = host_replay.unavailable()
    return None if reason is None else [f"(no replay here: {reason})"]


def _split_rows(args) -> list[str]:
    """:func:`split_rows`' measurement."""
    cases = op_cases(args.tokens, args.hidden)
    cases.append((f"one sublayer through autograd ({ENGINE_DEPTH} chained; per sublayer)",
                  sublayers_through_engine(args.tokens, args.hidden, ENGINE_DEPTH)))
    per_call = {name: (ENGINE_DEPTH if name.startswith("one sublayer") else 1)
                for name, _ in cases}
    rows = {name: {"whole": [], "Python": [], "replay": []} for name, _ in cases}
    iters = max(args.iters // args.rounds, 1)
    with gc_paused():
        split = {}
        for name, fn in cases:  # warm-up (records), then one call captured
            for _ in range(WARMUP):
                fn()
            returned, calls = capture_replays(fn)
            replays = [(r, i, sc) for r, i, sc in calls if r]

            def replay_only(replays=replays):
                for recipe, inputs, scratch in replays:
                    recipe.run(inputs, scratch)

            split[name] = {"whole": fn, "Python": _with_replays_skipped(fn, returned),
                           "replay": replay_only}
        for _ in range(args.rounds):
            for name, _ in cases:
                for key, fn in split[name].items():
                    rows[name][key].append(host_us(fn, iters) / per_call[name])
    lines = ["| host us, replay on | whole call | its Python (replay skipped) | its C++ replay "
             "alone |", "|---|---|---|---|"]
    for name, _ in cases:
        cells = " | ".join(f"{statistics.median(rows[name][k]):.1f}"
                           for k in ("whole", "Python", "replay"))
        lines.append(f"| {name} | {cells} |")

    def nothing():
        pass

    def one_empty():
        torch.empty(args.tokens, N * N, device=DEVICE)

    lines.append(f"| the host: an empty Python call / a torch.empty of [{args.tokens}, "
                 f"{N * N}] fp32 | {host_us(nothing, args.iters):.2f} / "
                 f"{host_us(one_empty, args.iters):.1f} | | |")
    print("\n".join(lines), flush=True)
    return lines


def sublayers_through_engine(tokens: int, hidden: int, depth: int, ops=None):
    """``depth`` sublayers' ops as a model runs them, in one call: pre and combine forward
    through their autograd functions, each sublayer's streams the next one's input (its
    ``f`` is its own ``y``, so no other op sits between them), then one
    ``torch.autograd.backward`` of the last streams (on a GPU autograd's engine runs the
    backward functions on its device thread, as in a model's step). ``depth`` 1 pays one
    backward call's own cost (its graph task, the hand-off to that thread and back) per
    sublayer; a model pays it once a step. The leaves' gradients are dropped after each call,
    so none is accumulated with a kernel. ``ops``: an object with the ops' ``pre`` and
    ``combine`` (the Triton ops by default; :func:`null_ops` for ``--breakdown``)."""
    from mhc_megatron.kernels import triton_mhc

    ops = triton_mhc if ops is None else ops
    dev, bf16 = DEVICE, torch.bfloat16
    m = 2 * N + N * N
    x0 = torch.randn(tokens, N * hidden, device=dev, dtype=bf16, requires_grad=True)
    params = [((0.02 * torch.randn(m, N * hidden, device=dev)).requires_grad_(),
               torch.full((3,), 0.1, device=dev, requires_grad=True),
               torch.zeros(m, device=dev, requires_grad=True)) for _ in range(depth)]
    dout = torch.randn_like(x0)
    leaves = [x0] + [t for trio in params for t in trio]

    def run():
        x = x0
        for phi, alpha, bias in params:
            y, h_pre, h_post, h_res = ops.pre(x, phi, alpha, bias, ITERS, EPS, n=N)
            x = ops.combine(x, y, None, h_res, h_post, n=N)
        torch.autograd.backward(x, dout)
        for leaf in leaves:
            leaf.grad = None

    return run


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
    shape = _dense_shape(args)
    models = {name: build(shape, "local", True, recompute, DEVICE)[0]
              for name, recompute in (("mHC", False), ("mHC + recompute", True))}
    rows = []
    for label, run, count in layer_chain_cases(models, args.tokens):
        for _ in range(WARMUP):
            run()
        rows.append(f"| {label} | {host_us(run, args.iters) / count:.1f} | "
                    f"{launches_and_allocations(run)[0] // count} | |")
    return rows


class _PassThrough(torch.autograd.Function):
    """A Python autograd node that does no work: forward a view of its input, backward the
    gradient as it came, after ``allocations`` ``torch.empty`` calls of the gradient's size
    (a backward's allocations, made on whichever thread autograd's engine runs it)."""

    @staticmethod
    def forward(ctx, x, allocations):
        ctx.allocations = allocations
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        for _ in range(ctx.allocations):
            torch.empty(g.shape, device=g.device, dtype=g.dtype)
        return g, None


def engine_node_rows(nodes: int, iters: int, allocations: int = 4) -> list[str]:
    """Host time a Python autograd node costs in a backward pass: a chain of ``nodes``
    pass-through nodes forward and one ``torch.autograd.backward``, per node, on this device
    (on a GPU autograd's engine runs them on its device thread, taking the GIL per node) and
    on the CPU (the engine runs CPU nodes on the calling thread); the difference is what the
    device thread adds to each of a step's Python nodes (mHC adds two a sublayer). The same
    with ``allocations`` allocations in each backward, beside as many made on this thread:
    what an allocation costs on the engine's thread."""
    rows = []
    for dev in dict.fromkeys((DEVICE, "cpu")):
        x = torch.randn(1024, device=dev, requires_grad=True)
        g = torch.ones(1024, device=dev)
        for allocs in (0, allocations):
            def run(allocs=allocs):
                y = x
                for _ in range(nodes):
                    y = _PassThrough.apply(y, allocs)
                torch.autograd.backward(y, g)
                x.grad = None

            for _ in range(WARMUP):
                run()
            rows.append(f"| a pass-through Python autograd node, forward and backward, "
                        f"{allocs} allocations in its backward ({dev} tensors; {nodes} chained, "
                        f"one backward call; per node) | {host_us(run, iters) / nodes:.1f} | 0 | "
                        f"{allocs} |")

        def allocate():
            for _ in range(nodes * allocations):
                torch.empty(g.shape, device=g.device, dtype=g.dtype)

        rows.append(f"| {allocations} allocations on the calling thread ({dev} tensors; per "
                    f"{allocations}) | {host_us(allocate, iters) / nodes:.1f} | 0 | "
                    f"{allocations} |")
    return rows


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


def model_rows(args) -> list[str]:
    """Baseline, mHC and mHC + recompute models built side by side and timed in ``--rounds``
    rounds of 10 steps each, the models' steps interleaved one by one (:func:`paired_steps`:
    a host that other work shares drifts; interleaving keeps them under the same conditions)."""
    rows = []
    for kind in ("dense", "moe"):
        shape = _dense_shape(args)
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


def _dense_shape(args) -> dict:
    return dict(layers=4, hidden=args.hidden, ffn=2 * args.hidden, heads=8, seq=args.tokens,
                mbs=1, vocab=1024)


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

    shape = _dense_shape(args)
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


class _NullPre(torch.autograd.Function):
    """pre's outputs (``y [..., C]``, ``h_pre``, ``h_post [T, n]``, ``h_res [T, n, n]``,
    uninitialised) and, in backward, its input gradients: allocations only, no kernels."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, n):
        ctx.save_for_backward(x, phi, alpha, bias)
        if n is None:  # tokens [T, n, C] (broadcast streams)
            (T, n, C), y_shape = x.shape, (x.shape[0], x.shape[2])
        else:  # streams [..., n*C]
            C = x.shape[-1] // n
            T, y_shape = x.numel() // (n * C), (*x.shape[:-1], C)
        f32 = dict(device=x.device, dtype=torch.float32)
        return (x.new_empty(y_shape), torch.empty(T, n, **f32), torch.empty(T, n, **f32),
                torch.empty(T, n, n, **f32))

    @staticmethod
    def backward(ctx, dy, dh_pre, dh_post, dh_res):
        x, phi, alpha, bias = ctx.saved_tensors
        return (torch.empty_like(x), torch.empty_like(phi), torch.empty_like(alpha),
                torch.empty_like(bias), None)


class _NullCombine(torch.autograd.Function):
    """combine's output ``[..., n*C]`` and, in backward, its input gradients: allocations
    only, no kernels."""

    @staticmethod
    def forward(ctx, x, f, h_res, h_post):
        ctx.save_for_backward(x, f, h_res, h_post)
        return x.new_empty(x.shape)  # contiguous, also for broadcast streams

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def null_ops():
    """An :class:`~mhc_megatron.kernels.dispatch.MHCOps` whose pre and combine launch no
    kernel (see ``--breakdown``); the paper form's model only (no output head)."""
    from mhc_megatron.kernels.dispatch import MHCOps

    def pre(x, phi, alpha, bias, iterations, eps, n=None, form=None, main_grads=False):
        return _NullPre.apply(x, phi, alpha, bias, n)

    def combine(x, f, f_bias, h_res, h_post, n=None):
        return _NullCombine.apply(x, f, h_res, h_post)

    def aggregate(x, h_pre, n=None):
        return x.new_empty((x.shape[0], x.shape[2]) if n is None
                           else (*x.shape[:-1], x.shape[-1] // n))

    return MHCOps("null", pre, combine, aggregate, output_head=None)


def with_null_ops(model):
    """``model``'s hyper-connections run :func:`null_ops` (this model's modules only): its
    time is mHC's layer code without the ops' kernels and host replays. Returns the ops."""
    from mhc_megatron.layers.hyper_connection import HyperConnectionModule

    ops = null_ops()
    for module in model.modules():
        if isinstance(module, HyperConnectionModule):
            module._ops = lambda streams, ops=ops: ops
    return ops


def breakdown_rows(args) -> list[str]:
    """``--breakdown``: baseline, mHC and mHC with null ops, the dense model, alternating
    rounds; per run the minimum and the median step time, and per sublayer the layer code's
    and the ops' share of mHC's extra time."""
    shape = _dense_shape(args)
    sub = 2 * shape["layers"]
    models = {name: build(shape, "local", mhc, False, DEVICE)[0]
              for name, mhc in (("baseline", False), ("mHC", True), ("mHC, null ops", True))}
    ops = with_null_ops(models["mHC, null ops"])
    steps = {name: make_step(m, shape, "local", DEVICE) for name, m in models.items()}
    lines, lo = _alternating_table(steps, args.rounds, sub, "dense, 4 layers, local specs")
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

    shape = _dense_shape(args)
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

    shape = _dense_shape(args)
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


def recompute_phases_rows(args) -> list[str]:
    """``--recompute-phases``: ``mhc_recompute``'s host time in the dense model's forward and
    backward apart, and what its parts add: the recompute's steps, the same model with the
    blocks' saved-tensor hooks off (its ops still recorded, nothing recomputed: no
    placeholders, no replays) and with the records off too (the layers' block scopes and the
    hooks' switch on the input norm alone), and the recompute with its blocks replayed in
    Python (their C++ replay sites off), each against mHC's steps without recompute, and mHC's
    against the baseline's (Megatron's plain model), all interleaved one by one. Each phase is
    timed between device syncs; per sublayer, the median of the paired differences."""
    shape = _dense_shape(args)
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
    shape = _dense_shape(args)
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
    shape = _dense_shape(args)
    runs = {}
    for name, recompute in (("mHC", False), ("mHC + recompute", True)):
        model = build(shape, "local", True, recompute, DEVICE)[0]
        for accumulate in (False, True):
            label = f"{name}, gradients {'accumulated' if accumulate else 'dropped'}"
            runs[label] = sublayers_as_layers_run_them(model, args.tokens, accumulate)
    return _chain_table(_chain_rounds(runs, args), next(iter(runs.values()))[1], args)


@contextlib.contextmanager
def counting_launch_paths():
    """Counts the ops' launches by the path they take while the context is open: ``{"by
    signature": n, "per-argument key": n, "Triton's launcher": n}`` (a launch hook, the
    interpreter or tracing send launches to Triton's own launcher; a misaligned input to the
    per-argument key)."""
    from mhc_megatron.kernels.launch import Launcher

    counts = {"by signature": 0, "per-argument key": 0, "Triton's launcher": 0}
    signed, launch = Launcher.signed, Launcher._launch

    def counted_launch(self, grid, meta, args_):
        entry = launch(self, grid, meta, args_)
        counts["per-argument key" if entry is not None else "Triton's launcher"] += 1
        return entry

    def counted_signed(self, plan, sig, grid, meta, *args_):
        before = sum(counts.values())
        signed(self, plan, sig, grid, meta, *args_)
        if sum(counts.values()) == before:  # it did not go through _launch
            counts["by signature"] += 1

    Launcher.signed, Launcher._launch = counted_signed, counted_launch
    try:
        yield counts
    finally:
        Launcher.signed, Launcher._launch = signed, launch


def grad_fusion_rows(args) -> list[str]:
    """``--grad-fusion``: the dense model's training step inside Megatron's DDP (fp32 main
    grads), baseline, mHC, and mHC with ``gradient_accumulation_fusion`` for its mapping
    parameters (the pre's backward adds their gradients to the main grads; DDP's hook adds
    nothing for them), alternating rounds. The flag is set on the mHC model's config after it
    is built: Megatron's own linear layers would need Apex for it, and only the mHC modules
    read it at run time."""
    shape = _dense_shape(args)
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
        lines, lo = _alternating_table(steps, args.rounds, sub,
                                       "dense, 4 layers, local specs, Megatron's DDP")
    finally:
        mhc_config.gradient_accumulation_fusion = False
    saved = (lo["mHC"] - lo["mHC, gradient_accumulation_fusion"]) / sub * 1e3
    lines += ["", f"per sublayer (minimum): the fusion saves {saved:.0f} us"]
    print("\n".join(lines), flush=True)
    return lines


def _alternating_table(steps: dict, rounds: int, sub: int, what: str):
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


@contextlib.contextmanager
def switched_off(module):
    """``module``'s path off while open (``host_replay``: the ops' host work in Python;
    ``native_autograd``: the ops' Python autograd functions, no C++ nodes)."""
    was = module.enabled()
    module.set_enabled(False)
    try:
        yield
    finally:
        module.set_enabled(was)


def on_off_rows(args, on: str, off: str, switch) -> list[str]:
    """:func:`ab_rows` of a path ``switch`` turns on and off (``enabled()`` and
    ``set_enabled()``: a module or a namespace of the two), named ``on`` and ``off``; or the
    row that says why the ops' host replay cannot run here."""
    return _no_replay_rows() or ab_rows(
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
    shape = _dense_shape(args)
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


def launch_floor_rows(launches: int, iters: int) -> list[str]:
    """Host time of ``launches`` launches of an empty Triton kernel, through
    :class:`~mhc_megatron.kernels.launch.Launcher` (the ops' path) and through Triton's own
    launcher, median over ``iters`` repetitions."""
    import triton
    import triton.language as tl  # noqa: F401  (the kernel's language)

    from mhc_megatron.kernels.launch import Launcher, Meta

    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(16, device=DEVICE)
    launcher, meta = Launcher(_empty), Meta(num_warps=1)

    def ours():
        for _ in range(launches):
            launcher((1,), meta, x)

    def tritons():
        for _ in range(launches):
            _empty[(1,)](x, num_warps=1)

    rows = []
    for name, fn in (("our launcher", ours), ("Triton's launcher", tritons)):
        for _ in range(WARMUP):
            fn()
        rows.append(f"| {launches} empty kernel launches, {name} | {host_us(fn, iters):.1f} | "
                    f"{launches} | 0 |")
    return rows


# the optional tables: (argument, title, rows), printed in this order
OPTIONAL_SECTIONS = (
    ("breakdown", "Breakdown: mHC's layer code and its ops (null ops: allocations only)",
     breakdown_rows),
    ("launch_ab", "Launches by signature against the per-argument key (alternating rounds)",
     launch_ab_rows),
    ("replay_ab", "The ops' host work replayed from C++ against the Python path (alternating "
     "rounds)", replay_ab_rows),
    ("native_ab", "The ops' C++ autograd nodes against their Python autograd functions "
     "(alternating rounds)", native_ab_rows),
    ("site_ab", "The C++ nodes' calls from their call sites against the ops' Python path "
     "(alternating rounds)", site_ab_rows),
    ("module_calls_ab", "A module's pre and combine in one call into the extension against "
     "the module calling the ops (alternating rounds)", module_calls_ab_rows),
    ("hooks_ab", "mhc_recompute's saved-tensor hooks in C++ against Python (alternating "
     "rounds)", hooks_ab_rows),
    ("scope_ab", "mhc_recompute's saved-tensor hooks where mHC outputs are saved against over "
     "the whole sublayer (alternating rounds)", scope_ab_rows),
    ("split", "Each op call's host time: its Python and its C++ replay (alternating rounds)",
     split_rows),
    ("recompute_split", "Where mhc_recompute's host time goes (the recompute's steps, timed "
     "around its pieces)", recompute_split_rows),
    ("sublayer_split", "Where mHC's forward host time goes (the steps timed around a "
     "sublayer's pieces)", sublayer_split_rows),
    ("recompute_phases", "mhc_recompute's host time in forward and backward, and its parts "
     "(alternating steps)", recompute_phases_rows),
    ("recompute_chain_parts", "mhc_recompute's host time in the sublayers as the layers run "
     "them, and its parts (alternating rounds)", recompute_chain_parts_rows),
    ("chain_grad_accumulation", "The sublayers as the layers run them, the mapping "
     "parameters' gradients dropped or accumulated (alternating rounds)",
     chain_grad_accumulation_rows),
    ("grad_fusion", "Megatron's DDP: the mapping parameters' gradient-accumulation fusion "
     "(alternating rounds)", grad_fusion_rows),
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-models", action="store_true")
    p.add_argument("--profile-out", default=None)
    p.add_argument("--profile-models", default=None, metavar="OUT")
    p.add_argument("--profile-recompute", action="store_true")
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--launch-ab", action="store_true")
    p.add_argument("--grad-fusion", action="store_true")
    p.add_argument("--replay-ab", action="store_true")
    p.add_argument("--native-ab", action="store_true")
    p.add_argument("--site-ab", action="store_true")
    p.add_argument("--module-calls-ab", action="store_true")
    p.add_argument("--hooks-ab", action="store_true")
    p.add_argument("--scope-ab", action="store_true")
    p.add_argument("--split", action="store_true")
    p.add_argument("--recompute-split", action="store_true")
    p.add_argument("--sublayer-split", action="store_true")
    p.add_argument("--recompute-phases", action="store_true")
    p.add_argument("--recompute-chain-parts", action="store_true")
    p.add_argument("--chain-grad-accumulation", action="store_true")
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
    total_us, total_launches = 0.0, 0
    for name, fn in cases:
        for _ in range(WARMUP):
            fn()
        us = host_us(fn, args.iters)
        launches, allocs = launches_and_allocations(fn)
        lines.append(f"| {name} | {us:.1f} | {launches} | {allocs} |")
        print(lines[-1], flush=True)
        total_us, total_launches = total_us + us, total_launches + launches
    lines.append(f"| one sublayer's ops (the rows above) | {total_us:.1f} | {total_launches} | |")
    for depth in (1, ENGINE_DEPTH):
        engine = sublayers_through_engine(args.tokens, args.hidden, depth)
        for _ in range(WARMUP):
            engine()
        lines.append(f"| one sublayer through autograd (pre and combine forward, their "
                     f"backward run by autograd's engine; {depth} chained, one backward call; "
                     f"per sublayer) | {host_us(engine, args.iters) / depth:.1f} | "
                     f"{launches_and_allocations(engine)[0] // depth} | |")
        print(lines[-1], flush=True)
    chain_rows = layer_chain_rows(args)
    lines += chain_rows
    print("\n".join(chain_rows), flush=True)
    node_rows = engine_node_rows(2 * ENGINE_DEPTH, args.iters)
    lines += node_rows
    print("\n".join(node_rows), flush=True)
    if DEVICE == "cuda":  # the floor those launches set (the interpreter launches nothing)
        lines += launch_floor_rows(total_launches, args.iters)
        print("\n".join(lines[-2:]), flush=True)
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
    if args.profile_models:
        profile_models(args, args.profile_models, args.profile_steps, args.profile_recompute)
    for flag, title, rows in OPTIONAL_SECTIONS:
        if getattr(args, flag):
            lines += ["", title, ""] + rows(args)
    if not args.no_models:
        lines += ["", "step (ms): median of the rounds' medians (the rounds' range); per "
                  "sublayer: the median of the paired steps' differences / sublayers, us "
                  "(interquartile range)", "",
                  "| model (4 layers, local specs) | baseline | mHC | mHC + recompute | "
                  "mHC - baseline per sublayer | recompute - mHC per sublayer |",
                  "|---|---|---|---|---|---|"]
        lines += model_rows(args)
    emit_report(lines, args.out)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
