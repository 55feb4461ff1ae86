"""What a whole training step pays for mHC, against the bytes mHC must move.

    python benchmarks/bench_e2e.py [--configs dense moe] [--specs te local] [--steps 10]
        [--runs baseline mhc recompute] [--graphs] [--profile] [--out bench_e2e.md]

One process, side by side, per config and spec family: ``baseline`` (Megatron's own GPT block
spec), ``mHC`` (n=4, Triton kernels) and ``mHC + recompute`` (``mhc_recompute``, eq. 20
blocks); ``--runs`` picks a subset (e.g. ``--runs mhc recompute``). A step is forward +
backward of one micro-batch (bf16 weights and activations, no optimiser: it is the same for
all three); reported: median step time, tokens/s, peak memory allocated during the step,
and mHC's overhead next to its byte floor.

Configs (``--layers`` etc. override):

* ``dense``: 8 layers, hidden 4096, SwiGLU 11008, 32 heads, seq 4096, micro-batch 1;
* ``moe``: DeepSeek-like, 8 layers, hidden 2048, 16 heads, 64 experts top-6 (expert FFN 1408,
  shared expert 2816), alltoall dispatcher, seq 4096, micro-batch 1; experts as TE's grouped
  GEMM with TE specs, as Megatron's SequentialMLP (its only local expert module) otherwise;
* ``moe_wide`` (not in the default set): the same at hidden 4096, 6 layers, 32 heads, 16
  experts top-2 (expert FFN 2816, shared expert 5632): ``moe``'s step is host-bound (its
  dispatcher syncs with the host every layer) and its rounds spread +-12%; this one carries
  ~2.4x the GEMM work a token for the same syncs.

Spec families: ``te`` (Transformer Engine's modules and fused attention: the form users run;
needs TE) and ``local`` (Megatron's local modules, core attention replaced by torch SDPA's
flash attention for every run, so the s^2 scores do not dominate).

Byte floor: per sublayer and token, mHC's kernels must read and write (bf16, x = n*C
streams, y = C, as ``benchmarks/bench_mhc.py`` counts them) ``pre`` x + y, ``combine``
x + y + x, backward 3x + 3y, i.e. 6x + 5y; with ``mhc_recompute`` the forward ops once more
(3x + 2y). Two sublayers a layer; divided by the measured copy bandwidth (read + write) of
this GPU, that is the time mHC cannot go below (its GEMMs for the mappings are negligible at
these widths).

Two-phase floor: the bytes of the passes an mHC sublayer inside Megatron's layer cannot avoid
(``bench_mhc.sublayer_pass_bytes``): pre's mappings need the whole row's projection before
its aggregate (forward reads x twice), and Megatron runs the sublayer's backward between the
combine's backward and pre's, whose per-token reductions come before its dx pass (backward
reads x three times and g twice), i.e. 10x + 6y a sublayer; with ``mhc_recompute`` plus the
fused replay (2x + 2y). At n=4 it is 1.59x the byte floor, so an overhead within 1.25x of the
byte floor is out of reach for any such implementation.

``--profile`` profiles one more step of every run (twice: once for device time, once with
Python stacks for the host side) and adds, per config and spec: device time by kernel category
(mHC Triton kernels, GEMMs, attention, copies and elementwise, other), the step time not
covered by kernels (launch, Python, syncs) and kernel launches, one column per run plus the
differences between consecutive runs; for each such pair the kernels whose device time grows
most, and the host-side events whose self CPU time grows most (aten ops, CUDA runtime calls
such as cudaStreamSynchronize or cudaMalloc, autograd nodes, Python functions such as
``mhc_recompute``'s saved-tensor hooks; traced with Python stacks, so slower than untraced).

``--graphs`` (GPU) adds ``baseline + graphs`` and ``mHC + graphs``: the same models with
Megatron's local per-layer CUDA graphs (``cuda_graph_impl="local"``, captured after the first
step by ``create_cudagraphs()``), which remove the launch and Python work of every layer;
``mHC + graphs`` is compared with ``baseline + graphs`` (their peak memory reads "-": a
graph's activations live in pools allocated at capture, outside the measured step). Every
run then trains through Megatron's DDP (the graphs' backward accumulates into its fp32 main
grads), and the MoE config of every run becomes drop-and-pad (capacity factor 1.0, inputs
padded to capacity: the static shapes Megatron's MoE graphs need), so eager and graphed rows
compare the same model.

``--interleave ROUNDS`` builds every run's model first and times them in alternating rounds
(each step time is the median of the rounds' medians, and the rounds' range is listed): on a
host-bound config (the MoE ones, whose dispatchers sync with the host every layer) the host's
drift between runs otherwise exceeds the differences being measured.

``--isolate`` (implied by ``--graphs``) measures every run in a fresh child process of this
script, so no memory, CUDA graph or Megatron state of one run reaches the next (Megatron-Core
0.19.2 keeps an MoE model in its DDP alive after a forward with grad; in one process the MoE
runs of ``--graphs`` then run out of memory).

Python's automatic garbage collection is off during the timed steps (collected before them),
as in Megatron's training loop with ``--manual-gc``: its pauses land at random in a step, and
more so in the MoE models' host-bound steps; ``--auto-gc`` leaves it on.

``--smoke`` shrinks every config to a few layers of width 64 (CPU or GPU): a check that the
script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch
from bench_mhc import (  # benchmarks/ is on sys.path
    N,
    copy_bandwidth,
    sublayer_bytes,
    sublayer_pass_bytes,
)

sys.path.insert(0, ".")

GIB = 1024**3
CONFIGS = {
    "dense": dict(layers=8, hidden=4096, ffn=11008, heads=32, seq=4096, mbs=1),
    "moe": dict(layers=8, hidden=2048, ffn=1408, heads=16, seq=4096, mbs=1, experts=64, topk=6,
                shared=2816),
    # a wide MoE (hidden 4096, 16 experts top-2): more device work a layer against the same one host
    # sync a layer of the dispatcher, so a 2% difference can stand out of the host's noise
    # 6 layers: --interleave holds its three runs' models (4.4B parameters each, bf16
    # weights and grads: 49 GiB together; 8 layers would take 65) and a step's activations on
    # one 80 GB H100
    "moe_wide": dict(layers=6, hidden=4096, ffn=2816, heads=32, seq=4096, mbs=1, experts=16,
                     topk=2, shared=5632),
}
DEFAULT_CONFIGS = ["dense", "moe"]
SMOKE = dict(layers=2, hidden=64, ffn=128, heads=4, seq=64, mbs=2)
RUNS = [("baseline", False, False), ("mHC", True, False), ("mHC + recompute", True, True)]
RUN_KEYS = {"baseline": "baseline", "mhc": "mHC", "recompute": "mHC + recompute"}
# --graphs: the same models with Megatron's local per-layer CUDA graphs (no mhc_recompute: the
# config refuses it with per-layer graphs)
GRAPH_RUNS = [("baseline + graphs", False, False), ("mHC + graphs", True, False)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=DEFAULT_CONFIGS)
    p.add_argument("--specs", nargs="+", choices=("te", "local"), default=None,
                   help="default: te and local where TE is installed, else local")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--runs", nargs="+", choices=sorted(RUN_KEYS), default=list(RUN_KEYS),
                   help="the runs to measure (default all): baseline, mhc, recompute")
    p.add_argument("--tile", action="append", default=[], metavar="NAME=V,V,...",
                   help="set a field of the kernels' TILES for every run (e.g. dx=64,64,4,3: "
                        "a candidate tile, e.g. from tune_tiles.py, measured in a whole "
                        "step); repeatable")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--graphs", action="store_true",
                   help="add baseline and mHC with Megatron's local per-layer CUDA graphs; "
                        "every run then trains through Megatron's DDP (fp32 main grads)")
    p.add_argument("--isolate", action="store_true",
                   help="measure every run in a fresh child process (on with --graphs): no "
                        "memory, CUDA graph or Megatron state of one run reaches the next")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="build every run's model first, then time them in ROUNDS alternating "
                        "rounds of --steps steps (median of the round medians): a host-bound "
                        "config's drift hits every run alike; not with --graphs / --profile")
    p.add_argument("--auto-gc", action="store_true",
                   help="leave Python's automatic garbage collection on in the timed steps "
                        "(default off, collected before them, as Megatron's --manual-gc)")
    p.add_argument("--child-run", default=None, help=argparse.SUPPRESS)  # internal: one run
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    for key in ("layers", "hidden", "seq", "mbs"):
        p.add_argument(f"--{key}", type=int, default=None)
    args = p.parse_args(argv)
    args.isolate = args.isolate or args.graphs
    if args.interleave and (args.graphs or args.profile or args.isolate):
        p.error("--interleave keeps every run's model in one process: not with --graphs, "
                "--profile or --isolate")
    if args.specs is None:
        import importlib.util

        args.specs = (["te"] if importlib.util.find_spec("transformer_engine") else []) + ["local"]
    return args


def shape_of(name: str, args) -> dict:
    shape = dict(CONFIGS[name])
    if args.smoke:
        shape.update(SMOKE)
        if "experts" in shape:
            shape.update(experts=4, topk=2, shared=128)
    for key in ("layers", "hidden", "seq", "mbs"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


def build(shape: dict, spec: str, mhc: bool, recompute: bool, device, graphs: bool = False,
          ddp: bool = False, overrides: dict | None = None):
    """The GPT of one run: bf16, RMSNorm, RoPE, SwiGLU, no biases; MoE where ``experts``;
    ``overrides``: more config fields (e.g. expert parallelism, the EP-overlap schedule).
    ``graphs``: Megatron's local per-layer CUDA graphs; ``ddp``: inside Megatron's DDP (the
    graphs' backward accumulates into its fp32 main grads, so graphs need it)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
    from mhc_testing.cpu import setup_cpu_megatron

    setup_cpu_megatron(1234)
    if ddp and device == "cuda":  # an RNG tracker CUDA graphs accept, for every run alike
        te = spec == "te"  # TE's attention takes TE's tracker only
        tensor_parallel.model_parallel_cuda_manual_seed(
            1234, te_rng_tracker=te, use_cudagraphable_rng=not te, force_reset_rng=True)
    moe = {}
    if "experts" in shape:
        moe = dict(num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
                   moe_ffn_hidden_size=shape["ffn"],
                   moe_shared_expert_intermediate_size=shape["shared"],
                   moe_grouped_gemm=spec == "te", moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="alltoall" if torch.cuda.is_available()
                   else "allgather", moe_router_dtype="fp32")
        if shape.get("drop_pad"):  # static expert shapes: what MoE under CUDA graphs needs
            moe.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    config = MHCTransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        ffn_hidden_size=shape["ffn"] if not moe else 4 * shape["hidden"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True, enable_hyper_connections=mhc,
        num_residual_streams=N, mhc_recompute=recompute,
        cuda_graph_impl="local" if graphs else "none", **moe, **(overrides or {}))
    te = spec == "te"
    make_spec = get_gpt_decoder_block_with_mhc_spec if mhc else get_gpt_decoder_block_spec
    block = make_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if not te:  # flash attention for every run of the local family
        from mhc_testing.attention import SDPACoreAttention

        for layer_spec in block.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(config, block, vocab_size=shape["vocab"],
                     max_sequence_length=shape["seq"], position_embedding_type="rope").to(device)
    if ddp:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)

        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    return model, config


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fixed_batch(shape: dict, spec: str, device) -> tuple:
    """The steps' micro-batch ``(ids, position ids, attention mask)``, the same every call
    (no mask with SDPA, the local specs' attention: it is causal)."""
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (shape["mbs"], shape["seq"]), device=device,
                        generator=g)
    pos = torch.arange(shape["seq"], device=device).expand(shape["mbs"], shape["seq"])
    mask = None if spec == "local" else torch.triu(
        torch.ones(shape["seq"], shape["seq"], dtype=torch.bool, device=device), 1)[None, None]
    return ids, pos, mask


