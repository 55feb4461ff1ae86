"""Child process of tests/test_cuda_graphs.py: eager vs Megatron's local per-layer CUDA graphs.

One process, one case (the CUDA-graph machinery is process-global: a record of runners, a
graph memory pool, a side stream). It builds the same GPT twice, eager and with
``cuda_graph_impl="local"``, from the same initial weights; trains both for ``--steps`` SGD
steps on the same micro-batches (the graphs are recorded in step 1, created by Megatron's
``create_cudagraphs()`` after it, and replayed from step 2 on) and prints one JSON line: the
per-step losses of both, and per step the largest gradient difference over every parameter
(mHC mappings included), the parameters whose gradients differ at all, and how many layer
graphs replayed.

    python tests/gpu_child/cuda_graph_equivalence.py --mhc 1 --kind dense --steps 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mhc", type=int, default=1)
    p.add_argument("--kind", choices=("dense", "moe"), default="dense")
    p.add_argument("--model", choices=("gpt", "hybrid"), default="gpt",
                   help="hybrid: the HybridModel of the same layers (pattern '*-' or '*E' a "
                        "GPT layer, so twice as many graphed layers)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--grad-fusion", action="store_true",
                   help="the graphed model's mHC modules with gradient_accumulation_fusion (set "
                        "after the build: Megatron's own linear layers would need Apex for it); "
                        "the eager model without")
    p.add_argument("--keep-graph-buffers", action="store_true",
                   help="with TE installed: keep Megatron's graph input/output buffers owned "
                        "(no TE weak references). A diagnostic: Megatron keeps only buffers "
                        "saved through Python save_for_backward, not those saved by torch's "
                        "own ops (e.g. a norm's input)")
    return p.parse_args()


def config(args, graphs: bool):
    from helpers import tiny_config

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    moe = {}
    if args.kind == "moe":  # drop-and-pad: no host syncs in the token dispatch
        moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                   moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
                   moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                   add_bias_linear=False)
    return tiny_config(num_layers=args.layers, hidden_size=64, ffn_hidden_size=128,
                       enable_hyper_connections=bool(args.mhc), mhc_kernel_backend="auto",
                       params_dtype=dtype, bf16=dtype == torch.bfloat16,
                       use_cpu_initialization=False,
                       cuda_graph_impl="local" if graphs else "none", **moe)


def build(cfg, model_kind: str = "gpt"):
    """The GPT on the GPU as Megatron's training wraps it: Float16Module (in bf16: every weight,
    norms included, in bf16; fp32 logits) inside Megatron's DDP, whose fp32 ``main_grad``
    buffers the graphs' backward accumulates into."""
    from helpers import build_gpt
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if model_kind == "hybrid":
        from hybrid_models import build_hybrid_model, hybrid_config
        from mhc_megatron.checkpoint import gpt_hybrid_layer_pattern

        model = build_hybrid_model(hybrid_config(cfg), "cuda", gpt_hybrid_layer_pattern(cfg))
        cfg = model.config
    else:
        model = build_gpt(cfg, "cuda")
    if cfg.bf16:
        model = Float16Module(cfg, model)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    return DistributedDataParallel(cfg, ddp, model)


def train(model, batches, lr, graphs: bool):
    """SGD on the fp32 main grads; per step the loss and every parameter's main grad."""
    from helpers import lm_loss
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    losses, grads = [], []
    for step, data in enumerate(batches):
        model.zero_grad_buffer()
        loss = lm_loss(model, data)
        loss.backward()
        model.finish_grad_sync()
        if graphs and step == 0:
            create_cudagraphs()  # what Megatron's schedules call after each step
        torch.cuda.synchronize()
        losses.append(loss.item())
        grads.append({n: p.main_grad.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.main_grad.to(p.dtype))
    return losses, grads


def replays(model) -> int:
    """Layers whose local graph manager holds created (replayable) forward graphs."""
    return sum(1 for m in model.modules() if hasattr(m, "cudagraph_manager")
               and any(r.fwd_graph is not None for r in m.cudagraph_manager.cudagraph_runners))


def inner(model):
    """The GPTModel inside DDP (and Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def main():
    args = parse_args()
    from helpers import batch
    from megatron.core import parallel_state, tensor_parallel

    from mhc_testing.cpu import init_single_process_group

    if args.keep_graph_buffers:
        from megatron.core.transformer import cuda_graphs

        cuda_graphs.make_weakref = lambda ten, inplace=True: ten
    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)
    torch.manual_seed(1234)
    eager = build(config(args, graphs=False), args.model)
    start = {k: v.clone() for k, v in inner(eager).state_dict().items() if torch.is_tensor(v)}
    graphed = build(config(args, graphs=True), args.model)
    result = inner(graphed).load_state_dict(start, strict=False)
    assert not result.unexpected_keys and all("_extra_state" in k for k in result.missing_keys)
    inner(graphed).config.gradient_accumulation_fusion = args.grad_fusion
    fused = []  # per pre backward of the graphed model: whether it took the fusion
    if args.grad_fusion:
        from mhc_megatron.kernels import triton_pre

        main_grads = triton_pre._main_grads

        def recorded(*a):
            found = main_grads(*a)
            fused.append(found is not None)
            return found

        triton_pre._main_grads = recorded
    batches = [batch(device="cuda", seed=s) for s in range(args.steps)]

    loss_e, grads_e = train(eager, batches, 0.05, graphs=False)
    fused.clear()
    loss_g, grads_g = train(graphed, batches, 0.05, graphs=True)
    per_step = []
    for ge, gg in zip(grads_e, grads_g):
        assert ge.keys() == gg.keys(), set(ge) ^ set(gg)
        diffs = {n: (ge[n].float() - gg[n].float()).abs().max().item() for n in ge}
        per_step.append({"max_abs_diff": max(diffs.values()),
                         "differing": sorted(n for n, d in diffs.items() if d > 0),
                         "params": len(diffs),
                         "mhc_params": sum("hyper_connection" in n for n in diffs)})
    print("RESULT " + json.dumps({"loss_eager": loss_e, "loss_graph": loss_g,
                                  "grads": per_step, "graphed_layers": replays(graphed),
                                  "fused_backwards": sum(fused),
                                  "layers": len(inner(graphed).decoder.layers)}), flush=True)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
