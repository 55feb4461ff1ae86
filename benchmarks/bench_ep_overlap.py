"""Does mHC keep what Megatron's MoE EP-overlap schedule saves? Step time on 2+ GPUs.

    torchrun --nproc-per-node=2 benchmarks/bench_ep_overlap.py [--spec te] [--layers 4]
        [--hidden 2048] [--experts 16] [--topk 4] [--moe-ffn 1024] [--seq 4096]
        [--micro 8] [--steps 10] [--rounds 3] [--out table.md]

A DeepSeek-like MoE GPT (every layer MoE, top-k routing, a shared expert; TE's grouped GEMM
with ``--spec te``), bf16, expert parallelism over all ranks (alltoall dispatcher), Megatron's
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
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _config(args, mhc: bool, overlap: bool):
    from mhc_megatron.config import MHCTransformerConfig

    world = torch.distributed.get_world_size()
    return MHCTransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_ffn_hidden_size=args.moe_ffn,
        moe_shared_expert_intermediate_size=args.moe_ffn, moe_grouped_gemm=args.spec == "te",
        moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_aux_loss_coeff=1e-3,
        expert_model_parallel_size=world, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, enable_hyper_connections=mhc,
        num_residual_streams=args.streams, overlap_moe_expert_parallel_comm=overlap)


def build(args, mhc: bool, overlap: bool):
    """(DDP model, optimizer, config) of one run; the same initial weights for every run."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = _config(args, mhc, overlap)
    spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=args.spec == "te",
                                               normalization="RMSNorm")
    if args.spec == "local":
        from mhc_testing.attention import SDPACoreAttention

        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(cfg, spec, vocab_size=32768, max_sequence_length=args.seq,
                     position_embedding_type="rope").cuda()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False), Float16Module(cfg, model))
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                                 clip_grad=1.0), [ddp])
    return ddp, opt, cfg


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
        ddp, opt, _ = build(args, mhc, overlap)
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
