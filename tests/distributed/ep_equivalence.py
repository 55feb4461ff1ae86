"""MoE with expert parallelism EP=2 equals EP=1: loss and every gradient.

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 tests/distributed/ep_equivalence.py
[single_grouped] (TE's single grouped expert weight alone; TE, GPUs)

Two ranks, each with its own micro-batch (EP is carved out of data parallelism). EP=1: both
ranks hold all 4 experts and the same weights; each runs fwd+bwd on its batch, and the sum of
the two ranks' gradients is the reference (what DP's all-reduce forms). EP=2: rank r holds
experts 2r and 2r+1 (copied from the EP=1 model), the token dispatcher sends every token to the
rank of its experts (allgather; also alltoall on GPUs: it needs CUDA streams). Megatron's own
finalize step is not needed for the check: the dense (non-expert) grads are summed over the two
ranks as DP would, and each local expert's grad, which already holds both ranks' tokens, must
equal the reference grad of that global expert. Per-rank losses must equal the EP=1 losses of
the same batch. With and without mHC recompute; with TE specs the experts run TE's grouped
GEMM; with ``single_grouped`` the experts' weights are TE's single grouped weight instead
(bf16, bounded by bf16's own rounding: ``check_single_grouped``). The same comparison without
mHC runs first for each dispatcher (and weight layout): its errors, the layout's own rounding,
are printed beside mHC's on the PASS line.
"""

from __future__ import annotations

import re
import sys

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import batch, lm_loss, moe_overrides, single_grouped_expert_overrides

EXPERTS = 4
LOCAL_EXPERT = re.compile(r"(local_experts\.)(\d+)(\.)|(weight|bias)(\d+)$")


def _config(ep: int, recompute: bool, dispatcher: str = "allgather",
            single_grouped: bool = False, mhc: bool = True, **overrides):
    """The tests' MoE config at EP=``ep``: with TE, TE's grouped GEMM (one GEMM per local
    expert), and with ``single_grouped`` its single grouped weight (bf16)."""
    extra = dict(moe_overrides(), num_moe_experts=EXPERTS, moe_token_dispatcher_type=dispatcher,
                 expert_model_parallel_size=ep, moe_grouped_gemm=harness.USE_TE)
    if single_grouped:
        extra.update(single_grouped_expert_overrides())
    if not mhc:
        extra.update(enable_hyper_connections=False)
    if recompute:
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=1)
    return harness.config(**{**extra, **overrides})


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


def per_gemm(tensors: dict) -> dict:
    """Single grouped expert weights (``...weight``, ``[local experts, out, in]``) as one
    tensor per expert under the per-GEMM layout's names (``...weight{i}``); other tensors as
    they are."""
    out = {}
    for n, t in tensors.items():
        if _is_single_grouped(n):
            out.update({f"{n}{i}": t[i] for i in range(t.shape[0])})
        else:
            out[n] = t
    return out


def _reference_part(name: str, rank: int, local: int):
    """How this EP rank's parameter ``name`` reads from the EP=1 model's tensors: the EP=1
    name (``_global_name``), or for a single grouped weight the rank's rows of the EP=1
    grouped tensor (a function of the EP=1 name -> tensor dict)."""
    if _is_single_grouped(name):
        return lambda ref: ref[name][rank * local:(rank + 1) * local]
    return _global_name(name, rank, local)


def check(dispatcher: str, recompute: bool, mhc: bool = True,
          baseline: dict | None = None) -> dict:
    """One EP=2 vs EP=1 comparison; returns its errors (``loss_rel_err``,
    ``worst_grad_rel_err``). With mHC it prints a PASS line, ``baseline`` (the same
    comparison without mHC) beside its errors."""
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    data = batch(batch_size=2, seed=100 + rank, device=harness.DEVICE)  # one batch a rank

    harness.init_parallel(ep=1)
    ref = harness.model(_config(1, False, mhc=mhc))
    ref_loss, ref_params, ref_grads = harness.data_parallel_reference(ref, data)

    harness.init_parallel(ep=2)
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    cfg = _config(2, recompute, dispatcher, mhc=mhc)
    model = harness.model(cfg)
    local = EXPERTS // 2
    names = {n: _reference_part(n, ep_rank, local) for n, _ in model.named_parameters()}
    n_expert = sum(".experts." in n for n in names)
    by_name = {v for v in names.values() if isinstance(v, str)}
    assert n_expert and by_name <= set(ref_params), sorted(by_name - set(ref_params))
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
    print(f"PASS rank={rank} ep=2 dispatcher={dispatcher} recompute={recompute} "
          f"{harness.describe()} loss={loss.item():.6f} ref={ref_loss.item():.6f} "
          f"{harness.format_errors(errors, baseline)} "
          f"expert_params={n_expert} mhc_params={checked_mhc}", flush=True)
    return errors


