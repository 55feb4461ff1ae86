"""Megatron-Core's ``HybridModel`` with mHC (``get_hybrid_stack_with_mhc_spec``) under tensor,
expert and pipeline parallelism equals the single-rank hybrid model, and its distributed
checkpoints (its own and a GPT mHC model's) load across parallel layouts.

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 \
         tests/distributed/hybrid_equivalence.py SECTION[,SECTION...] [DIR]
(``harness.py``: CPU ranks over gloo, or GPUs over NCCL with the Triton kernels and TE specs
where TE is installed; with TE specs the MoE experts are TE's grouped GEMM, the only experts
Megatron's TE ``hybrid_stack_spec`` builds.) Sections, each printing PASS lines:

- ``tp``: TP=2 == TP=1, loss and every gradient (Megatron's finalize step sums the replicated
  sequence-parallel grads): dense ``*-*-`` without and with sequence parallelism, MoE ``*E*E``
  with it (Megatron requires SP for MoE under TP), both with cross-layer mHC recompute and with
  Megatron's full recompute (the layers' forward runs again in backward). Local specs take
  norms that accept ``sequence_parallel`` (Megatron's torch norm refuses it; its SP-capable
  norms need apex or TE), on the TP=1 reference too, so the parameters match.
- ``ep``: MoE ``*E*E`` with EP=2 == EP=1, one micro-batch a rank: per-rank loss, each local
  expert's grad equals its global expert's grad summed over both ranks' batches, dense grads
  summed over the ranks (what data parallelism's all-reduce forms). Allgather dispatcher; also
  alltoall on GPUs (gloo has no all-to-all). Without and with mHC recompute.
- ``pp``: PP=2 with the pattern split by ``|`` == PP=1 (the same pattern without ``|``)
  through Megatron's schedules (1F1B; interleaved with 2 virtual stages), 4 micro-batches:
  every micro-batch loss on the last stage and every gradient. The stage boundaries carry the
  streams ``[s, b, n*C]`` (``variable_seq_lengths=True``). Dense ``*-|*-`` and MoE ``*E|*E``,
  each also as 4 segments over 2 virtual stages (``*-|*-|*-|*-``), an MTP depth on the last
  stage ``*-|*-/*-``; with mHC recompute in blocks of 3 layers, counted from each pipeline chunk's
  first layer (so none spans the 2-layer chunks). Weights are copied by global layer number
  (``layer_number - 1``; the modules' ``decoder.layers.{i}`` are local to the chunk).
- ``ckpt DIR``: the hybrid model's own distributed checkpoint (``model.sharded_state_dict()``)
  saved at one layout loads at the next: TP=2 -> TP=1 (DP=2) -> PP=2 for ``*-*-`` (PP=2 as
  ``*-|*-``), TP=2 (SP) -> TP=1 for ``*E*E``. Each load goes into a model built with a fresh
  seed; every parameter must equal the saved one bit for bit (TP shards gathered) and the
  full-vocabulary logits the saving model's.
- ``gpt DIR``: a GPT mHC model's distributed checkpoint (``GPTModel`` with
  ``get_gpt_decoder_block_with_mhc_spec``) saved at TP=2 loads with
  ``load_gpt_checkpoint_into_hybrid`` into the hybrid model of ``gpt_hybrid_layer_pattern``
  at TP=1 (DP=2) and at PP=2 (the pattern split by ``|``): every hybrid parameter equals its
  GPT parameter (``gpt_to_hybrid_key``) bit for bit and the logits equal the GPT model's.
  GPT layouts: dense (layers stacked on one layer axis in the checkpoint), dense with an MTP
  depth, dense saved with ``non_homogeneous_layers`` metadata (one key a layer) and MoE with
  ``moe_layer_freq=2`` (``*E*-``, one key a layer by Megatron's rule; the hybrid config has no
  ``moe_layer_freq``: its pattern places the MoE layers).

Every reference gradient is checked nonzero, and mHC recompute checked to have recomputed.
Dense models in ``ckpt`` and ``gpt`` are the product's local specs unchanged (no SP there);
MoE ones take the SP-capable norms (SP at TP=2), on both sides of a load.
"""

