"""Context parallelism CP=2 (TE's attention) equals CP=1: loss and every gradient.

Run: MHC_DIST_DEVICE=cuda torchrun --nproc-per-node=2 tests/distributed/cp_equivalence.py
GPUs with Transformer Engine only: Megatron's local attention has no context parallelism, and
TE's CP attention runs its fused/flash kernels, which need bf16 (or fp16) activations.

Megatron's load-balanced layout: the sequence is cut into 2*CP chunks and CP rank r holds
chunks r and 2*CP-1-r (tokens, positions and labels alike). The CP=1 reference runs the whole
sequence; its per-token losses, taken on rank r's chunks, give rank r's loss. The gradient
reference is that of the sum of both ranks' losses; the CP=2 gradients are summed over the CP
group as Megatron's data-parallel (DP x CP) reduction does. Dense and MoE, with and without
mHC recompute.

The bound is calibrated per tensor (``harness.check_within_bf16_noise``): an fp32 CP=1 run of
the same weights is the truth, the bf16 CP=1 run's error against it is the rounding noise,
and CP=2's error may be at most a few times that. A wrong chunk layout or a missing reduction
gives errors of order 1.
The same check without mHC runs first; its numbers (the layout's own) are printed beside
mHC's on the PASS line.
"""

from __future__ import annotations

import harness  # noqa: F401  (first)
import torch

from helpers import SEQ, batch, moe_overrides

CP = 2


def _config(kind: str, cp: int, recompute: bool, bf16: bool = True, mhc: bool = True):
    extra = moe_overrides() if kind == "moe" else {}
    if not mhc:
        extra.update(enable_hyper_connections=False)
    if recompute:
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    return harness.config(context_parallel_size=cp, params_dtype=dtype, bf16=bf16, **extra)


def _chunks(rank: int) -> torch.Tensor:
    """Sequence positions CP rank ``rank`` holds."""
    size = SEQ // (2 * CP)
    pos = torch.arange(SEQ).view(2 * CP, size)
    return torch.cat([pos[rank], pos[2 * CP - 1 - rank]]).to(harness.DEVICE)


def _token_losses(model, ids, pos, labels) -> torch.Tensor:
    return model(ids, pos, None, labels=labels).float()  # [b, s]; causal mask from the spec


def _whole_sequence(model, weights, data):
    """CP=1: per-rank losses (rank r's chunks of the whole sequence) and grads of their sum."""
    ids, pos, _, labels = data
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    per_token = _token_losses(model, ids, pos, labels)
    losses = [per_token[:, _chunks(r)].mean() for r in range(CP)]
    sum(losses).backward()
    return [l.item() for l in losses], {n: p.grad.detach().float().clone()
                                        for n, p in model.named_parameters()}


def check(kind: str, recompute: bool, mhc: bool = True, baseline: dict | None = None) -> dict:
    """One CP=2 vs CP=1 comparison; returns its errors against the fp32 CP=1 run
    (``loss_rel_err``, and ``worst_grad_vs_noise``: the largest gradient error over
    ``bf16 noise + FLOOR``). With mHC it prints a PASS line, ``baseline`` (the same check
    without mHC) beside its errors."""
    from megatron.core import parallel_state

    data = batch(batch_size=2, seed=21, device=harness.DEVICE)
    ids, pos, _, labels = data
    rank = torch.distributed.get_rank()

    harness.init_parallel(cp=1)
    ref16 = harness.model(_config(kind, 1, False, mhc=mhc))
    weights = {n: p.detach().clone() for n, p in ref16.named_parameters()}
    losses16, grads16 = _whole_sequence(ref16, weights, data)
    ref32 = harness.model(_config(kind, 1, False, bf16=False, mhc=mhc))
    losses32, grads32 = _whole_sequence(ref32, weights, data)  # the bf16 weights, exactly

    harness.init_parallel(cp=CP)
    assert parallel_state.get_context_parallel_rank() == rank
    model = harness.model(_config(kind, CP, recompute, mhc=mhc))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    mine = _chunks(rank)
    loss = _token_losses(model, ids[:, mine], pos[:, mine], labels[:, mine]).mean()
    loss.backward()
    group = parallel_state.get_context_parallel_group()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().float().clone()
        torch.distributed.all_reduce(g, group=group)
        grads[n] = g
    errors, worst_name = harness.check_within_bf16_noise(
        loss.item(), losses16[rank], losses32[rank], grads, grads16, grads32,
        f"cp {kind} rc={recompute}")
    truth = losses32[rank]
    checked_mhc = sum("hyper_connection" in n for n in grads)
    if not mhc:
        assert checked_mhc == 0
        return errors
    assert checked_mhc == 6 * model.config.num_layers
    print(f"PASS rank={rank} cp=2 kind={kind} recompute={recompute} {harness.describe()} bf16 "
          f"loss={loss.item():.6f} fp32_ref={truth:.6f} bf16_ref={losses16[rank]:.6f} "
          f"{harness.format_errors(errors, baseline)} worst_grad=({worst_name}) "
          f"mhc_params={checked_mhc}", flush=True)
    return errors


def main():
    if not harness.USE_TE:
        raise SystemExit("cp_equivalence.py needs GPUs with Transformer Engine")
    harness.init()
    baselines = {kind: check(kind, False, mhc=False) for kind in ("dense", "moe")}
    for kind, recompute in (("dense", False), ("dense", True), ("moe", False)):
        check(kind, recompute, baseline=baselines[kind])


if __name__ == "__main__":
    main()
