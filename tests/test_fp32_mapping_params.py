"""fp32 mapping parameters (``mhc_params_dtype=torch.float32``) in a bf16 model, through
Megatron-Core 0.19.2's optimisers and checkpoints, with
:mod:`mhc_megatron.training.fp32_params`.

Every check runs in fresh ranks (``helpers.start_ranks``: torchrun, or on a host without
CUDA and TE forked from a process that imported torch and Megatron once): on CPU ranks over
gloo (the CUDA-to-CPU shims of ``mhc_testing.cpu_training`` are process-wide, so they stay
out of the pytest process), and the training-loop check also on one GPU over NCCL (float16
optimiser; the distributed one where TE or Apex is installed). This file is also the script
those processes run:

* ``pretrain ARGS``: ``examples/pretrain_gpt_mhc.py`` (Megatron's own training loop) inside
  :func:`~mhc_megatron.training.fp32_params.fp32_params_in_megatron_training`; it saves the
  final parameters to ``$MHC_FP32_DUMP``;
* ``core DIR``: Megatron-Core directly (Float16Module, DDP, ``get_megatron_optimizer``,
  ``dist_checkpointing``) on 2 data-parallel ranks, for what Megatron's loop cannot do on CPU:
  the distributed optimiser does not resume on CPU ranks in 0.19.2 (its ``state_dict``
  asserts one Adam step value, and before the first step there is none), so its resume is
  driven here, after one throw-away step that the checkpoint then overwrites.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import (CPU_LAUNCH_FLAGS, LOCAL_MODULE_FLAGS, ROOT, TINY_GPT_FLAGS, child_env,
                     needs_fused_adam, run_ranks)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXAMPLE = ROOT / "examples" / "pretrain_gpt_mhc.py"
THIS = Path(__file__).resolve()

# The tiny GPT and schedule of test_pretrain_example.py on mock data, 4 steps, no eval.
ITERS = 4
MODEL = TINY_GPT_FLAGS
TRAIN = ["--make-vocab-size-divisible-by", "256", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3",
         "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--seed", "1234", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "1000", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
         "--mock-data", "--log-micro-batch-loss"]
# CPU ranks over gloo; one GPU over NCCL with Megatron's local modules (also where TE is
# installed: the same modules both ways) and the Triton kernels.
BACKEND = {"cpu": [*LOCAL_MODULE_FLAGS, "--distributed-backend", "gloo",
                   "--use-cpu-initialization", *CPU_LAUNCH_FLAGS],
           "cuda": LOCAL_MODULE_FLAGS}
# Megatron 0.19.2's distributed optimiser does not resume without TE's or Apex's Adam (so
# never on CPU ranks; see _Core below).
LOOP_CASES = [("cpu", "float16"),
              pytest.param("cuda", "float16", marks=needs_gpu),
              pytest.param("cuda", "distributed", marks=[needs_gpu, needs_fused_adam])]
FP32_MHC = ["--enable-hyper-connections", "--num-residual-streams", "4", "--bf16",
            "--mhc-params-dtype", "fp32"]


def _torchrun(args, nproc=1, timeout=300, device="cpu", **env):
    """This file as the script of ``nproc`` ranks (``helpers.start_ranks``)."""
    run = run_ranks(nproc, THIS, *args, env=child_env(cpu_only=device == "cpu", **env),
                    timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:]
    return run.stdout


def _ckpt_key(param_name: str) -> str:
    """The dist-checkpoint key of a model parameter (unwrapped, layers stacked)."""
    return re.sub(r"\.layers\.\d+\.", ".layers.", re.sub(r"^(module\.)+", "", param_name))


def _train_losses(out):
    return [float(v) for v in re.findall(r"\[micro-batch loss\] train ([-0-9.eE+]+)", out)]


@pytest.mark.parametrize("device,optimizer", LOOP_CASES)
def test_megatron_training_loop_saves_and_resumes_bitwise(tmp_path, device, optimizer):
    """Megatron's own loop, --bf16, fp32 mapping params, Megatron's float16 (or, on a GPU,
    distributed) optimiser: trains, saves at step 2, and a run resumed from that checkpoint
    repeats steps 3-4 bit for bit (losses and final parameters); the mapping parameters are
    fp32 in the model and in the checkpoint, with their own fp32 main copies and Adam
    moments."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU-rank case runs where there is no GPU (CI)")
    ckpt = tmp_path / "ckpt"
    flags = [*MODEL, *TRAIN, *BACKEND[device], *FP32_MHC,
             *(["--use-distributed-optimizer"] if optimizer == "distributed" else [])]
    full = _torchrun(["pretrain", *flags, "--save", str(ckpt), "--save-interval", "2"],
                     device=device, MHC_FP32_DUMP=str(tmp_path / "full.pt"))
    resumed = _torchrun(["pretrain", *flags, "--load", str(ckpt), "--ckpt-step", "2"],
                        device=device, MHC_FP32_DUMP=str(tmp_path / "resumed.pt"))
    assert "successfully saved checkpoint" in full and "successfully loaded checkpoint" in resumed
    full_losses, resumed_losses = _train_losses(full), _train_losses(resumed)
    assert len(full_losses) == 2 * ITERS and len(resumed_losses) == ITERS
    assert full_losses[ITERS:] == resumed_losses

    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("full.pt", "resumed.pt"))
    assert a["params"].keys() == b["params"].keys()
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name
        assert p.dtype == (torch.float32 if name in a["mapping"] else torch.bfloat16), name
    assert a["mapping"] and all(a["main_param_is_fp32"].values())

    # The checkpoint at step 2: fp32 model tensors and (float16 optimiser: keyed per model
    # parameter) a full fp32 optimiser state for them; the distributed optimiser saves its
    # flat fp32 buffers (dp_reshardable), whose restore the equal losses above show.
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt / "iter_0000002")).read_metadata().state_dict_metadata
    for name in a["mapping"]:
        key = _ckpt_key(name)
        assert meta[key].properties.dtype == torch.float32, key
        for state in ("fp32_param", "exp_avg", "exp_avg_sq") if optimizer == "float16" else ():
            assert meta[f"optimizer.state.{state}.{key}"].properties.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks (the GPU runs are elsewhere)")