def make_step(model, shape: dict, spec: str, device, graphs: bool = False):
    """One forward + backward of a fixed micro-batch (:func:`fixed_batch`). In DDP the grad
    buffers are zeroed first; with ``graphs`` the first step records the layers and Megatron's
    ``create_cudagraphs()`` (as its schedules do) captures them after it."""
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    ids, pos, mask = fixed_batch(shape, spec, device)

    def step():
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        model(ids, pos, mask, labels=ids).float().mean().backward()
        if graphs:
            create_cudagraphs()  # a no-op once created

    return step


MANUAL_GC = True  # --auto-gc turns it off


def measure(step, tokens: int, steps: int, warmup: int) -> dict:
    """Median time of ``step`` and the peak memory allocated during one step. Python's
    automatic garbage collection is off during the timed steps (collected before them), as
    in Megatron's training loop with ``--manual-gc``; ``--auto-gc`` leaves it on."""
    for _ in range(warmup):  # Triton compiles; grads allocated
        step()
    _sync()
    peak = 0.0
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        _sync()
        peak = (torch.cuda.max_memory_allocated() - before) / GIB
    times = []
    gc.collect()
    auto_gc = gc.isenabled()
    if MANUAL_GC:  # as Megatron's --manual-gc: no collector pauses inside the timed steps
        gc.disable()
    try:
        for _ in range(steps):
            _sync()
            start = time.perf_counter()
            step()
            _sync()
            times.append(1e3 * (time.perf_counter() - start))
    finally:
        if auto_gc:
            gc.enable()
    ms = statistics.median(times)
    return {"ms": ms, "tokens_s": tokens / ms * 1e3, "peak_gib": peak}