from __future__ import annotations

import os
import re
import sys

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import SEQ, VOCAB, batch, lm_loss, moe_overrides

MICRO = 4
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EXPERTS = 4
LOCAL_EXPERT = re.compile(r"(local_experts\.)(\d+)(\.)|(weight|bias)(\d+)$")


# ------------------------------------------------------------------------------- building
def _moe() -> dict:
    """The tests' MoE settings; grouped GEMM with TE specs (Megatron's TE ``hybrid_stack_spec``
    always builds TE's grouped-GEMM experts, and a GPT model converted to it must too)."""
    return dict(moe_overrides(), moe_grouped_gemm=harness.USE_TE)


def _nonzero(grads: dict, what: str) -> None:
    """Every reference gradient is nonzero (no comparison of two zeros passes vacuously)."""
    zero = [n for n, g in grads.items() if not g.abs().max() > 0]
    assert not zero, f"[{what}] reference gradients are zero: {zero}"


def _sequence_parallel_norms(spec):
    """The local-modules hybrid stack ``spec`` with norms that accept ``sequence_parallel``
    on CPU (``SequenceParallelTorchNorm``), as ``helpers.sequence_parallel_capable_spec``
    does for the GPT block: every layer's norm, the final norm and the MTP layers' norms."""
    from megatron.core.transformer.identity_op import IdentityOp

    from mhc_megatron.layers import StreamContractingNorm
    from mhc_testing.cpu import SequenceParallelTorchNorm as norm

    sub = spec.submodules
    for field in ("attention_layer", "mlp_layer", "moe_layer"):
        layer = getattr(sub, field)
        if hasattr(layer, "submodules"):
            for name in ("input_layernorm", "pre_mlp_layernorm"):
                if getattr(layer.submodules, name) is not IdentityOp:
                    setattr(layer.submodules, name, norm)
    sub.final_norm = norm
    if sub.mtp_block_spec is not None:
        for layer_spec in sub.mtp_block_spec.submodules.layer_specs:
            mtp = layer_spec.submodules
            mtp.enorm = mtp.hnorm = norm
            mtp.layer_norm = StreamContractingNorm.wrapping(norm)
    return spec


def _hybrid_spec(cfg, sp_norms: bool = True):
    from mhc_megatron.specs import get_hybrid_stack_with_mhc_spec

    spec = get_hybrid_stack_with_mhc_spec(cfg, use_transformer_engine=harness.USE_TE)
    return _sequence_parallel_norms(spec) if sp_norms and not harness.USE_TE else spec


def _hybrid(cfg, pattern: str, vp_stage=None, sp_norms: bool = True):
    """This rank's chunk of the hybrid mHC model of ``pattern`` (its pipeline segment
    ``vp_stage * pp + pp_rank``)."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    return HybridModel(
        cfg, _hybrid_spec(cfg, sp_norms), vocab_size=VOCAB, max_sequence_length=SEQ,
        hybrid_layer_pattern=pattern, position_embedding_type="rope",
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage).to(harness.DEVICE)


def _chunks(cfg, pattern: str, vp):
    """This rank's model chunks, one per virtual stage."""
    return [_hybrid(cfg, pattern, vp_stage=stage if vp else None) for stage in range(vp or 1)]


def _layers(pattern: str) -> int:
    """Main decoder layers of a hybrid pattern (without ``|`` and the MTP depths)."""
    return len(pattern.split("/")[0].replace("|", ""))


