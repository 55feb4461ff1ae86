"""Pipeline parallelism PP=2 (1F1B) and PP=2 x 2 virtual stages (interleaved) equal PP=1:
every micro-batch's loss and every gradient, through Megatron's own schedules.

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 tests/distributed/pp_equivalence.py

The n residual streams [s, b, n*C] cross the stage boundaries; Megatron's P2P buffers are sized
from ``hidden_size`` unless ``variable_seq_lengths=True``, which mHC with PP requires (the
shapes travel ahead of each tensor). Each rank first runs the whole model (PP=1, Megatron's
no-pipelining schedule, MICRO micro-batches), then its stage of the PP=2 model (weights copied
by global layer number) under the pipelined schedule, and compares. Dense and MoE, with a
multi-token-prediction depth on the last stage, with and without mHC recompute (blocks of 3
layers, counted from each pipeline chunk's first layer, so none spans the stage boundary of
this 4-layer model).
"""

from __future__ import annotations

import re

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import SEQ, VOCAB, batch, moe_overrides, sequence_parallel_capable_spec

LAYERS = 4
MICRO = 4
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _config(kind: str, pp: int, vp, recompute: bool):
    # Megatron refuses variable_seq_lengths with the (default) allgather dispatcher, also dense
    extra = dict(moe_overrides() if kind == "moe" else {}, moe_token_dispatcher_type="alltoall")
    if kind in ("mtp", "dsv4"):  # dense with one DeepSeek-V3-style MTP depth (last stage)
        extra["mtp_num_layers"] = 1
    if kind.startswith("dsv4"):  # DeepSeek-V4's conventions: a head per final norm (the
        extra["mhc_variant"] = "deepseek_v4"  # decoder's; "dsv4": the MTP depth's too)
    if recompute:  # blocks of 3 layers: counted per pipeline chunk, never across a boundary
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=3)
    if vp:
        # The interleaved schedule at PP=2 exchanges both directions between the same two
        # ranks: unbatched, with the P2P overlap (megatron.training's default; batched P2P
        # there mismatches the directions, and the config refuses it)
        extra.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    elif harness.DEVICE == "cpu":
        # Batched P2P ends with torch.cuda.synchronize() instead of waiting on its requests,
        # a no-op on CPU ranks: with gloo, wait on each request instead.
        extra["batch_p2p_comm"] = False
    return harness.config(num_layers=LAYERS, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, variable_seq_lengths=pp > 1,
                          pipeline_dtype=torch.float32, **extra)


def _chunks(cfg, vp):
    """This rank's model chunks (one per virtual stage), each with its global layer offset."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mhc_megatron.specs import (
        get_gpt_decoder_block_with_mhc_spec,
        get_gpt_mtp_block_with_mhc_spec,
    )

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=harness.USE_TE,
                                                   vp_stage=vp_stage, pp_rank=pp_rank)
        if not harness.USE_TE:
            spec = sequence_parallel_capable_spec(cfg, spec)
        mtp = get_gpt_mtp_block_with_mhc_spec(cfg, spec, harness.USE_TE, vp_stage=vp_stage,
                                              pp_rank=pp_rank) if cfg.mtp_num_layers else None
        model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope", mtp_block_spec=mtp,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage).to(harness.DEVICE)
        chunks.append((model, get_transformer_layer_offset(cfg, vp_stage=vp_stage, pp_rank=pp_rank)))
    return chunks


def _global(name: str, offset: int) -> str:
    return LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _run(models, cfg, vp, forward_step=None):
    """Megatron's schedule over MICRO micro-batches; the per-micro-batch losses it returns.
    ``forward_step``: the schedule's ``forward_step_func`` (default
    :func:`~mhc_testing.schedules.mean_loss_forward_step`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mhc_testing.schedules import mean_loss_forward_step

    data = [batch(batch_size=2, seed=40 + i, device=harness.DEVICE) for i in range(MICRO)]

    iters = [iter(data) for _ in models] if vp else iter(data)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step or mean_loss_forward_step, data_iterator=iters,
        model=models if vp else models[0],
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    return [d["loss"] for d in losses]


