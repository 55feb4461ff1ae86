"""The mHC ops' host time outside a model (``bench_host.py``'s op table and its ``--split``,
``--breakdown`` pieces): one call of each op forward and backward, a sublayer's ops chained
through autograd's engine, what a Python autograd node and its allocations cost there, the
floor of as many empty kernel launches, the path each launch takes, each op call's Python
against its C++ replay, and null ops (allocations only, no kernels)."""

from __future__ import annotations

import contextlib
import statistics
from types import SimpleNamespace

import torch

from host_timing import DEVICE, ENGINE_DEPTH, EPS, ITERS, N, WARMUP, gc_paused, host_us
from mhc_megatron.kernels.triton_combine import _apply_combine, _CombineFn
from mhc_megatron.kernels.triton_pre import _apply_pre, _PreFn


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


def no_replay_rows() -> list[str] | None:
    """The row that says why the ops' host replay (and so their C++ nodes) cannot run here,
    or None where it can."""
    from mhc_megatron.kernels import host_replay

    reason = host_replay.unavailable()
    return None if reason is None else [f"(no replay here: {reason})"]


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

    no_replay = no_replay_rows()
    if no_replay:
        return no_replay
    with switched_off(native_autograd):
        return _split_rows(args)


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
