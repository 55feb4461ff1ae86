"""Megatron's DDP with the distributed optimiser and ``overlap_param_gather``: after a step,
each rank holds only its shard of the new parameters, and the all-gather of every bucket
group runs behind the forward pre-hook of the modules whose parameters it holds (DDP hooks
every module; the hook waits for the group's all-gather and dispatches the next). The mHC
mapping parameters live in :class:`HyperConnectionModule`, whose ``pre`` reads them: it runs
through the module call, so that the hook has waited before.

Two ranks, CPU over gloo (CI) or one GPU each over NCCL with the Triton kernels (where two
GPUs are visible: there the all-gathers are truly asynchronous), buckets of a few parameters
(the mapping parameters in bucket groups of their own, so nothing else waits for them): three
steps with the overlap give the losses and parameters of three steps without it, bit for bit
(the gradients' reduce-scatter is not overlapped in either run: only the parameters'
all-gather differs). A ``pre`` that read the mapping parameters outside the module call
would leave their all-gathers dispatched and never waited for (Megatron asserts at the next
step's dispatch), and with larger buckets it could read another rank's shard of the mapping
parameters before the new values arrive.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # the torchrun processes: the multi-rank tests' harness picks the device (MHC_DIST_DEVICE)
    # and hides TE from CPU ranks (Megatron's optimisers would take TE's CUDA-only
    # multi-tensor kernels whenever TE is importable)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
    import harness

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import child_env, run_ranks  # noqa: E402

THIS = Path(__file__).resolve()
STEPS = 3


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)"))])
def test_overlap_param_gather_equals_synchronous_gather(device):
    run = run_ranks(2, THIS, env=child_env(cpu_only=device == "cpu", MHC_DIST_DEVICE=device),
                    timeout=300)
    assert run.returncode == 0 and "PARAM GATHER CHECKS PASSED" in run.stdout, \
        run.stdout[-6000:]


# ---------------------------------------------------------------------------------------
# What the torchrun processes run.
# ---------------------------------------------------------------------------------------

def _train(overlap: bool, device: str):
    """Three steps of a tiny bf16 mHC GPT in Float16Module + DDP + the distributed
    optimiser, on ``device`` (reference ops on CPU, Triton kernels on CUDA): (per-step
    losses, final parameters, the HyperConnectionModule forward pre-hook calls)."""
    sys.path.insert(0, str(THIS.parent))
    from helpers import batch, build_gpt, lm_loss, tiny_config
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mhc_megatron.layers.hyper_connection import HyperConnectionModule

    torch.manual_seed(1234)
    config = tiny_config(bf16=True, params_dtype=torch.bfloat16, num_layers=2,
                         mhc_kernel_backend=harness.KERNELS)
    model = Float16Module(config, build_gpt(config, device=device))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_param_gather=overlap,
        overlap_grad_reduce=False, bucket_size=2000), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True,
                                                 use_distributed_optimizer=True), [ddp])
    hooked = []
    for module in ddp.modules():
        if isinstance(module, HyperConnectionModule):
            module.register_forward_pre_hook(lambda *_: hooked.append(1))
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = lm_loss(ddp, batch(seed=100 * step + rank, device=device))
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        losses.append(loss.detach())
    if overlap:  # the last step's gathers, as Megatron's loop does before a checkpoint
        ddp.disable_forward_pre_hook(param_sync=True)
    params = {name: p.detach().clone() for name, p in ddp.named_parameters()}
    return losses, params, len(hooked)


def _main() -> None:
    device = harness.DEVICE
    if device == "cpu":
        from mhc_testing import cpu_training

        cpu_training.install()  # the process-wide CUDA -> CPU shims Megatron's optimisers need
    harness.init()  # gloo on CPU ranks, NCCL with one GPU a rank
    harness.init_parallel(tp=1)  # and Megatron's RNG tracker (its attention forks it)
    sync_losses, sync_params, sync_calls = _train(overlap=False, device=device)
    losses, params, calls = _train(overlap=True, device=device)
    for step, (a, b) in enumerate(zip(losses, sync_losses)):
        assert torch.equal(a, b), (step, a.item(), b.item())
    assert params.keys() == sync_params.keys()
    for name in params:
        assert torch.equal(params[name], sync_params[name]), name
    # every pre through the module call: 2 layers x 2 sublayers x STEPS
    assert sync_calls == calls == 4 * STEPS, (sync_calls, calls)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        import mhc_megatron  # which copy of the package ran (e.g. a mutated copy under test)

        print(f"PARAM GATHER CHECKS PASSED ({device}, losses {[x.item() for x in losses]}, "
              f"package {Path(mhc_megatron.__file__).parent})", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _main()