def _global(name: str, model) -> str:
    """A chunk's parameter name with the decoder layer's global index (``layer_number - 1``)."""
    layers = model.decoder.layers
    return LAYER.sub(lambda m: f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.", name)


def _mhc_count(names) -> int:
    return sum("hyper_connection" in n for n in names)


def _pipeline_config(kind: str, pattern: str, pp: int, vp, recompute: bool):
    """A PP-capable config (P2P of the ``[s, b, n*C]`` streams needs variable_seq_lengths)."""
    # Megatron refuses variable_seq_lengths with the (default) allgather dispatcher, also dense
    extra = dict(_moe() if kind == "moe" else {}, moe_token_dispatcher_type="alltoall")
    if kind == "mtp":
        extra["mtp_num_layers"] = pattern.count("/")
    if recompute:  # blocks of 3 layers: counted per pipeline chunk, never across a boundary
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=3)
    if vp:
        # Interleaved schedule at PP=2: unbatched P2P with overlap (see pp_equivalence.py)
        extra.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    elif harness.DEVICE == "cpu":
        extra["batch_p2p_comm"] = False  # gloo: wait on each request (see pp_equivalence.py)
    return harness.config(num_layers=_layers(pattern), pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, variable_seq_lengths=pp > 1,
                          pipeline_dtype=torch.float32, **extra)