def check_single_grouped(mhc: bool = True, baseline: dict | None = None) -> dict:
    """EP=2 with TE's single grouped expert weight (bf16) against EP=1: the truth is an fp32
    EP=1 model with per-expert GEMM weights holding the same (bf16) values, and the bf16 EP=1
    single-grouped model's error against it is the rounding noise that bounds EP=2's
    (``harness.check_within_bf16_noise``), per tensor, in the per-expert layout. Returns the
    errors; with mHC prints a PASS line, ``baseline`` (the same check without mHC) beside."""
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    data = batch(batch_size=2, seed=100 + rank, device=harness.DEVICE)
    label = f"ep=2 single_grouped mhc={mhc}"

    harness.init_parallel(ep=1)
    ref16 = harness.model(_config(1, False, "alltoall", single_grouped=True, mhc=mhc))
    grouped = [n for n, _ in ref16.named_parameters() if _is_single_grouped(n)]
    assert grouped, ("no single grouped expert weight was built: TE needs "
                     "NVTE_GROUPED_LINEAR_SINGLE_PARAM=1 and bf16 for moe_single_grouped_weight")
    loss16, params16, grads16 = harness.data_parallel_reference(ref16, data)
    weights = per_gemm(params16)

    harness.init_parallel(ep=1)
    from megatron.core.activations import squared_relu
    ref32 = harness.model(_config(1, False, "alltoall", mhc=mhc, activation_func=squared_relu,
                                  gated_linear_unit=False))
    with torch.no_grad():
        for n, p in ref32.named_parameters():
            p.copy_(weights[n])  # the bf16 values, exactly
    loss32, _, grads32 = harness.data_parallel_reference(ref32, data)
    grads16 = {n: g.float() for n, g in per_gemm(grads16).items()}

    harness.init_parallel(ep=2)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = EXPERTS // 2
    model = harness.model(_config(2, False, "alltoall", single_grouped=True, mhc=mhc))
    names = {n: _reference_part(n, ep_rank, local) for n, _ in model.named_parameters()}
    assert any(map(_is_single_grouped, names)), "no single grouped weight at EP=2"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(harness.reference_tensor(names[n], params16))
    loss = lm_loss(model, data)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().float().clone()
        if getattr(p, "allreduce", True):  # dense params: DP's sum over the two ranks
            torch.distributed.all_reduce(g)
        grads[n] = g
    grads = {_global_name(n, ep_rank, local): g for n, g in per_gemm(grads).items()}
    errors, worst_name = harness.check_within_bf16_noise(
        loss.item(), loss16.item(), loss32.item(), grads, grads16, grads32, label)
    checked_mhc = sum("hyper_connection" in n for n in grads)
    if not mhc:
        assert checked_mhc == 0
        return errors
    assert checked_mhc == 2 * 3 * model.config.num_layers
    print(f"PASS rank={rank} ep=2 dispatcher=alltoall single_grouped=True {harness.describe()} "
          f"bf16 loss={loss.item():.6f} fp32_ref={loss32.item():.6f} bf16_ref={loss16.item():.6f} "
          f"{harness.format_errors(errors, baseline)} worst_grad=({worst_name}) "
          f"grouped_weights={len(grouped)} mhc_params={checked_mhc}", flush=True)
    return errors


def main():
    harness.init()
    if sys.argv[1:] == ["single_grouped"]:  # Megatron-Core 0.19.2's single grouped expert
        check_single_grouped(baseline=check_single_grouped(mhc=False))  # weight (TE only)
        return
    dispatchers = ("allgather", "alltoall") if harness.DEVICE == "cuda" else ("allgather",)
    for dispatcher in dispatchers:
        baseline = check(dispatcher, False, mhc=False)
        for recompute in (False, True):
            check(dispatcher, recompute, baseline=baseline)


if __name__ == "__main__":
    main()