def floor_bytes(shape: dict, recompute: bool) -> float:
    """mHC's bytes per step (see the module docstring), from bench_mhc's per-op counts."""
    ops = sublayer_bytes(shape["mbs"] * shape["seq"], shape["hidden"])
    per_sublayer = sum(ops.values())
    if recompute:  # the forward ops once more
        per_sublayer += ops["pre fwd"] + ops["post fwd"]
    return 2 * shape["layers"] * per_sublayer


def pass_floor_bytes(shape: dict, recompute: bool) -> float:
    """mHC's bytes per step at the two-phase floor (bench_mhc.sublayer_pass_bytes; see the
    module docstring)."""
    passes = sublayer_pass_bytes(shape["mbs"] * shape["seq"], shape["hidden"],
                                 recompute=recompute)
    return 2 * shape["layers"] * sum(passes.values())


CATEGORIES = [("mHC kernels", ("_proj_partial", "_mappings", "_aggregate", "_combine",
                               "_dhpre", "_pre_dx_dphi", "mhc")),
              ("GEMM", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "matmul")),
              ("attention", ("flash", "fmha", "attn", "attention", "sdpa")),
              ("norms (TE's, torch's)", ("rmsnorm", "layernorm", "layer_norm", "rms_norm")),
              ("copies, elementwise", ("copy", "memcpy", "memset", "elementwise", "vectorized",
                                       "reduce", "cat", "index", "fill"))]