def test_megatron_core_optimizers_on_two_data_parallel_ranks(tmp_path):
    """Float16 and distributed optimiser, DP=2: gradients of the fp32 buffer reduce like the
    others, the fp32 parameters stay fp32 (the distributed optimiser updates them in place),
    and every checkpoint format resumes bit for bit; without
    ``make_fp32_params_checkpointable`` Megatron still fails."""
    out = _torchrun(["core", str(tmp_path)], nproc=2)
    assert "CORE CHECKS PASSED" in out, out[-6000:]


# ---------------------------------------------------------------------------------------
# What the torchrun processes run.
# ---------------------------------------------------------------------------------------

def _mapping_names(module) -> list[str]:
    from mhc_megatron.layers.hyper_connection import HyperConnectionModule

    return [f"{mod_name}.{p_name}" for mod_name, mod in module.named_modules()
            if isinstance(mod, HyperConnectionModule)
            for p_name, _ in mod.named_parameters(recurse=False)]


def _pretrain_main(argv) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    sys.argv = [str(EXAMPLE), *argv]
    import megatron.training.training as training
    import pretrain_gpt_mhc

    from mhc_megatron.training.fp32_params import fp32_params_in_megatron_training

    built = {}
    with fp32_params_in_megatron_training():
        fixed = training.get_megatron_optimizer

        def capture(config, model_chunks, *args, **kwargs):
            built["model"] = model_chunks
            built["opt"] = fixed(config, model_chunks, *args, **kwargs)
            return built["opt"]

        training.get_megatron_optimizer = capture
        try:
            pretrain_gpt_mhc.main()
        finally:
            training.get_megatron_optimizer = fixed
    dump = os.environ.get("MHC_FP32_DUMP")
    if dump and torch.distributed.get_rank() == 0:
        (chunk,) = built["model"]
        mapping = set(_mapping_names(chunk))
        params = dict(chunk.named_parameters())
        torch.save({
            "params": {n: p.detach().clone() for n, p in params.items()},
            "mapping": sorted(mapping),
            "main_param_is_fp32": {n: _main_param_is_fp32(built["opt"], params[n])
                                   for n in mapping},
        }, dump)