def _schedule(models, data, vp, forward_only: bool = False):
    """Megatron's schedule over the micro-batches ``data``: what the loss function reports on
    the last stage, per micro-batch (the loss, and the logits when ``forward_only``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        ids, pos, mask, labels = next(data_iterator)
        out = model(ids, pos, mask, labels=None if forward_only else labels)

        def loss_func(out):
            if forward_only:  # logits [b, s, V/tp]: gathered over TP by the caller
                return out.float().sum() * 0, {"logits": out.detach().float()}
            loss = out.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    iters = [iter(data) for _ in models] if vp else iter(data)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters, model=models if vp else models[0],
        num_microbatches=len(data), seq_length=SEQ, micro_batch_size=data[0][0].shape[0],
        forward_only=forward_only)


# ------------------------------------------------------------------------------------- TP
def _tp_config(kind: str, tp: int, sp: bool, recompute: bool):
    extra = _moe() if kind == "moe" else {}
    if recompute == "full":  # Megatron's full recompute, its saved inputs split over TP
        extra.update(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1, distribute_saved_activations=not sp)
    elif recompute:  # cross-layer mHC recompute, blocks of 2 layers (2 blocks)
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=2)
    return harness.config(num_layers=4, tensor_model_parallel_size=tp, sequence_parallel=sp,
                          **extra)


def _shard(full: torch.Tensor, param, rank: int, tp: int) -> torch.Tensor:
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[rank]
    return full


def check_tp(kind: str, pattern: str, sp: bool, recompute: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    from mhc_megatron.recompute.manager import manager_for

    data = batch(batch_size=2, seed=11, device=harness.DEVICE)
    harness.init_parallel(tp=1)
    ref = _hybrid(_tp_config(kind, 1, False, False), pattern)
    ref_loss = lm_loss(ref, data)
    ref_loss.backward()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    _nonzero(ref_grads, f"tp {pattern}")

    harness.init_parallel(tp=2)
    tp, rank = 2, parallel_state.get_tensor_model_parallel_rank()
    cfg = _tp_config(kind, 2, sp, recompute)
    model = _hybrid(cfg, pattern)
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), "TP=1 and TP=2 hybrid models differ in parameters"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_shard(ref_params[n], p, rank, tp))
    calls = []  # the first layer's forward runs again in backward under full recompute
    model.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    loss = lm_loss(model, data)
    loss.backward()
    assert len(calls) == (2 if recompute == "full" else 1), len(calls)
    model.ddp_config = DistributedDataParallelConfig()  # what finalize_model_grads reads
    _allreduce_non_tensor_model_parallel_grads([model], cfg)

    expected = {n: _shard(ref_grads[n], p, rank, tp) for n, p in model.named_parameters()}
    errors = {n: harness.relative_error(p.grad, expected[n]) for n, p in model.named_parameters()}
    print(f"GRAD ERRORS rank={rank} hybrid tp=2 pattern={pattern} sp={sp} recompute={recompute} "
          f"worst: {harness.worst_errors(errors)}", flush=True)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=2e-4, atol=2e-6,
                                   msg=lambda m, n=n: f"[tp {pattern} sp={sp} rc={recompute}] grad of {n}: {m}")
    n_mhc = _mhc_count(names)
    assert n_mhc == 3 * len(pattern), n_mhc  # one mapping a hybrid layer: (phi, alpha, bias)
    if recompute is True:
        assert manager_for(cfg).blocks_recomputed > 0, "mHC recompute did not recompute"
    print(f"PASS rank={rank} tp=2 pattern={pattern} sp={sp} recompute={recompute} "
          f"{harness.describe()} loss={loss.item():.6f} ref={ref_loss.item():.6f} "
          f"worst_grad_rel_err={max(errors.values()):.2e} params={len(names)} mhc_params={n_mhc}",
          flush=True)


TP_CASES = (("dense", "*-*-", False, False), ("dense", "*-*-", True, False),
            ("moe", "*E*E", True, False), ("dense", "*-*-", True, True),
            ("moe", "*E*E", True, True), ("dense", "*-*-", False, "full"),
            ("moe", "*E*E", True, "full"))


# ------------------------------------------------------------------------------------- EP
def _ep_config(ep: int, recompute: bool, dispatcher: str):
    extra = dict(_moe(), num_moe_experts=EXPERTS, moe_token_dispatcher_type=dispatcher,
                 expert_model_parallel_size=ep)
    if recompute:
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=2)
    return harness.config(num_layers=4, **extra)


def _global_expert(name: str, rank: int, local_experts: int) -> str:
    """An EP=2 parameter name -> the EP=1 name of the same expert (see ep_equivalence.py)."""
    def shift(m):
        if m.group(2) is not None:
            return f"{m.group(1)}{rank * local_experts + int(m.group(2))}{m.group(3)}"
        return f"{m.group(4)}{rank * local_experts + int(m.group(5))}"
    return LOCAL_EXPERT.sub(shift, name) if ".experts." in name else name


def check_ep(dispatcher: str, recompute: bool, pattern: str = "*E*E") -> None:
    from megatron.core import parallel_state

    from mhc_megatron.recompute.manager import manager_for

    rank = torch.distributed.get_rank()
    data = batch(batch_size=2, seed=100 + rank, device=harness.DEVICE)  # one batch a rank
    harness.init_parallel(ep=1)
    ref = _hybrid(_ep_config(1, False, dispatcher), pattern)
    ref_loss, ref_params, ref_grads = harness.data_parallel_reference(ref, data)
    _nonzero(ref_grads, f"ep {pattern}")

    harness.init_parallel(ep=2)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    cfg = _ep_config(2, recompute, dispatcher)
    model = _hybrid(cfg, pattern)
    names = {n: _global_expert(n, ep_rank, EXPERTS // 2) for n, _ in model.named_parameters()}
    n_expert = sum(".experts." in n for n in names)
    assert n_expert and set(names.values()) <= set(ref_params), \
        sorted(set(names.values()) - set(ref_params))
    held = [None, None]
    torch.distributed.all_gather_object(held, sorted(set(names.values())))
    assert set(held[0]) | set(held[1]) == set(ref_params), "EP=2 ranks miss EP=1 weights"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref_params[names[n]])
    loss = lm_loss(model, data)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    worst = harness.ep_grad_errors(model, names, ref_grads,
                                   f"ep=2 {dispatcher} rc={recompute}")
    n_mhc = _mhc_count(names)
    assert n_mhc == 3 * len(pattern), n_mhc
    if recompute:
        assert manager_for(cfg).blocks_recomputed > 0, "mHC recompute did not recompute"
    print(f"PASS rank={rank} ep=2 pattern={pattern} dispatcher={dispatcher} recompute={recompute} "
          f"{harness.describe()} loss={loss.item():.6f} ref={ref_loss.item():.6f} "
          f"worst_grad_rel_err={worst:.2e} expert_params={n_expert} mhc_params={n_mhc}",
          flush=True)


# ------------------------------------------------------------------------------------- PP
def check_pp(kind: str, pattern: str, vp, recompute: bool) -> None:
    from megatron.core import parallel_state

    from mhc_megatron.recompute.manager import manager_for

    rank = torch.distributed.get_rank()
    data = [batch(batch_size=2, seed=40 + i, device=harness.DEVICE) for i in range(MICRO)]
    flat = pattern.replace("|", "")
    harness.init_parallel()
    ref_cfg = _pipeline_config(kind, flat, 1, None, False)
    (ref,) = _chunks(ref_cfg, flat, None)
    ref_losses = [d["loss"] for d in _schedule([ref], data, None)]
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    _nonzero(ref_grads, f"pp {pattern}")

    harness.init_parallel(pp=2, vp=vp)
    cfg = _pipeline_config(kind, pattern, 2, vp, recompute)
    chunks = _chunks(cfg, pattern, vp)
    segments = pattern.split("/")[0].split("|")
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for stage, model in enumerate(chunks):  # this chunk is segment vp_stage * pp + pp_rank
        index = stage * 2 + pp_rank
        offset = sum(len(s) for s in segments[:index])
        assert "".join(model.decoder.layer_type_list) == segments[index]
        assert [layer.layer_number for layer in model.decoder.layers] == \
            list(range(offset + 1, offset + len(segments[index]) + 1))
        # mHC recompute blocks count from the chunk's first layer
        assert all(layer.mhc_chunk_offset == offset for layer in model.decoder.layers)
    mine = {}
    with torch.no_grad():
        for model in chunks:
            for n, p in model.named_parameters():
                g = _global(n, model)
                p.copy_(ref_params[g])
                mine[g] = p
    losses = [d["loss"] for d in _schedule(chunks, data, vp)]
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    refs = [None, None]
    torch.distributed.all_gather_object(refs, [x.item() for x in ref_losses])
    if last:
        print(f"LOSSES rank={rank} hybrid pp=2 vp={vp} pattern={pattern} recompute={recompute}: "
              f"PP=2 {[x.item() for x in losses]} PP=1 by rank {refs}", flush=True)
    assert refs[0] == refs[1], f"the PP=1 reference differs between ranks: {refs}"
    # A weight both stages hold (the embeddings, which MTP on the last stage reads too): each
    # has its share of the gradient; Megatron sums them over the embedding group, here over
    # the pipeline group in one agreed order.
    both = [None, None]
    torch.distributed.all_gather_object(both, sorted(mine))
    shared = sorted(set(both[0]) & set(both[1]))
    for g in shared:
        torch.distributed.all_reduce(mine[g].grad,
                                     group=parallel_state.get_pipeline_model_parallel_group())
    assert set(both[0]) | set(both[1]) == set(ref_params), "PP=2 misses PP=1 weights"
    errors = {g: harness.relative_error(p.grad, ref_grads[g]) for g, p in mine.items()}
    print(f"GRAD ERRORS rank={rank} hybrid pp=2 vp={vp} pattern={pattern} recompute={recompute} "
          f"worst: {harness.worst_errors(errors)}", flush=True)
    if last:
        assert len(losses) == MICRO
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for g, p in mine.items():
        torch.testing.assert_close(p.grad, ref_grads[g], rtol=2e-4, atol=2e-6,
                                   msg=lambda m, g=g: f"[pp {pattern} vp={vp} rc={recompute}] grad of {g}: {m}")
    if recompute:
        assert manager_for(cfg).blocks_recomputed > 0, "mHC recompute did not recompute"
    print(f"PASS rank={rank} pp=2 vp={vp} pattern={pattern} recompute={recompute} "
          f"{harness.describe()} micro_batches={MICRO} losses_checked={MICRO if last else 0} "
          f"worst_grad_rel_err={max(errors.values()):.2e} params={len(mine)} "
          f"shared={len(shared)} mhc_params={_mhc_count(mine)}", flush=True)


PP_CASES = (("dense", "*-|*-", None, False), ("dense", "*-|*-|*-|*-", 2, False),
            ("moe", "*E|*E", None, False), ("moe", "*E|*E|*E|*E", 2, False),
            ("mtp", "*-|*-/*-", None, False), ("dense", "*-|*-", None, True),
            ("dense", "*-|*-|*-|*-", 2, True), ("moe", "*E|*E", None, True),
            ("mtp", "*-|*-/*-", None, True))


# ---------------------------------------------------------------------------- checkpoints
def _full_params(model) -> dict:
    """Every parameter as the whole tensor, by global name (hybrid layers renumbered
    globally)."""
    if hasattr(model, "hybrid_layer_pattern"):
        return harness.full_params(model, lambda n: _global(n, model))
    return harness.full_params(model)


def _logits(models, data, vp=None):
    """Full-vocabulary logits [b, s, V] of ``data`` (one batch); through Megatron's
    forward-only schedule under PP (None on the stages without the output layer)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    for m in models:
        m.eval()
    with torch.no_grad():
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            ids, pos, mask, _ = data
            logits = models[0](ids, pos, mask).float()
        else:
            out = _schedule(models, [data], vp, forward_only=True)
            if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                return None
            logits = out[0]["logits"]
    return gather_from_tensor_model_parallel_region(logits)