NOT_COVERED = "not covered by kernels (launch, Python, syncs)"
TOP = 12  # rows of each growth table
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # "<built-in method ... at 0x7f..>": per process


def _profiled(step, with_stack: bool):
    """Run ``step`` once under the torch profiler (CPU, and CUDA where there is a GPU):
    its wall time (ms) and the profiler's events."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with torch_profile(activities=activities, with_stack=with_stack) as prof:
        start = time.perf_counter()
        step()
        _sync()
        wall = 1e3 * (time.perf_counter() - start)
    return wall, prof.events()  # not key_averages(): it leaves the Python functions out


def _tally(events, device: bool) -> dict[str, list]:
    """``{name: [ms, count]}`` of the device events (kernels, memcpy, memset; their duration)
    or of the host events (their self CPU time)."""
    from torch.autograd import DeviceType

    table: dict[str, list] = {}
    for e in events:
        if (e.device_type != DeviceType.CPU) == device:
            entry = table.setdefault(_ADDRESS.sub("", e.name), [0.0, 0])
            entry[0] += (e.time_range.elapsed_us() if device else e.self_cpu_time_total) / 1e3
            entry[1] += 1
    return table


def profile_device(step) -> dict:
    """One profiled ``step``: its wall time (ms) and, per kernel name, device time (ms) and
    launches (``{"wall": ms, "kernels": {name: [ms, launches]}}``)."""
    wall, events = _profiled(step, with_stack=False)
    return {"wall": wall, "kernels": _tally(events, device=True)}


def profile_host(step) -> dict:
    """One ``step`` traced with Python stacks: its wall time (ms) and, per host-side event
    (aten op, CUDA runtime call, autograd node, Python function), self CPU time (ms) and calls
    (``{"traced wall": ms, "host": {name: [ms, calls]}}``)."""
    wall, events = _profiled(step, with_stack=True)
    return {"traced wall": wall, "host": _tally(events, device=False)}


def categorize(kernels: dict) -> dict[str, float]:
    """Device time (ms) per category of ``CATEGORIES`` (and "other") of a kernel table."""
    totals = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    for name, (ms, _) in kernels.items():
        low = name.lower()
        totals[next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")] += ms
    return totals


def _pairs(runs: list[str]) -> list[tuple[str, str]]:
    """Consecutive runs, in ``RUNS`` order: what each step of the ladder adds."""
    return list(zip(runs, runs[1:]))


def _short(name: str, width: int = 70) -> str:
    """A table cell of ``name``: its head (its tail for a Python function: file and line)."""
    name = name.replace("|", "/")
    if len(name) <= width:
        return name
    return "..." + name[3 - width:] if ".py(" in name else name[:width - 3] + "..."


def category_lines(profiles: dict[str, dict]) -> list[str]:
    """The table of device time per category, uncovered and wall time, launches: one column
    per run, then one per consecutive pair (later minus earlier)."""
    runs, pairs = list(profiles), _pairs(list(profiles))
    rows: dict[str, list[float]] = {}
    for p in profiles.values():
        cats = categorize(p["kernels"])
        busy = sum(cats.values())
        values = {**cats, "kernels, total": busy, NOT_COVERED: p["wall"] - busy,
                  "step wall, profiled": p["wall"],
                  "step wall, traced with Python stacks": p["traced wall"],
                  "kernel launches (count)": sum(n for _, n in p["kernels"].values())}
        for row, value in values.items():
            rows.setdefault(row, []).append(value)
    lines = ["| ms | " + " | ".join(runs + [f"{b} - {a}" for a, b in pairs]) + " |",
             "|---" * (1 + len(runs) + len(pairs)) + "|"]
    for row, vs in rows.items():
        fmt = "{:.0f}" if "count" in row else "{:.2f}"
        deltas = [vs[runs.index(b)] - vs[runs.index(a)] for a, b in pairs]
        lines.append(f"| {row} | " + " | ".join(fmt.format(v) for v in vs + deltas) + " |")
    return lines


def growth_lines(a: str, b: str, table_a: dict, table_b: dict, what: str) -> list[str]:
    """The ``TOP`` entries (kernels or host events: ``{name: [ms, count]}``) whose time grows
    most from run ``a`` to run ``b``, and the totals."""
    zero = [0.0, 0]
    names = set(table_a) | set(table_b)
    delta = {n: table_b.get(n, zero)[0] - table_a.get(n, zero)[0] for n in names}
    lines = [f"| {what} | {a} (ms) | {b} (ms) | {b} - {a} (ms) | count {a} | count {b} |",
             "|---|---|---|---|---|---|"]
    for n in sorted(names, key=lambda n: -delta[n])[:TOP]:
        (ms_a, n_a), (ms_b, n_b) = table_a.get(n, zero), table_b.get(n, zero)
        lines.append(f"| {_short(n)} | {ms_a:.2f} | {ms_b:.2f} | {delta[n]:+.2f} | {n_a} | {n_b} |")
    tot_a, tot_b = (sum(v[0] for v in t.values()) for t in (table_a, table_b))
    cnt_a, cnt_b = (sum(v[1] for v in t.values()) for t in (table_a, table_b))
    lines.append(f"| all | {tot_a:.2f} | {tot_b:.2f} | {tot_b - tot_a:+.2f} | {cnt_a} | {cnt_b} |")
    return lines


def profile_report(cfg_name: str, spec: str, profiles: dict[str, dict]) -> list[str]:
    """All ``--profile`` tables of one config and spec family."""
    lines = ["", f"where the step time goes ({cfg_name}, {spec}), one profiled step per run:", ""]
    lines += category_lines(profiles)
    for a, b in _pairs(list(profiles)):
        pa, pb = profiles[a], profiles[b]
        if pa["kernels"] or pb["kernels"]:
            lines += ["", f"kernels growing most from {a} to {b} ({cfg_name}, {spec}):", ""]
            lines += growth_lines(a, b, pa["kernels"], pb["kernels"], "kernel")
        lines += ["", f"host events growing most from {a} to {b}, self CPU time traced with "
                  f"Python stacks ({cfg_name}, {spec}):", ""]
        lines += growth_lines(a, b, pa["host"], pb["host"], "host event")
    return lines


def measure_run(shape: dict, spec: str, mhc: bool, recompute: bool, device, args,
                graphs: bool = False):
    """Build one run's model, measure its step (and profile it with ``--profile``), free it
    (and its CUDA graphs). Returns ``measure``'s dict and the profile (``None`` without
    ``--profile``)."""
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    model, _ = build(shape, spec, mhc, recompute, device, graphs=graphs, ddp=args.graphs)
    step = make_step(model, shape, spec, device, graphs=graphs)
    r = measure(step, shape["mbs"] * shape["seq"], args.steps, args.warmup)
    prof = {**profile_device(step), **profile_host(step)} if args.profile else None
    del model, step
    if graphs:
        delete_cuda_graphs()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return r, prof


def result_row(cfg_name: str, spec: str, run: tuple, r: dict, ms: dict, shape: dict,
               bw: float) -> str:
    """One row of the results table; ``ms``: step times so far by run name (a comparison
    whose reference run was not selected reads "-")."""
    name, mhc, recompute = run
    graphs = name.endswith("+ graphs")  # compared with the graphed baseline
    base_ms, mhc_ms = ms.get("baseline + graphs" if graphs else "baseline"), ms.get("mHC")
    rel = f"{r['ms'] / base_ms:.3f}x" if base_ms else "-"
    rel_mhc = f"{r['ms'] / mhc_ms:.3f}x" if recompute and mhc_ms else "-"
    floors = ["-"] * 4  # byte floor and overhead over it; the same for the two-phase floor
    if mhc:
        for k, nbytes in enumerate((floor_bytes(shape, recompute),
                                    pass_floor_bytes(shape, recompute))):
            floor_ms = nbytes / (bw * 1e9) * 1e3
            floors[2 * k] = f"{floor_ms:.1f}"
            if math.isfinite(floor_ms) and floor_ms > 0 and base_ms:
                floors[2 * k + 1] = f"{(r['ms'] - base_ms) / floor_ms:.2f}"
    peak = "-" if graphs else f"{r['peak_gib']:.2f}"
    return (f"| {cfg_name} | {spec} | {name} | {r['ms']:.1f} | {r['tokens_s']:,.0f} | "
            f"{peak} | {rel} | {rel_mhc} | {' | '.join(floors)} |")


CHILD_RESULT = "CHILD_RESULT "


def emit_report(lines: list, out: str | None) -> None:
    """Print the report's lines and write them to ``out`` (if given)."""
    text = "\n".join(lines)
    print("\n" + text)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")


