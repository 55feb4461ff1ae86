"""Fully sharded data parallelism with mHC layers: torch FSDP2 through Megatron's
``TorchFullyShardedDataParallel``, and on GPUs Megatron-FSDP (``use_megatron_fsdp``, sharding
``optim_grads_params`` and ``optim_grads``), at DP=2 equal Megatron's DDP at DP=2 (which equals
DP=1: ``tests/test_pretrain_example.py``).

Run: MHC_DIST_DEVICE=cpu|cuda torchrun --nproc-per-node=2 tests/distributed/fsdp_equivalence.py

Two ranks, each its own micro-batch a step; the same initial weights; Megatron's optimizer
(Adam, gradient clipping) for STEPS steps, once on DDP (all-reduced gradients, replicated
parameters) and once fully sharded (FSDP2: every parameter, the mHC mappings' included, a
DTensor sharded over the two ranks; gradients reduce-scattered). Every step's loss on each
rank and the grad norm must agree (float rounding of the two reductions), and the mHC
parameters must be sharded and updated. The parameters' largest difference after the steps
is printed, not bounded: Adam turns the rounding noise of a near-zero gradient into a full
step (the mHC mapping biases have such entries; the baseline's attention biases too, less
so). The baseline (mHC off) runs the same comparison; its differences are printed beside
mHC's. fp32 on CPU ranks; on GPUs also bf16. Megatron-FSDP is CUDA-only (it places its
buffers on the current CUDA device). Last, checkpoints: an mHC model trained under FSDP2
(and on GPUs under Megatron-FSDP) and saved in the format Megatron saves it in (``torch_dcp``;
``fsdp_dtensor``) loads into a plain model to the same logits.
``tp`` as the argument (GPUs): TP=2 (DP=1) under Megatron-FSDP equals TP=2 under DDP
(baseline and mHC); the mHC parameters are replicated over tensor parallelism (Megatron-FSDP's
registry classifies them so) and must stay equal on both TP ranks.
"""

from __future__ import annotations

import os
import sys

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import batch, lm_loss

STEPS = 3
TP = 1  # the tensor-parallel size of the runs (check_tensor_parallel sets 2)


def _config(mhc: bool, bf16: bool):
    # Megatron's FSDP2 wrapper shards TE's linear modules on their own only with TE specs
    impl = "transformer_engine" if harness.USE_TE else "local"
    extra = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
    return harness.config(enable_hyper_connections=mhc, transformer_impl=impl,
                          tensor_model_parallel_size=TP, **extra)


