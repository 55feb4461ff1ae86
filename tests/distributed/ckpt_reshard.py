"""A dist checkpoint saved at TP=2 loads at TP=1 (DP=2) with identical weights and logits,
and one saved at TP=1 (DP=2) loads at TP=2: Megatron's ``dist_checkpointing`` reshards the
mHC model (mapping parameters included), dense and MoE. Likewise for expert parallelism: an
MoE model saved at EP=2 loads at EP=1 and back (every expert where it belongs).

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 tests/distributed/ckpt_reshard.py DIR
[single_grouped] (the EP reshard of TE's single grouped expert weight alone; TE, GPUs)

Each step builds a model with a fresh seed (so loading must overwrite every weight), loads the
previous step's checkpoint, and checks: every parameter equals the saved one bit for bit
(TP shards gathered along ``partition_dim``), and the full-vocabulary logits on a fixed batch
equal the saving model's (up to the order of TP's reductions). Prints PASS lines.
"""

from __future__ import annotations

import os
import sys

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import batch, moe_overrides, single_grouped_expert_overrides


def _config(kind: str, tp: int):
    extra = moe_overrides() if kind == "moe" else {}
    # Megatron requires sequence parallelism for MoE with TP; dense runs without it.
    return harness.config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1 and kind == "moe",
                          **extra)


def _logits(model, data) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids, pos, mask, _ = data
    model.eval()
    return gather_from_tensor_model_parallel_region(model(ids, pos, mask)).float()


def _save(model, path):
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)
    torch.distributed.barrier()


def _load(model, path):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def _reshard_chain(kind: str, axis: str, root: str, build, full_params) -> None:
    """Save at size 2, load at 1, save, load at 2 along ``axis`` ("TP" or "EP"): each step
    builds a model with a fresh seed (``build(size, seed)``), loads the previous step's
    checkpoint, and checks every parameter bit for bit (``full_params(model, size)``: whole
    tensors under comparable names) and the saving model's logits; prints a PASS line."""
    data = batch(batch_size=2, seed=5, device=harness.DEVICE)  # the same batch on every rank
    saved = None
    for step, (size, seed) in enumerate(((2, 1), (1, 2), (2, 3))):
        model = build(size, seed)
        fresh = _logits(model, data)
        if saved is not None:
            _load(model, os.path.join(root, f"{kind}_{axis}_{step - 1}"))
            params, logits = full_params(model, size), _logits(model, data)
            assert params.keys() == saved["params"].keys(), \
                sorted(set(params) ^ set(saved["params"]))
            for n, t in params.items():
                assert torch.equal(t, saved["params"][n]), \
                    f"[{kind}] {n} differs after load at {axis}={size}"
            assert not torch.allclose(fresh, saved["logits"]), "the fresh model already matched"
            # bf16 models (the single grouped expert weight): a few bf16 ulps, the sizes'
            # own reduction orders; fp32: 1e-5
            tol = 2 ** -6 if model.config.bf16 else 1e-5
            torch.testing.assert_close(logits, saved["logits"], rtol=tol, atol=tol)
            err = harness.relative_error(logits, saved["logits"])
            n_mhc = sum("hyper_connection" in n for n in params)
            n_expert = sum(".experts." in n for n in params)
            print(f"PASS rank={torch.distributed.get_rank()} kind={kind} "
                  f"{axis}={saved['size']}->{axis}={size} {harness.describe()} "
                  f"params_bitwise={len(params)} mhc_params={n_mhc} expert_params={n_expert} "
                  f"logits_rel_err={err:.2e}", flush=True)
        _save(model, os.path.join(root, f"{kind}_{axis}_{step}"))
        saved = {"size": size, "params": full_params(model, size),
                 "logits": _logits(model, data)}


def check(kind: str, root: str) -> None:
    def build(tp, seed):
        harness.init_parallel(tp=tp, seed=seed)
        return harness.model(_config(kind, tp))

    _reshard_chain(kind, "TP", root, build, lambda model, tp: harness.full_params(model))


def _full_params_across_ep(model, ep: int) -> dict:
    """Every parameter under its EP=1 name: at EP=2 each rank's local experts renamed to the
    global ones (``ep_equivalence._global_name``) and gathered from both ranks (the dense
    parameters are the same on both: rank 0's); a single grouped expert weight as one tensor
    per expert (``ep_equivalence.per_gemm``)."""
    from megatron.core import parallel_state

    from ep_equivalence import EXPERTS, _global_name, per_gemm

    local = EXPERTS // ep
    if ep == 1:
        return per_gemm(harness.full_params(model))
    rank = parallel_state.get_expert_model_parallel_rank()
    mine = {_global_name(n, rank, local): t
            for n, t in per_gemm(harness.full_params(model)).items()}
    held = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, {n: t.cpu() for n, t in mine.items()})
    merged = {}
    for part in reversed(held):  # rank 0's dense parameters last, so they are kept
        merged.update(part)
    return {n: t.to(harness.DEVICE) for n, t in merged.items()}


def check_expert_parallel(root: str, single_grouped: bool = False) -> None:
    """MoE saved at EP=2 -> loaded at EP=1 -> saved -> loaded at EP=2: bitwise weights (under
    their EP=1 names), the saving model's logits. With TE specs the experts run TE's grouped
    GEMM; ``single_grouped``: their weights as TE's single grouped parameter
    (``moe_single_grouped_weight``, bf16), checked to be built."""
    from ep_equivalence import EXPERTS, _is_single_grouped

    grouped = single_grouped_expert_overrides() if single_grouped else {}

    def build(ep, seed):
        harness.init_parallel(ep=ep, seed=seed)
        model = harness.model(harness.config(**{
            **moe_overrides(), "num_moe_experts": EXPERTS, "expert_model_parallel_size": ep,
            "moe_grouped_gemm": harness.USE_TE, **grouped}))
        grouped_built = any(_is_single_grouped(n) for n, _ in model.named_parameters())
        assert grouped_built or not single_grouped, ("no single grouped expert weight was "
                                                     "built (TE needs "
                                                     "NVTE_GROUPED_LINEAR_SINGLE_PARAM=1)")
        return model

    kind = "moe_single_grouped" if single_grouped else "moe"
    _reshard_chain(kind, "EP", root, build, _full_params_across_ep)


def main():
    harness.init()
    root = sys.argv[1]
    if sys.argv[2:] == ["single_grouped"]:  # TE's single grouped expert weight alone
        check_expert_parallel(root, single_grouped=True)
        return
    for kind in ("dense", "moe"):
        check(kind, root)
    check_expert_parallel(root)


if __name__ == "__main__":
    main()