def interleaved_runs(shape: dict, spec: str, runs: list, device, args) -> dict:
    """``--interleave``: every run's model built, then ``args.interleave`` rounds in which each
    run in turn is timed (``measure``: median of ``args.steps``). Returns per run ``measure``'s
    dict with ``ms`` the median of the round medians and ``spread`` their (min, max)."""
    models = {run: build(shape, spec, mhc, recompute, device)[0]
              for run, mhc, recompute, _ in runs}
    steps = {run: make_step(model, shape, spec, device) for run, model in models.items()}
    rounds: dict[str, list] = {run: [] for run in steps}
    for k in range(args.interleave):
        for run, step in steps.items():
            rounds[run].append(measure(step, shape["mbs"] * shape["seq"], args.steps,
                                       args.warmup if k == 0 else 1))
    out = {}
    for run, rs in rounds.items():
        ms = statistics.median(r["ms"] for r in rs)
        out[run] = {"ms": ms, "tokens_s": shape["mbs"] * shape["seq"] / ms * 1e3,
                    "peak_gib": rs[0]["peak_gib"],
                    "spread": (min(r["ms"] for r in rs), max(r["ms"] for r in rs))}
    del models, steps
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def isolated_run(argv: list, cfg_name: str, spec: str, run: str):
    """``measure_run`` of one run in a fresh child process (this script with ``--child-run``):
    Megatron-Core 0.19.2 keeps an MoE model inside its DDP alive after a forward with grad
    (through its autograd graph: no Python referrer frees it), so in one process every
    such run's weights and grad buffers stay on the GPU and the next run runs out of memory.
    Returns ``measure_run``'s result and profile."""
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # (its group: its own store)
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--child-run", json.dumps([cfg_name, spec, run])],
        env=env, stdout=subprocess.PIPE, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith(CHILD_RESULT)]
    if proc.returncode or not line:
        sys.stdout.write(proc.stdout[-3000:])
        raise RuntimeError(f"run {run!r} ({cfg_name}, {spec}) failed in its child process "
                           f"(exit {proc.returncode}); its output is above")
    r, prof = json.loads(line[-1][len(CHILD_RESULT):])
    return r, prof