def check(kind: str, vp, recompute: bool) -> None:
    from megatron.core import parallel_state

    harness.init_parallel()
    ref_cfg = _config(kind, 1, None, False)
    (ref, _), = _chunks(ref_cfg, None)
    ref_losses = _run([ref], ref_cfg, None)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}

    harness.init_parallel(pp=2, vp=vp)
    cfg = _config(kind, 2, vp, recompute)
    chunks = _chunks(cfg, vp)
    seen = set()
    for model, offset in chunks:  # mHC recompute blocks count from the chunk's first layer
        assert all(layer.mhc_chunk_offset == offset for layer in model.decoder.layers)
    with torch.no_grad():
        for model, offset in chunks:
            for n, p in model.named_parameters():
                g = _global(n, offset)
                p.copy_(ref_params[g])
                seen.add(g)
    losses = _run([m for m, _ in chunks], cfg, vp)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    # every rank ran the same PP=1 reference: its losses must not depend on the rank
    refs = [None, None]
    torch.distributed.all_gather_object(refs, [x.item() for x in ref_losses])
    if last:
        print(f"LOSSES rank={torch.distributed.get_rank()} pp=2 vp={vp} kind={kind} "
              f"recompute={recompute}: PP=2 {[x.item() for x in losses]} PP=1 by rank {refs}",
              flush=True)
    assert refs[0] == refs[1], f"the PP=1 reference differs between ranks: {refs}"
    # A weight held by both stages (the word embeddings, which MTP on the last stage reads
    # too): each stage has its share of the gradient, and Megatron sums them over the
    # embedding group; here over the pipeline group, in one agreed order.
    mine = {_global(n, off): p for model, off in chunks for n, p in model.named_parameters()}
    both = [None, None]
    torch.distributed.all_gather_object(both, sorted(mine))
    for g in sorted(set(both[0]) & set(both[1])):
        torch.distributed.all_reduce(mine[g].grad, group=parallel_state.get_pipeline_model_parallel_group())
    grads = {_global(n, off): p.grad
             for model, off in chunks for n, p in model.named_parameters()}
    errors = {g: harness.relative_error(grad, ref_grads[g]) for g, grad in grads.items()}
    print(f"GRAD ERRORS rank={torch.distributed.get_rank()} pp=2 vp={vp} kind={kind} "
          f"recompute={recompute} worst: {harness.worst_errors(errors)}", flush=True)
    if last:  # after the gradients' report: a wrong loss with right gradients is a reporting fault
        assert len(losses) == MICRO
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for g, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[g], rtol=2e-4, atol=2e-6,
                                   msg=lambda m, g=g: f"[pp {kind} vp={vp} rc={recompute}] grad of {g}: {m}")
    worst, n_mhc = max(errors.values()), sum("hyper_connection" in g for g in grads)
    counts = [None, None]
    torch.distributed.all_gather_object(counts, len(seen))
    shared = len(set(both[0]) & set(both[1]))
    assert sum(counts) - shared == len(ref_params), (counts, len(ref_params))  # every weight
    rank = torch.distributed.get_rank()
    print(f"PASS rank={rank} pp=2 vp={vp} kind={kind} recompute={recompute} {harness.describe()} "
          f"micro_batches={MICRO} losses_checked={MICRO if last else 0} "
          f"worst_grad_rel_err={worst:.2e} params={sum(len(list(m.parameters())) for m, _ in chunks)} "
          f"mhc_params={n_mhc}", flush=True)


CASES = (("dense", None, False), ("dense", 2, False), ("moe", None, False), ("moe", 2, False),
         ("dense", None, True), ("dense", 2, True), ("moe", None, True), ("mtp", None, False),
         ("mtp", None, True), ("dsv4", None, False), ("dsv4_dense", 2, False))


def main():
    harness.init(cuda_to_cpu=True)
    for kind, vp, recompute in CASES:
        check(kind, vp, recompute)


if __name__ == "__main__":
    main()
