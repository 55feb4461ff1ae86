"""Multi-rank equivalence tests: each launches a script of ``tests/distributed/`` on 2 or 4
ranks (``helpers.start_ranks``: torchrun, or on a host without CUDA and TE ranks forked from a
process that imported torch and Megatron once).

Set-ups (``tests/distributed/harness.py``):
- ``cpu``: 2 CPU ranks over gloo with the reference ops (CI; also on a GPU host);
- ``cuda-te`` / ``cuda-local``: 2 GPUs over NCCL with the Triton kernels, with Transformer
  Engine's specs (where TE is installed) and with Megatron's local modules. Skipped with fewer
  than 2 CUDA devices.
The 3-D layout (TP=2 x PP=2) runs on 4 ranks: 4 CPU processes, or 4 GPUs (skipped with fewer).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import (
    HAVE_TE,
    child_env,
    run_ranks,
    single_grouped_step,
    te_single_grouped_weight_unsupported,
)

HERE = os.path.dirname(os.path.abspath(__file__))

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
needs_2_gpus_te = pytest.mark.skipif(torch.cuda.device_count() < 2 or not HAVE_TE,
                                     reason="needs 2 CUDA devices and Transformer Engine")
needs_4_gpus = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
needs_4_gpus_te = pytest.mark.skipif(torch.cuda.device_count() < 4 or not HAVE_TE,
                                     reason="needs 4 CUDA devices and Transformer Engine")
SETUPS = ["cpu", pytest.param("cuda-local", marks=needs_2_gpus),
          pytest.param("cuda-te", marks=needs_2_gpus_te)]
SETUPS_4 = ["cpu", pytest.param("cuda-local", marks=needs_4_gpus),
            pytest.param("cuda-te", marks=needs_4_gpus_te)]
ENV = {"cpu": {"MHC_DIST_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""},
       "cuda-local": {"MHC_DIST_DEVICE": "cuda", "MHC_DIST_TE": "0"},
       "cuda-te": {"MHC_DIST_DEVICE": "cuda", "MHC_DIST_TE": "1"}}


def _torchrun(script: str, setup: str, *args: str, timeout: int = 600, nproc: int = 2) -> str:
    run = run_ranks(nproc, os.path.join(HERE, "distributed", script), *args,
                    env=child_env(**ENV[setup]), timeout=timeout)
    assert run.returncode == 0, f"{script} [{setup}] failed (rc={run.returncode}):\n{run.stdout[-6000:]}"
    print("\n".join(line for line in run.stdout.splitlines() if line.startswith("PASS")))
    return run.stdout


def _expect(out: str, lines: list[str], ranks: int = 2) -> None:
    for rank in range(ranks):
        for line in lines:
            assert re.search(rf"PASS rank={rank} {line}", out), f"missing 'PASS rank={rank} {line}':\n{out[-3000:]}"


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_tensor_parallel_matches_single_rank(setup):
    """TP=2 (+SP, + mHC recompute, + Megatron's full recompute; dense and MoE) == TP=1: loss
    and every gradient."""
    out = _torchrun("tp_equivalence.py", setup)
    _expect(out, [f"kind={kind} sp={sp} recompute={rc} "
                  for kind, sp, rc in (("dense", False, False), ("dense", True, False),
                                       ("moe", True, False), ("dense", True, True),
                                       ("moe", True, True), ("dense", False, "full"),
                                       ("moe", True, "full"), ("dsv4", True, False))])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_expert_parallel_matches_single_rank(setup):
    """MoE with EP=2 == EP=1: per-rank loss, expert and dense gradients, mHC's included; with
    TE also with the experts as one grouped weight (``moe_single_grouped_weight``)."""
    out = _torchrun("ep_equivalence.py", setup)
    dispatchers = ["allgather"] + (["alltoall"] if setup != "cpu" else [])
    _expect(out, [f"ep=2 dispatcher={d} recompute={rc} " for d in dispatchers for rc in (False, True)])


@pytest.mark.distributed
@needs_2_gpus_te
def test_expert_parallel_single_grouped_weight(tmp_path):
    """Megatron-Core 0.19.2's single grouped expert weight (``moe_single_grouped_weight``, TE's
    one parameter for the local experts): EP=2 == EP=1 within bf16 noise, the baseline's own
    errors beside mHC's, and its checkpoint reshards EP=2 <-> EP=1 with bitwise weights.
    Skipped where TE cannot run it (its grouped-tensor GEMM path: the reason names the GPU's
    compute capability and cuBLASLt version)."""
    reason = te_single_grouped_weight_unsupported()
    if reason is not None:
        pytest.skip(reason)
    base, base_error = single_grouped_step(mhc=False)  # Megatron's own model, one GPU
    if base is None:
        pytest.xfail("TE cannot run Megatron's own model with the single grouped expert weight "
                     f"on this GPU: {base_error}")
    out = _torchrun("ep_equivalence.py", "cuda-te", "single_grouped")
    _expect(out, ["ep=2 dispatcher=alltoall single_grouped=True "])
    out = _torchrun("ckpt_reshard.py", "cuda-te", str(tmp_path), "single_grouped")
    _expect(out, [f"kind=moe_single_grouped EP={a}->EP={b} " for a, b in ((2, 1), (1, 2))])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_dist_checkpoint_reshards_between_tp2_and_tp1(setup, tmp_path):
    """Saved at TP=2, loaded at TP=1 (DP=2), and back; MoE saved at EP=2, loaded at EP=1, and
    back (with TE the experts run TE's grouped GEMM): bitwise weights, the same logits."""
    out = _torchrun("ckpt_reshard.py", setup, str(tmp_path))
    _expect(out, [f"kind={kind} TP={a}->TP={b} " for kind in ("dense", "moe")
                  for a, b in ((2, 1), (1, 2))]
            + [f"kind=moe EP={a}->EP={b} " for a, b in ((2, 1), (1, 2))])


@pytest.mark.distributed
@needs_2_gpus_te
def test_context_parallel_matches_single_rank():
    """CP=2 with TE's attention == CP=1 (bf16): loss and every gradient."""
    out = _torchrun("cp_equivalence.py", "cuda-te")
    _expect(out, ["cp=2 kind=dense recompute=False ", "cp=2 kind=dense recompute=True ",
                  "cp=2 kind=moe recompute=False "])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", [s for s in SETUPS if s != "cpu"])
def test_expert_parallel_overlap_matches_plain_schedule(setup):
    """EP=2 with Megatron's EP-overlap schedule (``overlap_moe_expert_parallel_comm``, its
    combined 1F1B schedule) == EP=2 without it: every micro-batch loss and every step's grad
    norm over 3 optimizer steps (bf16, dense and MoE layers, with an MTP depth; with TE also
    with ``delay_wgrad_compute``), within 3x the baseline's own difference or bf16 noise.
    GPUs only (CUDA streams, alltoall)."""
    out = _torchrun("ep_overlap_equivalence.py", setup)
    kinds = ("mix", "mtp") + (("delay_wgrad",) if setup == "cuda-te" else ())
    _expect(out, [f"ep=2 overlap kind={kind} " for kind in kinds])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_fully_sharded_data_parallel_matches_ddp(setup, tmp_path):
    """torch FSDP2 through Megatron's ``TorchFullyShardedDataParallel`` (and on GPUs
    Megatron-FSDP, ``optim_grads_params`` and ``optim_grads``) at DP=2 == Megatron's DDP at
    DP=2: every step's loss and grad norm over 3 Adam steps (fp32; on GPUs also bf16), the mHC
    parameters sharded (DTensors) and updated; the baseline's differences beside. A checkpoint
    in the format Megatron saves it in (FSDP2: torch DCP; on GPUs also Megatron-FSDP's
    ``fsdp_dtensor``) loads into a plain model to the same logits, bit for bit."""
    out = _torchrun("fsdp_equivalence.py", setup, str(tmp_path))
    _expect(out, ["fsdp2 checkpoint -> plain model "])
    if setup == "cpu":
        _expect(out, ["fsdp2 dp=2 bf16=False "])
    else:
        _expect(out, [f"{w} dp=2 bf16={b} " for w in ("fsdp2", "megatron_fsdp_optim_grads_params",
                                                      "megatron_fsdp_optim_grads")
                      for b in (False, True)])
        _expect(out, ["megatron_fsdp_optim_grads_params checkpoint -> plain model "])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", [s for s in SETUPS if s != "cpu"])
def test_megatron_fsdp_at_tensor_parallel_2_matches_ddp(setup):
    """TP=2 (DP=1) under Megatron-FSDP (``optim_grads_params``) == TP=2 under Megatron's DDP:
    every step's loss and grad norm over 3 Adam steps (fp32 and bf16; the baseline's
    differences beside), and the mHC parameters, which its module registry classifies as
    replicated over tensor parallelism, equal on both TP ranks after the steps. GPUs only
    (Megatron-FSDP is CUDA-only)."""
    out = _torchrun("fsdp_equivalence.py", setup, "tp")
    _expect(out, [f"megatron_fsdp_optim_grads_params tp=2 bf16={b} {what}"
                  for b in (False, True) for what in ("", "mHC parameters replicated")])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_pipeline_parallel_matches_single_rank(setup):
    """PP=2 (1F1B) and PP=2 x 2 virtual stages (interleaved) == PP=1 through Megatron's own
    schedules, 4 micro-batches: every micro-batch loss and every gradient, dense, MoE and with
    an MTP depth on the last stage, with and without mHC recompute (its blocks counted per
    pipeline chunk), and with DeepSeek-V4's conventions (``mhc_variant="deepseek_v4"``: output
    heads; with an MTP depth, and over 2 virtual stages)."""
    out = _torchrun("pp_equivalence.py", setup)
    _expect(out, [f"pp=2 vp={vp} kind={kind} recompute={rc} "
                  for kind, vp, rc in (("dense", None, False), ("dense", 2, False),
                                       ("moe", None, False), ("moe", 2, False),
                                       ("dense", None, True), ("dense", 2, True),
                                       ("moe", None, True), ("mtp", None, False),
                                       ("mtp", None, True), ("dsv4", None, False),
                                       ("dsv4_dense", 2, False))])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS_4)
def test_tensor_x_pipeline_parallel_matches_single_rank(setup):
    """TP=2 x PP=2 on 4 ranks (1F1B, 4 micro-batches) == 1 rank: every micro-batch loss and
    every gradient, mHC's included; dense without and with sequence parallelism, MoE with it,
    with and without mHC recompute."""
    out = _torchrun("parallel3d_equivalence.py", setup, nproc=4)
    _expect(out, [f"tp=2 pp=2 kind={kind} sp={sp} recompute={rc} "
                  for kind, sp, rc in (("dense", False, False), ("dense", True, False),
                                       ("dense", True, True), ("moe", True, False),
                                       ("moe", True, True))], ranks=4)