def _main_param_is_fp32(chained, p) -> bool:
    """The optimiser's fp32 main value of the fp32 model parameter ``p``: the float16
    optimiser's own copy, equal to it; the distributed optimiser's shard, a view of ``p``
    itself (it updates fp32 parameters in place)."""
    from megatron.core.optimizer import DistributedOptimizer

    (opt,) = chained.chained_optimizers
    if not isinstance(opt, DistributedOptimizer):
        main = p.main_param
        return (main.dtype == torch.float32 and main.data_ptr() != p.data_ptr()
                and torch.equal(main, p.detach()))
    main = opt._get_main_param_and_optimizer_states(p)["param"]
    r = opt._get_model_param_range_map(p)["param"]
    start = p.untyped_storage().data_ptr()
    return (main.dtype == torch.float32 and torch.equal(main, p.detach().view(-1)[r.start:r.end])
            and start <= main.data_ptr() < start + p.untyped_storage().nbytes())


class _Core:
    """One tiny bf16 mHC GPT (fp32 mapping params) in Float16Module + DDP + a Megatron
    optimiser, on the data-parallel group of all ranks."""

    def __init__(self, kind: str, fix: bool = True):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        sys.path.insert(0, str(THIS.parent))
        from helpers import build_gpt, tiny_config

        from mhc_megatron.training.fp32_params import make_fp32_params_checkpointable

        torch.manual_seed(1234)
        config = tiny_config(bf16=True, params_dtype=torch.bfloat16,
                             mhc_params_dtype=torch.float32)
        distributed = kind == "distributed"
        model = Float16Module(config, build_gpt(config))
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=distributed)
        self.model = DistributedDataParallel(config, ddp_config, model)
        self.opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                            bf16=True, use_distributed_optimizer=distributed), [self.model])
        if fix:
            make_fp32_params_checkpointable(self.opt)
        self.kind = kind
        self.mapping = set(_mapping_names(self.model))
        self.params = dict(self.model.named_parameters())

    def backward(self, step: int):
        from helpers import batch, lm_loss

        self.model.zero_grad_buffer()
        self.opt.zero_grad()
        rank = torch.distributed.get_rank()
        loss = lm_loss(self.model, batch(seed=100 * step + rank))
        loss.backward()
        return loss

    def step(self, step: int) -> float:
        loss = self.backward(step)
        self.model.finish_grad_sync()
        ok, _, _ = self.opt.step()
        assert ok
        return loss.item()

    def metadata(self, sharding_type=None) -> dict:
        from megatron.core import parallel_state

        meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if sharding_type:
            meta["distrib_optim_sharding_type"] = sharding_type
        return meta

    def sharded_state_dict(self, sharding_type=None, is_loading=False) -> dict:
        from megatron.core.utils import unwrap_model

        meta = self.metadata(sharding_type)  # the model as Megatron saves it: unwrapped
        sd = {"model": unwrap_model(self.model).sharded_state_dict(metadata=meta)}
        sd["optimizer"] = self.opt.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
        return sd

    def save(self, path: Path, sharding_type=None):
        from megatron.core import dist_checkpointing

        if torch.distributed.get_rank() == 0:
            path.mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save(self.sharded_state_dict(sharding_type), str(path))

    def load(self, path: Path, sharding_type=None):
        """As megatron.training.checkpointing.load_checkpoint does for torch_dist."""
        from megatron.core import dist_checkpointing
        from megatron.core.utils import unwrap_model

        state = dist_checkpointing.load(self.sharded_state_dict(sharding_type, is_loading=True),
                                        str(path))
        unwrap_model(self.model).load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])

    def snapshot(self) -> dict:
        return {n: p.detach().clone() for n, p in self.params.items()}


def _check(condition, message):
    if not condition:
        raise AssertionError(message)


def _same(a: dict, b: dict, what: str):
    for name in a:
        _check(torch.equal(a[name], b[name]), f"{what}: {name} differs")


