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
import cProfile
import io
import pstats
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from bench_e2e import _sync, emit_report  # noqa: E402
from host_ab import (hooks_ab_rows, launch_ab_rows, module_calls_ab_rows,  # noqa: E402
                     native_ab_rows, replay_ab_rows, scope_ab_rows, site_ab_rows)
from host_chain import (chain_grad_accumulation_rows, layer_chain_rows,  # noqa: E402
                        recompute_chain_parts_rows)
from host_models import (breakdown_rows, grad_fusion_rows, model_rows,  # noqa: E402
                         profile_models, recompute_phases_rows, recompute_split_rows,
                         sublayer_split_rows)
from host_ops import (engine_node_rows, launch_floor_rows, op_cases,  # noqa: E402
                      split_rows, sublayers_through_engine)
from host_timing import (DEVICE, ENGINE_DEPTH, N, WARMUP, host_us,  # noqa: E402
                         launches_and_allocations)


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