def _save(state: dict, path: str) -> None:
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()


def _load_own(models, path: str) -> None:
    from megatron.core import dist_checkpointing

    for model in models:
        state = dist_checkpointing.load(model.sharded_state_dict(), path)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), \
            (missing, unexpected)


def _layout_config(kind: str, tp: int, pp: int, num_layers: int, **extra):
    extra = dict(_moe(), **extra) if kind.startswith("moe") else extra
    if pp > 1:
        extra.update(variable_seq_lengths=True, pipeline_dtype=torch.float32,
                     moe_token_dispatcher_type="alltoall",
                     batch_p2p_comm=harness.DEVICE != "cpu")
    # Megatron requires sequence parallelism for MoE with TP; dense runs without it.
    return harness.config(num_layers=num_layers, tensor_model_parallel_size=tp,
                          pipeline_model_parallel_size=pp,
                          sequence_parallel=tp > 1 and kind.startswith("moe"), **extra)


def _check_loaded(params: dict, logits, want_params: dict, want_logits, fresh, what: str) -> None:
    """Loaded parameters bit for bit and logits (last stage) equal the saved model's."""
    for n, t in params.items():
        assert n in want_params, f"[{what}] {n} has no saved counterpart"
        assert torch.equal(t, want_params[n]), f"[{what}] {n} differs after load"
    if logits is not None:
        assert not torch.allclose(fresh, want_logits), f"[{what}] the fresh model already matched"
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"[{what}] logits: {m}")