def set_tiles(settings: list[str]) -> str:
    """Apply ``--tile NAME=V,V,...`` to the kernels' ``TILES``; returns them as the report's
    words ("" for none)."""
    if not settings:
        return ""
    from mhc_megatron.kernels.triton_common import TILES

    for setting in settings:
        name, _, values = setting.partition("=")
        if not hasattr(TILES, name) or not values:
            raise SystemExit(f"--tile {setting}: expected NAME=V,V,... with NAME a field of "
                             "mhc_megatron.kernels.triton_common.KernelTiles")
        setattr(TILES, name, tuple(int(v) for v in values.split(",")))
    return "; TILES " + ", ".join(settings)


def run_table(args) -> list:
    """(name, mhc, recompute, graphs) of the selected runs."""
    runs = [(*r, False) for r in RUNS if r[0] in {RUN_KEYS[k] for k in args.runs}]
    if args.graphs and torch.cuda.is_available():
        runs += [(*r, True) for r in GRAPH_RUNS]
    return runs


def config_shape(cfg_name: str, args) -> dict:
    return {**shape_of(cfg_name, args), "vocab": args.vocab if not args.smoke else 256,
            "drop_pad": args.graphs}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    global MANUAL_GC
    MANUAL_GC = not args.auto_gc
    tiles = set_tiles(args.tile)
    from megatron.core import parallel_state

    from mhc_testing.cpu import init_single_process_group

    device = "cuda" if torch.cuda.is_available() else "cpu"
    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.child_run:  # one run, its result as a JSON line for the parent
        cfg_name, spec, run = json.loads(args.child_run)
        _, mhc, recompute, graphs = next(r for r in run_table(args) if r[0] == run)
        result = measure_run(config_shape(cfg_name, args), spec, mhc, recompute, device, args,
                             graphs)
        print(CHILD_RESULT + json.dumps(result), flush=True)
        parallel_state.destroy_model_parallel()
        return
    bw = copy_bandwidth() if device == "cuda" else float("nan")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke only)"
    lines = [f"{name}; torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s (read+write); "
             f"n={N}, bf16, forward+backward of one micro-batch, median of {args.steps}"
             + ("; automatic GC on" if args.auto_gc else "; GC off in timed steps")
             + tiles
             + ("; --graphs: every run in Megatron's DDP, MoE drop-and-pad" if args.graphs
                else ""), "",
             "| config | spec | run | step (ms) | tokens/s | peak alloc (GiB) | vs baseline "
             "| vs mHC | mHC byte floor (ms) | overhead / floor | two-phase floor (ms) "
             "| overhead / two-phase floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    profiles = {}
    notes: list[str] = []  # --interleave: the spread of each run's round medians
    for cfg_name in args.configs:
        shape = config_shape(cfg_name, args)
        for spec in args.specs:
            ms: dict[str, float] = {}
            together = (interleaved_runs(shape, spec, run_table(args), device, args)
                        if args.interleave else {})
            for run, mhc, recompute, graphs in run_table(args):
                if together:
                    r, prof = together[run], None
                    notes.append(f"{cfg_name}, {spec}, {run}: round medians "
                                 f"{r['spread'][0]:.1f}-{r['spread'][1]:.1f} ms")
                elif args.isolate:
                    r, prof = isolated_run(argv, cfg_name, spec, run)
                else:
                    r, prof = measure_run(shape, spec, mhc, recompute, device, args, graphs)
                ms[run] = r["ms"]
                if prof is not None:
                    profiles.setdefault((cfg_name, spec), {})[run] = prof
                lines.append(result_row(cfg_name, spec, (run, mhc, recompute), r, ms, shape, bw))
                print(lines[-1], flush=True)
    if notes:
        lines += ["", f"--interleave {args.interleave}: each step time above is the median of "
                  f"{args.interleave} alternating rounds' medians; the rounds ranged:", ""]
        lines += [f"* {n}" for n in notes]
    for (cfg_name, spec), by_run in profiles.items():
        lines += profile_report(cfg_name, spec, by_run)
    emit_report(lines, args.out)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