def _wrap(wrapper: str, cfg, model, bf16: bool):
    """``model`` in ``wrapper`` ("ddp", "fsdp2", "megatron_fsdp_<strategy>") and Megatron's
    Adam for it: ``(wrapped, optimizer)``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if bf16:
        model = Float16Module(cfg, model)
    megatron_fsdp = wrapper.startswith("megatron_fsdp_")
    if megatron_fsdp:  # Megatron-FSDP, the sharding strategy after the prefix
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=bf16, use_megatron_fsdp=True, use_distributed_optimizer=True,
            data_parallel_sharding_strategy=wrapper[len("megatron_fsdp_"):])
        wrapped = FullyShardedDataParallel(cfg, ddp_config, model)
    else:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16)
        wrapped = (TorchFullyShardedDataParallel if wrapper == "fsdp2"
                   else DistributedDataParallel)(cfg, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16,
                                                 clip_grad=1.0,
                                                 use_distributed_optimizer=megatron_fsdp),
                                 [wrapped])
    return wrapped, opt


def _step(wrapped, opt, step: int) -> tuple[float, float]:
    """One optimizer step on this data-parallel rank's batch (the TP ranks of a data-parallel
    rank see the same one): (loss, grad norm)."""
    from megatron.core import parallel_state

    wrapped.zero_grad_buffer()
    opt.zero_grad()
    rank = parallel_state.get_data_parallel_rank()
    loss = lm_loss(wrapped, batch(seed=100 * step + rank, device=harness.DEVICE))
    loss.backward()
    wrapped.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok, f"step {step}: the optimizer skipped the step"
    return loss.item(), float(grad_norm)


def _train(wrapper: str, mhc: bool, bf16: bool, weights: dict | None):
    """STEPS steps; (losses on this rank, grad norms, initial weights, final parameters as
    full tensors, whether each mHC parameter was sharded)."""
    from torch.distributed.tensor import DTensor

    cfg = _config(mhc, bf16)
    model = harness.model(cfg)
    if weights is None:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    wrapped, opt = _wrap(wrapper, cfg, model, bf16)
    losses, norms = zip(*(_step(wrapped, opt, step) for step in range(STEPS)))
    sharded = [isinstance(p, DTensor) for n, p in _managed_parameters(wrapped)
               if "hyper_connection" in n]
    params = _full_parameters(wrapper, wrapped, cfg.params_dtype)
    return list(losses), list(norms), weights, params, sharded


def _full_parameters(wrapper: str, wrapped, dtype: torch.dtype) -> dict:
    """Every parameter after the last step as DDP at the same tensor-parallel size holds it
    (whole over data parallelism, this rank's tensor-parallel part; fp32 copies of the model's
    ``dtype`` values) by the model's own names, the same on every data-parallel rank (checked).

    Megatron-FSDP: its optimizer step ends in an asynchronous all-gather of the updated
    parameters (``optim_grads_params``), which the next forward's pre-hooks wait for;
    ``stop_communication`` waits for it here and installs the parameters as Megatron-FSDP's
    DTensors, the fp32 main weights (cast to ``dtype``: the compute weights' bits). Their
    shards are a bucket's row range each, uneven, which ``DTensor.full_tensor`` (even chunks)
    cannot gather: Megatron's own ``uneven_dtensor_to_full_tensor``, as its checkpointing,
    where data parallelism shards them; with one data-parallel rank (the TP=2 check) this
    rank's part is the local tensor (a gather would also join the tensor-parallel parts)."""
    from megatron.core import parallel_state
    from torch.distributed.tensor import DTensor

    to_full = DTensor.full_tensor
    if wrapper.startswith("megatron_fsdp_"):
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            uneven_dtensor_to_full_tensor as to_full,
        )

        wrapped.stop_communication()
    group = parallel_state.get_data_parallel_group()
    params = {}
    for n, p in wrapped.named_parameters():  # the same order on every rank (collectives)
        if isinstance(p, DTensor):
            p = to_full(p) if group.size() > 1 else p.to_local()
        params[_unwrapped(n)] = p.detach().to(dtype).float().clone()
    for n, p in params.items():  # replicas: a read before the gather finished would differ
        copies = [torch.empty_like(p) for _ in range(group.size())]
        torch.distributed.all_gather(copies, p.contiguous(), group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), \
            f"{wrapper}: {n} differs between the data-parallel ranks after the steps"
    return params


def _managed_parameters(wrapped) -> list:
    """The parameters as the wrapper manages them: FSDP2's are the module's own (DTensors);
    Megatron-FSDP swaps its distributed parameters (DTensors over the data-parallel mesh) into
    the module only around the optimizer step and gathers the whole ones back for the next
    forward, so its managed parameters are read from its buffer
    (``param_and_grad_buffer.optimizer_named_parameters``)."""
    buffer = getattr(getattr(wrapped, "module", None), "param_and_grad_buffer", None)
    if buffer is not None:
        return list(buffer.optimizer_named_parameters)
    return list(wrapped.named_parameters())


