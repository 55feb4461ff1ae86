"""Context parallelism CP=2 (TE's attention) equals CP=1: loss and every gradient.

Run: MHC_DIST_DEVICE=cuda torchrun --nproc-per-node=2 tests/distributed/cp_equivalence.py
GPUs with Transformer Engine only: Megatron's local attention has no context parallelism, and
TE's CP attention runs its fused/flash kernels, which need bf16 (or fp16) activations.

Megatron's load-balanced layout: the sequence is cut into 2*CP chunks and CP rank r holds
chunks r and 2*CP-1-r (tokens, positions and labels alike). The CP=1 reference runs the whole
sequence; its per-token losses, taken on rank r's chunks, give rank r's loss. The gradient
reference is that of the sum of both ranks' losses; the CP=2 gradients are summed over the CP
group as Megatron's data-parallel (DP x CP) reduction does. bf16, so compared as relative
errors of whole tensors (a bf16 rounding is 4e-3). Dense and MoE, with and without mHC recompute.
"""

from __future__ import annotations

import harness  # noqa: F401  (first)
import torch

from helpers import SEQ, batch, moe_overrides

CP = 2
LOSS_RTOL = 1e-2   # bf16 activations, attention reordered into CP's ring
GRAD_REL = 3e-2    # ||g_cp - g_ref|| / ||g_ref|| per parameter


def _config(kind: str, cp: int, recompute: bool):
    extra = moe_overrides() if kind == "moe" else {}
    if recompute:
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=1)
    return harness.config(context_parallel_size=cp, params_dtype=torch.bfloat16, bf16=True,
                          **extra)


def _chunks(rank: int) -> torch.Tensor:
    """Sequence positions CP rank ``rank`` holds."""
    size = SEQ // (2 * CP)
    pos = torch.arange(SEQ).view(2 * CP, size)
    return torch.cat([pos[rank], pos[2 * CP - 1 - rank]]).to(harness.DEVICE)


def _token_losses(model, ids, pos, labels) -> torch.Tensor:
    return model(ids, pos, None, labels=labels).float()  # [b, s]; causal mask from the spec


def check(kind: str, recompute: bool) -> None:
    from megatron.core import parallel_state

    ids, pos, _, labels = batch(batch_size=2, seed=21, device=harness.DEVICE)
    rank = torch.distributed.get_rank()

    harness.init_parallel(cp=1)
    ref = harness.model(_config(kind, 1, False))
    per_token = _token_losses(ref, ids, pos, labels)
    ref_losses = [per_token[:, _chunks(r)].mean() for r in range(CP)]
    sum(ref_losses).backward()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.detach().float().clone() for n, p in ref.named_parameters()}

    harness.init_parallel(cp=CP)
    assert parallel_state.get_context_parallel_rank() == rank
    model = harness.model(_config(kind, CP, recompute))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref_params[n])
    mine = _chunks(rank)
    loss = _token_losses(model, ids[:, mine], pos[:, mine], labels[:, mine]).mean()
    loss.backward()
    err = abs(loss.item() - ref_losses[rank].item()) / abs(ref_losses[rank].item())
    assert err <= LOSS_RTOL, f"[cp {kind} rc={recompute}] loss {loss.item()} vs {ref_losses[rank].item()}"

    worst, worst_name, checked_mhc = 0.0, "", 0
    group = parallel_state.get_context_parallel_group()
    for n, p in model.named_parameters():
        g = p.grad.detach().float().clone()
        torch.distributed.all_reduce(g, group=group)
        e = harness.relative_error(g, ref_grads[n])
        assert e <= GRAD_REL, f"[cp {kind} rc={recompute}] grad of {n}: relative error {e:.2e}"
        if e > worst:
            worst, worst_name = e, n
        checked_mhc += "hyper_connection" in n
    assert checked_mhc == 6 * model.config.num_layers
    print(f"PASS rank={rank} cp=2 kind={kind} recompute={recompute} {harness.describe()} bf16 "
          f"loss={loss.item():.6f} ref={ref_losses[rank].item():.6f} loss_rel_err={err:.2e} "
          f"worst_grad_rel_err={worst:.2e} ({worst_name}) mhc_params={checked_mhc}", flush=True)


def main():
    if not harness.USE_TE:
        raise SystemExit("cp_equivalence.py needs GPUs with Transformer Engine")
    harness.init()
    for kind, recompute in (("dense", False), ("dense", True), ("moe", False)):
        check(kind, recompute)


if __name__ == "__main__":
    main()
