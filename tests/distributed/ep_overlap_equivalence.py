"""MoE with EP=2: Megatron's EP-overlap schedule equals training without it.

Run: MHC_DIST_DEVICE=cuda torchrun --nproc-per-node=2 tests/distributed/ep_overlap_equivalence.py

GPUs only (the overlap runs the alltoall dispatcher and CUDA streams; Megatron requires EP > 1
and bf16). Two ranks, EP=2 (each rank its own micro-batches, as data parallelism), a 4-layer
GPT whose layers alternate dense and MoE MLPs (``moe_layer_freq``; the last must be MoE),
Megatron's DDP and Adam in bf16, STEPS optimizer steps of MICRO micro-batches through
Megatron's no-pipelining schedule: once plain, once with ``overlap_moe_expert_parallel_comm``
(its combined 1F1B schedule: the layers run as schedule nodes, micro-batch i+1's forward
interleaved with micro-batch i's backward; mHC MoE layers through
:mod:`mhc_megatron.layers.fine_grained`). Same initial weights, same data. Every
micro-batch's loss and every step's grad norm must agree within bf16 noise: the baseline
(mHC off) runs the same comparison, and its differences are printed beside mHC's. Also with
a multi-token-prediction depth, and with TE with ``delay_wgrad_compute`` (the schedule runs
the weight gradients as a separate pass).
"""

from __future__ import annotations

import harness  # noqa: F401  (first)
import torch

from helpers import SEQ, batch, build_gpt, moe_overrides

STEPS, MICRO, LAYERS = 3, 4, 4
# bf16 noise floor for a relative difference of a loss or a grad norm between two schedules
FLOOR = 5e-3


def _config(overlap: bool, mhc: bool, kind: str):
    extra = dict(moe_overrides(), moe_token_dispatcher_type="alltoall",
                 expert_model_parallel_size=2, moe_layer_freq=[0, 1] * (LAYERS // 2),
                 bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                 overlap_moe_expert_parallel_comm=overlap)
    if kind == "mtp":
        extra["mtp_num_layers"] = 1
    if kind == "delay_wgrad" and overlap:  # the weight gradients as a separate pass (TE)
        extra["delay_wgrad_compute"] = True
    if not mhc:
        extra["enable_hyper_connections"] = False
    return harness.config(num_layers=LAYERS, **extra)


def _train(cfg, weights: dict | None):
    """STEPS steps; (per-micro-batch losses, per-step grad norms, the initial weights)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from mhc_testing.schedules import mean_loss_forward_step

    harness.init_parallel(ep=2)
    model = build_gpt(cfg, harness.DEVICE, te=harness.USE_TE)
    if weights is None:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False), Float16Module(cfg, model))
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                 clip_grad=1.0), [ddp])
    rank = torch.distributed.get_rank()

    losses, norms = [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        data = iter([batch(batch_size=2, seed=1000 * step + 10 * mb + rank,
                           device=harness.DEVICE) for mb in range(MICRO)])
        out = get_forward_backward_func()(
            forward_step_func=mean_loss_forward_step, data_iterator=data, model=ddp,
            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=2, forward_only=False)
        ok, grad_norm, _ = opt.step()
        assert ok, f"step {step}: the optimizer skipped the step"
        losses += [d["loss"].item() for d in out]
        norms.append(float(grad_norm))
    return losses, norms, weights


def _max_rel(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def compare(kind: str, mhc: bool) -> dict:
    """Plain vs overlapped training; returns the largest relative differences."""
    losses, norms, weights = _train(_config(False, mhc, kind), None)
    losses2, norms2, _ = _train(_config(True, mhc, kind), weights)
    return {"loss_rel_diff": _max_rel(losses2, losses),
            "grad_norm_rel_diff": _max_rel(norms2, norms), "losses": losses, "norms": norms}


def check(kind: str) -> None:
    rank = torch.distributed.get_rank()
    base = compare(kind, mhc=False)
    mine = compare(kind, mhc=True)
    for key in ("loss_rel_diff", "grad_norm_rel_diff"):
        assert mine[key] <= max(3 * base[key], FLOOR), (
            f"[ep overlap {kind}] mHC {key} {mine[key]:.2e} vs the baseline's {base[key]:.2e}")
    summary = {k: v for k, v in mine.items() if k.endswith("diff")}
    print(f"PASS rank={rank} ep=2 overlap kind={kind} {harness.describe()} bf16 steps={STEPS} "
          f"micro_batches={MICRO} {harness.format_errors(summary, {k: base[k] for k in summary})} "
          f"losses={[round(x, 5) for x in mine['losses']]} grad_norms="
          f"{[round(x, 5) for x in mine['norms']]}", flush=True)


def main():
    if harness.DEVICE != "cuda":
        raise SystemExit("ep_overlap_equivalence.py needs 2 GPUs (MHC_DIST_DEVICE=cuda)")
    harness.init()
    for kind in ("mix", "mtp") + (("delay_wgrad",) if harness.USE_TE else ()):
        check(kind)


if __name__ == "__main__":
    main()
