"""TP=2 x PP=2 on 4 ranks equals 1 rank: every micro-batch's loss and every gradient.

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=4 tests/distributed/parallel3d_equivalence.py

Each rank first runs the whole model (TP=1, PP=1, Megatron's no-pipelining schedule, MICRO
micro-batches), then its (tensor shard, pipeline stage) of the TP=2 x PP=2 model, weights
copied by global layer number and split along each parameter's ``partition_dim``, under
Megatron's 1F1B schedule; the n residual streams cross the stage boundary as
``[s/TP, b, n*C]`` with sequence parallelism. Megatron's own finalize step reduces the
sequence-parallel (replicated) gradients over TP, as in training. Dense and MoE (sequence
parallel, which Megatron requires for MoE with TP), with and without mHC recompute (blocks
of 3 layers counted from each stage's first layer). The pieces are those of the PP=2 and
TP=2 scripts next to this one.
"""

from __future__ import annotations

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch
from pp_equivalence import LAYERS, MICRO, _chunks, _global, _run
from tp_equivalence import _shard

from helpers import moe_overrides

TP = PP = 2


def _config(kind: str, tp: int, pp: int, sp: bool, recompute: bool):
    # variable_seq_lengths (the stage boundaries carry [s, b, n*C]) needs the alltoall
    # dispatcher in Megatron 0.19, also for dense configs
    extra = dict(moe_overrides() if kind == "moe" else {}, moe_token_dispatcher_type="alltoall")
    if recompute:
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=3)
    if harness.DEVICE == "cpu":
        extra["batch_p2p_comm"] = False  # gloo: wait on each P2P request (see pp_equivalence)
    return harness.config(num_layers=LAYERS, tensor_model_parallel_size=tp,
                          sequence_parallel=sp, pipeline_model_parallel_size=pp,
                          variable_seq_lengths=pp > 1, pipeline_dtype=torch.float32, **extra)


def check(kind: str, sp: bool, recompute: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    harness.init_parallel()
    ref_cfg = _config(kind, 1, 1, False, False)
    (ref, _), = _chunks(ref_cfg, None)
    ref_losses = _run([ref], ref_cfg, None)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}

    harness.init_parallel(tp=TP, pp=PP)
    cfg = _config(kind, TP, PP, sp, recompute)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    (model, offset), = _chunks(cfg, None)
    assert all(layer.mhc_chunk_offset == offset for layer in model.decoder.layers)
    mine = {_global(n, offset): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for g, p in mine.items():
            p.copy_(_shard(ref_params[g], p, tp_rank, TP))
    losses = _run([model], cfg, None)
    model.ddp_config = DistributedDataParallelConfig()  # what finalize_model_grads reads
    _allreduce_non_tensor_model_parallel_grads([model], cfg)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if last:
        assert len(losses) == MICRO
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a weight both stages hold (the word embeddings): Megatron sums the stages' shares over
    # its embedding group; here over this rank's pipeline group, in one agreed order
    held = [None] * PP
    torch.distributed.all_gather_object(held, sorted(mine), group=pp_group)
    shared = set(held[0]) & set(held[1])
    for g in sorted(shared):
        torch.distributed.all_reduce(mine[g].grad, group=pp_group)
    worst, n_mhc = 0.0, 0
    for g, p in mine.items():
        expect = _shard(ref_grads[g], p, tp_rank, TP)
        torch.testing.assert_close(p.grad, expect, rtol=2e-4, atol=2e-6,
                                   msg=lambda m, g=g: f"[tp2 x pp2 {kind} sp={sp} "
                                                      f"rc={recompute}] grad of {g}: {m}")
        worst = max(worst, harness.relative_error(p.grad, expect))
        n_mhc += "hyper_connection" in g
    assert len(set(held[0]) | set(held[1])) == len(ref_params)  # every weight, on some stage
    print(f"PASS rank={torch.distributed.get_rank()} tp=2 pp=2 kind={kind} sp={sp} "
          f"recompute={recompute} {harness.describe()} micro_batches={MICRO} "
          f"losses_checked={MICRO if last else 0} worst_grad_rel_err={worst:.2e} "
          f"params={len(mine)} mhc_params={n_mhc}", flush=True)


CASES = (("dense", False, False), ("dense", True, False), ("dense", True, True),
         ("moe", True, False), ("moe", True, True))


def main():
    harness.init(world_size=TP * PP, cuda_to_cpu=True)
    for kind, sp, recompute in CASES:
        check(kind, sp, recompute)


if __name__ == "__main__":
    main()
