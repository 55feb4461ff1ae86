"""TP=2 (with and without sequence parallel) equals TP=1: loss and every gradient.

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 tests/distributed/tp_equivalence.py
(``harness.py``: CPU ranks over gloo, or GPUs over NCCL with the Triton kernels and TE specs
where TE is installed.) Also with cross-layer mHC recompute on the TP=2 side (dense and MoE,
sequence parallel), and with Megatron's full recompute (dense with its saved inputs distributed
over TP, MoE with SP), and with DeepSeek-V4's conventions (``mhc_variant="deepseek_v4"``: its
mappings, H_res transposed, the learned output head; with SP). Each rank first builds the
TP=1 model (same seed -> same weights on both ranks), runs fwd+bwd, then rebuilds the
model-parallel state with TP=2, loads the TP=1 weights sharded along each parameter's
partition_dim, runs fwd+bwd on the same batch, lets Megatron's own finalize step reduce the
replicated (sequence-parallel) grads, and compares loss and gradients with the TP=1 run. The
same comparison without mHC runs first: its errors (the layout's own rounding) are printed
beside mHC's on the PASS line. Prints PASS lines; exits non-zero on a mismatch.
"""

from __future__ import annotations

import harness  # noqa: F401  (first: hides TE on CPU ranks)

import torch

from helpers import batch, lm_loss, moe_overrides


def _config(kind, tp, sp, recompute=False, mhc=True):
    extra = moe_overrides() if kind == "moe" else {}
    if kind == "dsv4":  # DeepSeek-V4's conventions: its mappings, H_res^T, the output head
        extra = dict(mhc_variant="deepseek_v4")
    if not mhc:
        extra.update(enable_hyper_connections=False)
    if recompute == "full":  # Megatron's full recompute, its saved inputs split over TP
        extra.update(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1, distribute_saved_activations=not sp)
    elif recompute:  # cross-layer mHC recompute, one layer a block (2 blocks)
        extra.update(mhc_recompute=True, mhc_recompute_layer_num=1)
    return harness.config(tensor_model_parallel_size=tp, sequence_parallel=sp, **extra)


def _shard(full: torch.Tensor, param: torch.nn.Parameter, rank: int, tp: int) -> torch.Tensor:
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[rank]
    return full


def _fwd_bwd(model, data):
    loss = lm_loss(model, data)
    loss.backward()
    return loss.detach()


def check(kind: str, sp: bool, recompute: bool = False, mhc: bool = True,
          baseline: dict | None = None) -> dict:
    """One TP=2 vs TP=1 comparison; returns its errors (``loss_rel_err``,
    ``worst_grad_rel_err``). With mHC it prints a PASS line, ``baseline`` (the same comparison
    without mHC) beside its errors."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    data = batch(batch_size=2, seed=11, device=harness.DEVICE)

    harness.init_parallel(tp=1)
    cfg1 = _config(kind, 1, False, mhc=mhc)
    ref = harness.model(cfg1)
    ref_loss = _fwd_bwd(ref, data)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}

    harness.init_parallel(tp=2)
    tp, rank = 2, parallel_state.get_tensor_model_parallel_rank()
    cfg2 = _config(kind, 2, sp, recompute, mhc=mhc)
    model = harness.model(cfg2)
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), "TP=1 and TP=2 models differ in parameters"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_shard(ref_params[n], p, rank, tp))
    loss = _fwd_bwd(model, data)
    model.ddp_config = DistributedDataParallelConfig()  # what finalize_model_grads reads
    _allreduce_non_tensor_model_parallel_grads([model], cfg2)

    expected = {n: _shard(ref_grads[n], p, rank, tp) for n, p in model.named_parameters()}
    errors = {n: harness.relative_error(p.grad, expected[n]) for n, p in model.named_parameters()}
    print(f"GRAD ERRORS rank={rank} {'mHC' if mhc else 'baseline'} kind={kind} sp={sp} "
          f"recompute={recompute} worst: {harness.worst_errors(errors)}", flush=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    checked_mhc = 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=2e-4, atol=2e-6,
                                   msg=lambda m, n=n: f"[{kind} sp={sp} rc={recompute}] grad of {n}: {m}")
        checked_mhc += "hyper_connection" in n
    result = {"loss_rel_err": harness.relative_error(loss, ref_loss),
              "worst_grad_rel_err": max(errors.values())}
    if not mhc:
        assert checked_mhc == 0
        return result
    assert checked_mhc == 2 * 3 * cfg2.num_layers  # two mappings a layer, (phi, alpha, bias)
    heads = sum(".head." in n for n in names)  # the output head's phi, alpha, bias
    assert heads == (3 if kind == "dsv4" else 0), heads
    print(f"PASS rank={rank} kind={kind} sp={sp} recompute={recompute} {harness.describe()} "
          f"loss={loss.item():.6f} ref={ref_loss.item():.6f} "
          f"{harness.format_errors(result, baseline)} params={len(names)} "
          f"mhc_params={checked_mhc}", flush=True)
    return result


CASES = (("dense", False, False), ("dense", True, False), ("moe", True, False),
         ("dense", True, True), ("moe", True, True), ("dense", False, "full"),
         ("moe", True, "full"), ("dsv4", True, False))


def main():
    """Each case runs first without mHC (the layout's own rounding, printed beside mHC's
    errors on the PASS line; mHC recompute has no baseline of its own: that of the same
    kind and SP), then with it. A failing comparison prints the worst gradients first
    (GRAD ERRORS lines)."""
    harness.init()
    # Megatron requires sequence parallelism for MoE with tensor parallelism.
    # The TP=2 runs with mHC or Megatron's full recompute are compared with TP=1 without it.
    baselines = {}
    for kind, sp, recompute in CASES:
        base_key = ("dense" if kind == "dsv4" else kind, sp,  # dsv4 without mHC is dense
                    recompute if recompute == "full" else False)
        if base_key not in baselines:
            baselines[base_key] = check(*base_key, mhc=False)
        check(kind, sp, recompute, baseline=baselines[base_key])


if __name__ == "__main__":
    main()
