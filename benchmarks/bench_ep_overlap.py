"""Does mHC keep what Megatron's MoE EP-overlap schedule saves? Step time on 2+ GPUs.

    torchrun --nproc-per-node=2 benchmarks/bench_ep_overlap.py [--spec te] [--layers 4]
        [--hidden 2048] [--experts 16] [--topk 4] [--moe-ffn 1024] [--seq 4096]
        [--micro 8] [--steps 10] [--rounds 3] [--out table.md]

A DeepSeek-like MoE GPT (``bench_e2e.build``'s: every layer MoE, top-k routing, a shared
expert; TE's grouped GEMM with ``--spec te``), bf16, expert parallelism over all ranks (alltoall dispatcher), Megatron's
DDP and Adam, ``--micro`` micro-batches a step through Megatron's no-pipelining schedule. Four
runs, all built up front and timed in alternating rounds (``--rounds`` x ``--steps`` steps,
median): baseline and mHC n=4, each plain and with ``overlap_moe_expert_parallel_comm`` (the
combined 1F1B schedule). The table gives each run's step time, what the overlap saves for
each model, and mHC's cost with and without the overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multirank import report_and_finish  # noqa: E402

RUNS = [("baseline", False, False), ("baseline + overlap", False, True),
        ("mHC", True, False), ("mHC + overlap", True, True)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", choices=("te", "local"), default="te")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--moe-ffn", type=int, default=1024)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def build(args, mhc: bool, overlap: bool):
    """(DDP model, optimizer) of one run: ``bench_e2e``'s GPT, every layer MoE, expert
    parallelism over all ranks; the same initial weights for every run."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from bench_e2e import build as build_gpt

    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, mbs=1,
                 vocab=32768, experts=args.experts, topk=args.topk, ffn=args.moe_ffn,
                 shared=args.moe_ffn)
    ddp, cfg = build_gpt(shape, args.spec, mhc, False, "cuda", ddp=True, overrides=dict(
        expert_model_parallel_size=torch.distributed.get_world_size(),
        overlap_moe_expert_parallel_comm=overlap))
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                                 clip_grad=1.0), [ddp])
    return ddp, opt


def make_step(args, ddp, opt):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mhc_testing.schedules import mean_loss_forward_step

    rank = torch.distributed.get_rank()
    g = torch.Generator(device="cuda").manual_seed(rank)
    data = []
    for _ in range(args.micro):
        ids = torch.randint(0, 32768, (1, args.seq), device="cuda", generator=g)
        data.append((ids, torch.arange(args.seq, device="cuda")[None], None, ids))

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(
            forward_step_func=mean_loss_forward_step, data_iterator=iter(data), model=ddp,
            num_microbatches=args.micro, seq_length=args.seq, micro_batch_size=1,
            forward_only=False)
        opt.step()

    return step


def main(argv=None):
    args = parse_args(argv)
    from megatron.core import parallel_state

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl")
    world = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    runs = {}
    for name, mhc, overlap in RUNS:
        ddp, opt = build(args, mhc, overlap)
        runs[name] = make_step(args, ddp, opt)
    times = {name: [] for name in runs}
    for name, step in runs.items():  # warm-up: compile, allocate
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        for name, step in runs.items():
            for _ in range(args.steps):
                torch.distributed.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times[name].append(1e3 * (time.perf_counter() - t0))
    ms = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.seq * args.micro * world
    lines = [f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{args.spec} specs, {args.layers} MoE layers, hidden {args.hidden}, "
             f"{args.experts} experts top-{args.topk} (+1 shared), EP={world}, seq {args.seq}, "
             f"{args.micro} micro-batches a step, bf16; median of {args.rounds} x {args.steps} "
             "steps, alternating rounds", "",
             "| run | step ms | tokens/s | overlap saves | vs baseline, same schedule |",
             "|---|---|---|---|---|"]
    for name, _, overlap in RUNS:
        plain = name.replace(" + overlap", "")
        base = "baseline + overlap" if overlap else "baseline"
        saves = f"{100 * (1 - ms[name] / ms[plain]):.1f}%" if overlap else "-"
        lines.append(f"| {name} | {ms[name]:.1f} | {tokens / ms[name] * 1e3 / 1e3:.1f}k | "
                     f"{saves} | {ms[name] / ms[base]:.3f}x |")
    report_and_finish("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