def _check_training_invariants(core: _Core):
    """Dtypes, gradient reduction of both buffers, fp32 update in place, ranks in sync."""
    from megatron.core.optimizer import DistributedOptimizer

    world = torch.distributed.get_world_size()
    _check(core.mapping, "no mapping parameters found")
    for name, p in core.params.items():
        want = torch.float32 if name in core.mapping else torch.bfloat16
        _check(p.dtype == want, f"{name}: {p.dtype}, expected {want}")
        _check(p.main_grad.dtype == torch.float32, f"{name}: main_grad {p.main_grad.dtype}")

    # One step by hand: the reduced gradients = the mean of the ranks' local gradients.
    core.backward(step=0)
    expected = {}
    for name, p in core.params.items():
        g = p.main_grad.detach().clone() / world
        torch.distributed.all_reduce(g)
        expected[name] = g
    core.model.finish_grad_sync()
    (opt,) = core.opt.chained_optimizers
    for name, p in core.params.items():
        got, want = p.main_grad.view(-1), expected[name].view(-1)
        if isinstance(opt, DistributedOptimizer):  # reduce-scatter: this rank's shard only
            if p not in opt.model_param_gbuf_map:
                continue  # no shard of p on this rank
            r = opt._get_model_param_range_map(p)["param"]
            got, want = got[r.start:r.end], want[r.start:r.end]
        _check(torch.allclose(got, want, rtol=1e-6, atol=0), f"{name}: gradient not reduced")
    ok, _, _ = core.opt.step()
    _check(ok, "step failed")

    for name in core.mapping:
        p = core.params[name]
        _check(p.dtype == torch.float32, f"{name} left fp32 in training")
        if isinstance(opt, DistributedOptimizer):
            # Its "main param" is a shard view of the fp32 model param itself.
            if p not in opt.model_param_gbuf_map:
                continue
            main = opt._get_main_param_and_optimizer_states(p)["param"]
            r = opt._get_model_param_range_map(p)["param"]
            _check(main.dtype == torch.float32 and main.numel() == r.size, name)
            _check(torch.equal(main, p.detach().view(-1)[r.start:r.end]), name)
            start = p.untyped_storage().data_ptr()
            _check(start <= main.data_ptr() < start + p.untyped_storage().nbytes(),
                   f"{name}: the distributed optimiser's shard is not a view of the param")
        else:
            _check(p.main_param.dtype == torch.float32 and torch.equal(p.main_param, p.detach()),
                   name)
    # Every rank holds the same parameters after the step (all-reduce or all-gather).
    for name, p in core.params.items():
        copies = [torch.empty_like(p) for _ in range(world)]
        torch.distributed.all_gather(copies, p.detach().contiguous())
        _check(all(torch.equal(c, copies[0]) for c in copies), f"{name}: ranks differ")


def _optimizer_state(core: _Core) -> dict:
    """This rank's optimiser state per model parameter (fp32 main/shard, Adam moments)."""
    from megatron.core.optimizer import DistributedOptimizer

    (opt,) = core.opt.chained_optimizers
    state = {}
    for name, p in core.params.items():
        if isinstance(opt, DistributedOptimizer):
            if p not in opt.model_param_gbuf_map:
                continue
            tensors = opt._get_main_param_and_optimizer_states(p)
        else:
            main = p.main_param
            tensors = {"param": main, **opt.optimizer.state[main]}
        state[name] = {k: v.detach().clone() for k, v in tensors.items() if k != "step"}
    return state