def _all_covered(params: dict, want_params: dict, what: str) -> None:
    """The ranks' loaded parameters together are every saved parameter."""
    names = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, sorted(params))
    covered = set().union(*map(set, names))
    assert covered == set(want_params), f"[{what}] not loaded: {sorted(set(want_params) - covered)}"


def check_ckpt(kind: str, pattern: str, layouts, root: str) -> None:
    """The hybrid model's own checkpoint through ``layouts`` [(tp, pp), ...]."""
    rank = torch.distributed.get_rank()
    data = batch(batch_size=2, seed=5, device=harness.DEVICE)
    sp_norms = kind == "moe"  # MoE at TP=2 needs SP; dense runs the product's local spec
    saved = None
    for step, (tp, pp) in enumerate(layouts):
        harness.init_parallel(tp=tp, pp=pp, seed=step + 1)
        cfg = _layout_config(kind, tp, pp, _layers(pattern))
        layout_pattern = pattern if pp > 1 else pattern.replace("|", "")
        model = _hybrid(cfg, layout_pattern, sp_norms=sp_norms)
        fresh = _logits([model], data)
        if saved is not None:
            what = f"{kind} TP={saved['tp']},PP={saved['pp']}->TP={tp},PP={pp}"
            _load_own([model], os.path.join(root, f"hybrid_{kind}_{step - 1}"))
            params, logits = _full_params(model), _logits([model], data)
            _check_loaded(params, logits, saved["params"], saved["logits"], fresh, what)
            _all_covered(params, saved["params"], what)
            err = harness.relative_error(logits, saved["logits"]) if logits is not None else 0.0
            print(f"PASS rank={rank} ckpt kind={kind} TP={saved['tp']},PP={saved['pp']}->"
                  f"TP={tp},PP={pp} {harness.describe()} params_bitwise={len(params)} "
                  f"mhc_params={_mhc_count(params)} logits_checked={logits is not None} "
                  f"logits_rel_err={err:.2e}", flush=True)
        if step + 1 < len(layouts):
            assert pp == 1, "the saving layouts keep every layer on each rank"
            _save(model.sharded_state_dict(), os.path.join(root, f"hybrid_{kind}_{step}"))
            saved = {"tp": tp, "pp": pp, "params": _full_params(model),
                     "logits": _logits([model], data)}