def _unwrapped(name: str) -> str:
    """A wrapped model's parameter name as the model itself names it (the wrappers'
    ``module.`` prefixes off)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _save_as_megatron(wrapper: str, model, wrapped, cfg, path: str) -> None:
    """The state of ``model`` (in ``wrapped``) saved as Megatron's loop saves it: FSDP2's
    sharded state dict with torch's distributed checkpoint (its ``torch_dcp`` format, the
    model's own keys); Megatron-FSDP's as its ``fsdp_dtensor`` format (``{"model": the wrapper's
    state_dict_for_save_checkpoint()}`` through Megatron's own
    ``preprocess_fsdp_dtensor_state_dict``, then torch's distributed checkpoint)."""
    import types

    import torch.distributed.checkpoint as dcp

    if wrapper == "fsdp2":
        dcp.save(model.state_dict(), checkpoint_id=path)
        return
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict

    args = types.SimpleNamespace(swiglu=cfg.gated_linear_unit, num_experts=cfg.num_moe_experts)
    state = preprocess_fsdp_dtensor_state_dict(
        args, {"model": wrapped.state_dict_for_save_checkpoint()}, wrapped)
    dcp.save(state, checkpoint_id=path)


def _load_into_plain(plain, path: str) -> int:
    """Loads the checkpoint at ``path`` into the plain (unwrapped, unsharded) model by torch's
    distributed checkpoint, each saved tensor into the plain parameter of its name (the
    format's ``model.`` and the wrappers' ``module.`` prefixes off); every parameter of
    ``plain`` must be in it. The number of mHC tensors loaded."""
    import torch.distributed.checkpoint as dcp

    def model_name(key: str) -> str:  # a saved key as the plain model names it
        return _unwrapped(key[len("model."):] if key.startswith("model.") else key)

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = plain.state_dict()
    target = {key: state[model_name(key)] for key in saved if model_name(key) in state}
    loaded = {model_name(key) for key in target}
    missing = sorted(n for n, _ in plain.named_parameters() if n not in loaded)
    assert not missing, f"parameters not in the checkpoint: {missing[:5]}"
    dcp.load(target, checkpoint_id=path)
    plain.load_state_dict(state)
    return sum("hyper_connection" in n for n in loaded)


def check_checkpoint(root: str, wrapper: str) -> None:
    """An mHC model trained a step under ``wrapper`` (FSDP2, or Megatron-FSDP
    ``optim_grads_params``) and saved in the format Megatron's loop saves it in
    (:func:`_save_as_megatron`) loads into a plain, unsharded model of another
    initialisation: the same logits, bit for bit. (Megatron-Core 0.19.2's own loop does not
    load a Megatron-FSDP checkpoint without Megatron-FSDP: ``tests/test_training_args.py``.)"""
    cfg = _config(True, False)
    model = harness.model(cfg)
    wrapped, opt = _wrap(wrapper, cfg, model, False)
    _step(wrapped, opt, 0)
    path = os.path.join(root, f"{wrapper}_checkpoint")
    _save_as_megatron(wrapper, model, wrapped, cfg, path)
    ids, pos, mask, _ = batch(seed=7, device=harness.DEVICE)
    with torch.no_grad():
        sharded_logits = wrapped(ids, pos, mask)
    harness.init_parallel(seed=99)  # another initialisation for the plain model
    plain = harness.model(cfg)
    with torch.no_grad():
        assert not torch.equal(plain(ids, pos, mask), sharded_logits)  # before the load
    n_mhc = _load_into_plain(plain, path)
    with torch.no_grad():
        plain_logits = plain(ids, pos, mask)
    assert torch.equal(sharded_logits, plain_logits), \
        harness.relative_error(plain_logits, sharded_logits)
    assert n_mhc == 6 * cfg.num_layers, n_mhc
    print(f"PASS rank={torch.distributed.get_rank()} {wrapper} checkpoint -> plain model "
          f"{harness.describe()} logits bitwise, mhc_tensors={n_mhc}", flush=True)


def _max_rel(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


_DDP_RUNS: dict = {}  # (TP, mhc, bf16) -> the DDP run every wrapper is compared with
_FINAL_PARAMS: dict = {}  # (wrapper, TP, mhc, bf16) -> the wrapper's final full parameters


def compare(wrapper: str, mhc: bool, bf16: bool) -> dict:
    if (TP, mhc, bf16) not in _DDP_RUNS:
        _DDP_RUNS[TP, mhc, bf16] = _train("ddp", mhc, bf16, None)
    losses, norms, weights, params, _ = _DDP_RUNS[TP, mhc, bf16]
    losses2, norms2, _, params2, sharded = _train(wrapper, mhc, bf16, weights)
    _FINAL_PARAMS[wrapper, TP, mhc, bf16] = params2
    assert sorted(params) == sorted(params2), sorted(set(params) ^ set(params2))
    errors = {n: harness.relative_error(params2[n], params[n]) for n in params}
    out = {"loss_rel_diff": _max_rel(losses2, losses),
           "grad_norm_rel_diff": _max_rel(norms2, norms), "param_rel_diff": max(errors.values())}
    print(f"PARAM ERRORS rank={torch.distributed.get_rank()} mhc={mhc} bf16={bf16} worst: "
          f"{harness.worst_errors(errors)}", flush=True)
    if mhc:
        if wrapper in ("fsdp2", "megatron_fsdp_optim_grads_params") and TP == 1:  # (DP=2)
            assert sharded and all(sharded), f"mHC parameters not sharded by {wrapper}"
        initial = {n: w.float() for n, w in weights.items() if "hyper_connection" in n}
        assert len(initial) == len(sharded)
        for n, w in initial.items():
            assert not torch.equal(params2[n], w), f"{n} was not updated"
    return out


def check(wrapper: str, bf16: bool) -> None:
    tol = 2e-2 if bf16 else 1e-5
    base = compare(wrapper, mhc=False, bf16=bf16)
    mine = compare(wrapper, mhc=True, bf16=bf16)
    for key in ("loss_rel_diff", "grad_norm_rel_diff"):
        assert mine[key] <= max(3 * base[key], tol), (
            f"[{wrapper} bf16={bf16}] mHC {key} {mine[key]:.2e} vs the baseline's {base[key]:.2e}")
    layout = "dp=2" if TP == 1 else f"tp={TP}"
    print(f"PASS rank={torch.distributed.get_rank()} {wrapper} {layout} bf16={bf16} "
          f"{harness.describe()} steps={STEPS} {harness.format_errors(mine, base)}", flush=True)


def check_tensor_parallel(bf16: bool) -> None:
    """TP=2, DP=1: Megatron-FSDP (``optim_grads_params``) == DDP in every step's loss and grad
    norm (baseline beside), and each mHC parameter, replicated over tensor parallelism, ends
    equal on both TP ranks."""
    global TP
    TP = 2
    harness.init_parallel(tp=2)
    wrapper = "megatron_fsdp_optim_grads_params"
    check(wrapper, bf16)
    params = _FINAL_PARAMS[wrapper, TP, True, bf16]
    mhc = {n: p for n, p in sorted(params.items()) if "hyper_connection" in n}
    assert mhc, "no mHC parameters"
    for n, p in mhc.items():
        other = [torch.empty_like(p) for _ in range(2)]
        torch.distributed.all_gather(other, p.contiguous())
        assert torch.equal(other[0], other[1]), f"{n} differs between the TP ranks"
    print(f"PASS rank={torch.distributed.get_rank()} {wrapper} tp=2 bf16={bf16} mHC parameters "
          f"replicated over TP, equal on both ranks: {len(mhc)}", flush=True)


WRAPPERS = ("fsdp2", "megatron_fsdp_optim_grads_params", "megatron_fsdp_optim_grads")


def main():
    """``argv[1]``: a directory for the checkpoint check (the same on both ranks); or
    ``tp``: the TP=2 checks alone (GPUs)."""
    harness.init(cuda_to_cpu=True)
    if sys.argv[1] == "tp":
        for bf16 in (False, True):
            check_tensor_parallel(bf16)
        return
    # once: FSDP2's device mesh keeps the data-parallel group it was built from, which a
    # rebuilt parallel state would replace (the weights are copied between the runs anyway)
    harness.init_parallel()
    cuda = harness.DEVICE == "cuda"
    for wrapper in WRAPPERS if cuda else WRAPPERS[:1]:
        for bf16 in (False, True) if cuda else (False,):
            check(wrapper, bf16)
    for wrapper in ("fsdp2", "megatron_fsdp_optim_grads_params") if cuda else ("fsdp2",):
        check_checkpoint(sys.argv[1], wrapper)


if __name__ == "__main__":
    main()
