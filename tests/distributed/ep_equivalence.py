"""MoE with expert parallelism EP=2 equals EP=1: loss and every gradient.

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 tests/distributed/ep_equivalence.py

Two ranks, each with its own micro-batch (EP is carved out of data parallelism). EP=1: both
ranks hold all 4 experts and the same weights; each runs fwd+bwd on its batch, and the sum of
the two ranks' gradients is the reference (what DP's all-reduce forms). EP=2: rank r holds
experts 2r and 2r+1 (copied from the EP=1 model), the token dispatcher sends every token to
the rank of its experts (allgather; also alltoall on GPUs: it needs CUDA streams); Megatron's own finalize step is not needed for the check: the dense
(non-expert) grads are summed over the two ranks as DP would, and each local expert's grad,
which already holds both ranks' tokens, must equal the reference grad of that global expert.
Per-rank losses must equal the EP=1 losses of the same batch. With and without mHC recompute.
The same comparison without mHC runs first for each dispatcher (and weight layout): its
errors, the layout's own rounding, are printed beside mHC's on the PASS line.
"""

from __future__ import annotations

import re

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import batch, lm_loss, moe_overrides, single_grouped_expert_overrides

EXPERTS = 4
LOCAL_EXPERT = re.compile(r"(local_experts\.)(\d+)(\.)|(weight|bias)(\d+)$")


def _config(ep: int, recompute: bool, dispatcher: str = "allgather",
            single_grouped: bool = False, mhc: bool = True):
    extra = dict(moe_overrides(), num_moe_experts=EXPERTS, moe_token_dispatcher_type=dispatcher,
                 expert_model_parallel_size=ep)
    if single_grouped:
        extra.update(single_grouped_expert_overrides())
    if not mhc:
        extra.update(enable_hyper_connections=False)
    if recompute:
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=1)
    return harness.config(**extra)


def _global_name(name: str, rank: int, local_experts: int) -> str:
    """An EP=2 parameter name -> the EP=1 name of the same expert (SequentialMLP's
    ``local_experts.i.`` and TE grouped GEMM's ``weight{i}`` both count local experts)."""
    def shift(m):
        if m.group(2) is not None:
            return f"{m.group(1)}{rank * local_experts + int(m.group(2))}{m.group(3)}"
        return f"{m.group(4)}{rank * local_experts + int(m.group(5))}"
    return LOCAL_EXPERT.sub(shift, name) if ".experts." in name else name


def _is_single_grouped(name: str) -> bool:
    """TE's single grouped expert weight: ``...experts.linear_fcK.weight``, the local experts
    stacked on axis 0 (the per-GEMM layout names them ``weight{i}``)."""
    return ".experts.linear_fc" in name and name.endswith(".weight")


def _reference_part(name: str, rank: int, local: int):
    """How this EP rank's parameter ``name`` reads from the EP=1 model's tensors: the EP=1
    name (``_global_name``), or for a single grouped weight the rank's rows of the EP=1
    grouped tensor (a function of the EP=1 name -> tensor dict)."""
    if _is_single_grouped(name):
        return lambda ref: ref[name][rank * local:(rank + 1) * local]
    return _global_name(name, rank, local)


def check(dispatcher: str, recompute: bool, single_grouped: bool = False, mhc: bool = True,
          baseline: dict | None = None) -> dict:
    """One EP=2 vs EP=1 comparison; returns its errors (``loss_rel_err``,
    ``worst_grad_rel_err``). With mHC it prints a PASS line, ``baseline`` (the same
    comparison without mHC) beside its errors."""
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    data = batch(batch_size=2, seed=100 + rank, device=harness.DEVICE)  # one batch a rank

    harness.init_parallel(ep=1)
    ref = harness.model(_config(1, False, single_grouped=single_grouped, mhc=mhc))
    ref_loss, ref_params, ref_grads = harness.data_parallel_reference(ref, data)

    harness.init_parallel(ep=2)
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    cfg = _config(2, recompute, dispatcher, single_grouped, mhc)
    model = harness.model(cfg)
    local = EXPERTS // 2
    names = {n: _reference_part(n, ep_rank, local) for n, _ in model.named_parameters()}
    n_expert = sum(".experts." in n for n in names)
    by_name = {v for v in names.values() if isinstance(v, str)}
    assert n_expert and by_name <= set(ref_params), sorted(by_name - set(ref_params))
    assert not single_grouped or any(map(_is_single_grouped, names)), "no single grouped weight"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(harness.reference_tensor(names[n], ref_params))
    loss = lm_loss(model, data)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)

    errors = {"loss_rel_err": harness.relative_error(loss.detach(), ref_loss.detach()),
              "worst_grad_rel_err": harness.ep_grad_errors(model, names, ref_grads,
                                                           f"ep=2 {dispatcher} rc={recompute}")}
    checked_mhc = sum("hyper_connection" in n for n, _ in model.named_parameters())
    if not mhc:
        assert checked_mhc == 0
        return errors
    assert checked_mhc == 2 * 3 * cfg.num_layers
    grouped = " single_grouped=True" if single_grouped else ""
    print(f"PASS rank={rank} ep=2 dispatcher={dispatcher} recompute={recompute}{grouped} "
          f"{harness.describe()} loss={loss.item():.6f} ref={ref_loss.item():.6f} "
          f"{harness.format_errors(errors, baseline)} "
          f"expert_params={n_expert} mhc_params={checked_mhc}", flush=True)
    return errors


def main():
    harness.init()
    dispatchers = ("allgather", "alltoall") if harness.DEVICE == "cuda" else ("allgather",)
    for dispatcher in dispatchers:
        baseline = check(dispatcher, False, mhc=False)
        for recompute in (False, True):
            check(dispatcher, recompute, baseline=baseline)
    if harness.USE_TE:  # Megatron-Core 0.19.2's single grouped expert weight (TE only)
        baseline = check("alltoall", False, single_grouped=True, mhc=False)
        check("alltoall", False, single_grouped=True, baseline=baseline)


if __name__ == "__main__":
    main()