CKPT_CASES = (("dense", "*-|*-", ((2, 1), (1, 1), (1, 2))), ("moe", "*E*E", ((2, 1), (1, 1))))


# --------------------------------------------------------------------------- GPT -> hybrid
def _gpt(cfg, sp_norms: bool):
    """The GPT mHC model of ``cfg`` (an MTP block where ``cfg.mtp_num_layers``)."""
    from megatron.core.models.gpt import GPTModel

    from helpers import sequence_parallel_capable_spec
    from mhc_megatron.specs import (
        get_gpt_decoder_block_with_mhc_spec,
        get_gpt_mtp_block_with_mhc_spec,
    )

    spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=harness.USE_TE)
    if sp_norms and not harness.USE_TE:
        spec = sequence_parallel_capable_spec(cfg, spec)
    mtp = (get_gpt_mtp_block_with_mhc_spec(cfg, spec, harness.USE_TE)
           if cfg.mtp_num_layers else None)
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", mtp_block_spec=mtp).to(harness.DEVICE)


def _gpt_layers_stacked(path: str) -> bool:
    """Whether the GPT checkpoint at ``path`` keys its decoder layers on one stacked layer axis
    (``decoder.layers.<name>``) rather than one key a layer (``decoder.layers.<i>.<name>``)."""
    from megatron.core import dist_checkpointing

    keys = [k for k in dist_checkpointing.load_tensors_metadata(path)
            if k.startswith("decoder.layers.")]
    per_layer = [k for k in keys if re.match(r"decoder\.layers\.\d+\.", k)]
    assert keys and len(per_layer) in (0, len(keys)), keys
    return not per_layer


def _copy(metadata):
    return dict(metadata) if metadata is not None else None