def _check_resume(kind: str, tmp: Path):
    """Steps 1-2, save (Megatron's default format for the optimiser: dp_reshardable for the
    distributed one), load into a fresh model and optimiser, steps 3-4: the same losses and
    parameters as an uninterrupted run, bit for bit."""
    sharding_type = "dp_reshardable" if kind == "distributed" else None
    reference = _Core(kind)
    ref_losses = [reference.step(s) for s in range(1, 5)]
    ref_params = reference.snapshot()

    first = _Core(kind)
    losses = [first.step(s) for s in (1, 2)]
    path = tmp / kind
    first.save(path, sharding_type)

    second = _Core(kind)
    if kind == "distributed":
        # Megatron 0.19.2 with torch's Adam (no TE/Apex) can only load into an optimiser that
        # holds state (its state_dict asserts one Adam step value), and dp_reshardable then
        # copies that pre-load "step" back over the loaded one: a CPU-only limitation of the
        # checkpoint's step counter, for every parameter, unrelated to dtypes (TE/Apex keep
        # the step in the param groups). So: one throw-away step, and the step restored below.
        second.step(99)
    second.load(path, sharding_type)
    _same(first.snapshot(), second.snapshot(), f"{kind}: loaded parameters")
    saved, loaded = _optimizer_state(first), _optimizer_state(second)
    _check(saved.keys() == loaded.keys(), f"{kind}: optimiser state of other parameters")
    for name, tensors in saved.items():
        for key, value in tensors.items():
            _check(torch.equal(value, loaded[name][key]), f"{kind}: {name} {key} not restored")
    if kind == "distributed":
        for state in second.opt.chained_optimizers[0].optimizer.state.values():
            state["step"] = torch.tensor(2.0)
    losses += [second.step(s) for s in (3, 4)]
    _check(losses == ref_losses, f"{kind}: losses {losses} != {ref_losses}")
    _same(ref_params, second.snapshot(), f"{kind}: parameters after step 4")
    for name in second.mapping:
        _check(second.params[name].dtype == torch.float32, f"{name} not fp32 after resume")

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name in second.mapping:
        key = _ckpt_key(name)
        _check(meta[key].properties.dtype == torch.float32, f"{key} not fp32 in the checkpoint")


def _check_model_space_state_belongs_to_its_parameter(core: _Core):
    """The distributed optimiser's model-space formats (fully_reshardable, the one of
    --dist-ckpt-optim-fully-reshardable) key each state tensor by a model parameter; with a
    stale group index they would silently carry another parameter's state. The "param" entry
    must be that parameter's own fp32 value: equal to it (fp32) or rounding to it (bf16)."""
    sd = core.sharded_state_dict("fully_reshardable")
    model = {(sh.key, sh.global_offset): sh.data for sh in _sharded_tensors(sd["model"])}
    checked = 0
    for tensors in sd["optimizer"]["param_state"].values():
        sh = tensors["param"]
        model_value = model[(sh.key.removeprefix("optimizer.state.param."), sh.global_offset)]
        _check(sh.data.dtype == torch.float32, sh.key)
        _check(torch.equal(sh.data.to(model_value.dtype), model_value),
               f"{sh.key} {sh.global_offset}: another parameter's state")
        checked += 1
    _check(checked == len(core.params), f"{checked} of {len(core.params)} parameters checked")


def _sharded_tensors(sd):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]


def _check_the_fix_keeps_the_updates(kind: str):
    """With and without ``make_fp32_params_checkpointable``, the same training steps give the
    same parameters, bit for bit (it changes only what checkpoints see)."""
    fixed, unfixed = _Core(kind), _Core(kind, fix=False)
    for step in (1, 2, 3):
        _check(fixed.step(step) == unfixed.step(step), f"{kind}: step {step} loss differs")
    _same(unfixed.snapshot(), fixed.snapshot(), f"{kind}: fixed vs unfixed parameters")


def _check_megatron_still_fails_without_the_fix(kind: str):
    core = _Core(kind, fix=False)
    core.step(1)
    try:
        core.sharded_state_dict("dp_reshardable" if kind == "distributed" else None)
    except (KeyError, ValueError, AssertionError):
        return
    raise AssertionError(
        f"Megatron's {kind} optimiser now builds the sharded state of a bf16 model with fp32 "
        "parameters by itself: check whether mhc_megatron.training.fp32_params is still needed")


def _core_main(tmp: str) -> None:
    from megatron.core import parallel_state

    from mhc_testing import cpu_training

    cpu_training.install()  # the process-wide CUDA -> CPU shims Megatron's optimisers need
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    for kind in ("float16", "distributed"):
        core = _Core(kind)
        _check_training_invariants(core)
        if kind == "distributed":
            _check_model_space_state_belongs_to_its_parameter(core)
        _check_the_fix_keeps_the_updates(kind)
        _check_megatron_still_fails_without_the_fix(kind)
        _check_resume(kind, Path(tmp))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print("CORE CHECKS PASSED", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "pretrain":
        _pretrain_main(rest)
    elif mode == "core":
        _core_main(*rest)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