def check_gpt_to_hybrid(kind: str, root: str, metadata=None, **extra) -> None:
    """A GPT mHC checkpoint saved at TP=2 -> the hybrid model at TP=1 (DP=2) and at PP=2."""
    from mhc_megatron.checkpoint.gpt_to_hybrid import (
        gpt_hybrid_layer_pattern,
        gpt_to_hybrid_key,
        load_gpt_checkpoint_into_hybrid,
    )

    rank = torch.distributed.get_rank()
    data = batch(batch_size=2, seed=7, device=harness.DEVICE)
    sp_norms = kind.startswith("moe")
    path = os.path.join(root, f"gpt_{kind}")
    harness.init_parallel(tp=2, seed=1)
    gpt_cfg = _layout_config(kind, 2, 1, 2, **extra)
    gpt = _gpt(gpt_cfg, sp_norms)
    # Megatron adds the layout's data-parallel group to the metadata it is given: a copy a call
    _save(gpt.sharded_state_dict(metadata=_copy(metadata)), path)
    stacked = _gpt_layers_stacked(path)
    assert stacked == (kind in ("dense", "mtp")), f"[gpt {kind}] stacked={stacked}"
    want = {gpt_to_hybrid_key(n): t for n, t in _full_params(gpt).items()}
    want_logits = _logits([gpt], data)

    for tp, pp in ((1, 1), (1, 2)):
        harness.init_parallel(tp=tp, pp=pp, seed=2 + pp)
        # The pattern places the MoE layers: the hybrid config has no GPT moe_layer_freq
        cfg = _layout_config(kind, tp, pp, 2 * gpt_cfg.num_layers,
                             **{k: v for k, v in extra.items() if k != "moe_layer_freq"})
        pattern = gpt_hybrid_layer_pattern(gpt_cfg, pipeline_stages=pp)
        model = _hybrid(cfg, pattern, sp_norms=sp_norms)
        fresh = _logits([model], data)
        load_gpt_checkpoint_into_hybrid(model, path, metadata=_copy(metadata))  # strict
        params, logits = _full_params(model), _logits([model], data)
        what = f"gpt {kind} TP=2 -> hybrid {pattern} TP={tp},PP={pp}"
        _check_loaded(params, logits, want, want_logits, fresh, what)
        _all_covered(params, want, what)
        err = harness.relative_error(logits, want_logits) if logits is not None else 0.0
        print(f"PASS rank={rank} gpt->hybrid kind={kind} TP=2->TP={tp},PP={pp} "
              f"pattern={pattern} {harness.describe()} params_bitwise={len(params)} "
              f"mhc_params={_mhc_count(params)} logits_checked={logits is not None} "
              f"logits_rel_err={err:.2e}", flush=True)


GPT_CASES = (("dense", None, {}), ("mtp", None, dict(mtp_num_layers=1)),
             ("dense_non_homogeneous", {"non_homogeneous_layers": True}, {}),
             ("moe_freq2", None, dict(moe_layer_freq=2)))


def main():
    """``SECTION[,SECTION...] [DIR]``: the sections in order, in one launch (``ckpt`` and
    ``gpt`` write their checkpoints under DIR)."""
    sections, args = sys.argv[1].split(","), sys.argv[2:]
    unknown = set(sections) - {"tp", "ep", "pp", "ckpt", "gpt"}
    if unknown or ({"ckpt", "gpt"} & set(sections) and not args):
        raise SystemExit(f"sections: tp, ep, pp, ckpt, gpt (ckpt and gpt need DIR); "
                         f"got {sys.argv[1:]}")
    harness.init(cuda_to_cpu=bool({"pp", "ckpt", "gpt"} & set(sections)))
    for section in sections:
        if section == "tp":
            for case in TP_CASES:
                check_tp(*case)
        elif section == "ep":
            dispatchers = ("allgather", "alltoall") if harness.DEVICE == "cuda" else ("allgather",)
            for dispatcher in dispatchers:
                for recompute in (False, True):
                    check_ep(dispatcher, recompute)
        elif section == "pp":
            for case in PP_CASES:
                check_pp(*case)
        elif section == "ckpt":
            for kind, pattern, layouts in CKPT_CASES:
                check_ckpt(kind, pattern, layouts, args[0])
        else:
            for kind, metadata, extra in GPT_CASES:
                check_gpt_to_hybrid(kind, args[0], metadata, **extra)


if __name__ == "__main__":
    main()
