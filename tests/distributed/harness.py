"""What every multi-rank equivalence script shares: device, spec family, parallel state.

The scripts run under ``torchrun --nproc-per-node=2`` (4 for the 3-D layout), or forked by
``fork_ranks.py`` with torchrun's variables (``tests/test_distributed.py`` on a host without
CUDA and TE), in one of two set-ups chosen by the launcher through the environment:

- ``MHC_DIST_DEVICE=cpu`` (CI): CPU ranks over gloo with the reference ops. Transformer
  Engine is hidden from the process: Megatron's TE code paths are CUDA-only (its MoE router
  runs TE's GEMM whenever TE is importable), so Megatron's local modules run.
- ``MHC_DIST_DEVICE=cuda``: one GPU a rank over NCCL with the Triton kernels. TE specs where
  TE is installed and ``MHC_DIST_TE`` is not ``0``; Megatron's local modules otherwise.

Import this module first: it hides TE before Megatron is imported.
"""

from __future__ import annotations

import os
import sys

DEVICE = os.environ.get("MHC_DIST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise SystemExit(f"MHC_DIST_DEVICE must be cpu or cuda, got {DEVICE!r}")
if DEVICE == "cpu" or os.environ.get("MHC_DIST_TE") == "0":
    sys.modules["transformer_engine"] = None  # Megatron's local modules, also on a TE host

if DEVICE == "cuda":
    # Equivalence of parallel layouts, not of TF32 roundings: TE's GEMMs take TF32 for fp32
    # operands whatever torch's allow_tf32 says; cuBLAS reads this before its first handle
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from helpers import HAVE_TE, build_gpt, sequence_parallel_capable_spec, tiny_config  # noqa: E402
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec  # noqa: E402
from mhc_testing.cpu import init_single_process_group, setup_cpu_megatron  # noqa: E402

USE_TE = DEVICE == "cuda" and HAVE_TE and os.environ.get("MHC_DIST_TE") != "0"
# MHC_DIST_KERNELS=reference runs the PyTorch reference ops on CUDA ranks too (to tell a
# kernel's rounding from the layout's in a mismatch)
KERNELS = os.environ.get("MHC_DIST_KERNELS") or ("triton" if DEVICE == "cuda" else "reference")
if KERNELS not in ("triton", "reference"):
    raise SystemExit(f"MHC_DIST_KERNELS must be triton or reference, got {KERNELS!r}")
SPEC_FAMILY = "te" if USE_TE else "local"


def init(world_size: int = 2, cuda_to_cpu: bool = False) -> None:
    """The process group (gloo on CPU ranks, NCCL on GPUs; one GPU a rank). ``cuda_to_cpu``:
    on CPU ranks, redirect Megatron's ``device="cuda"`` allocations (its pipeline schedules)."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("MHC_DIST_DEVICE=cuda but no CUDA device is visible")
    if DEVICE == "cpu" and cuda_to_cpu:
        from mhc_testing import cpu_training

        cpu_training.install_cuda_to_cpu()
    init_single_process_group()
    assert torch.distributed.get_world_size() == world_size, \
        f"run with torchrun --nproc-per-node={world_size}"
    if DEVICE == "cuda":
        # Equivalence of parallel layouts, not of TF32 roundings: full fp32 GEMMs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def init_parallel(tp: int = 1, ep: int = 1, cp: int = 1, pp: int = 1, vp=None,
                  seed: int = 1234) -> None:
    """(Re)build Megatron's model-parallel state and reseed every RNG it uses."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp,
                                             expert_model_parallel_size=ep,
                                             context_parallel_size=cp)
    setup_cpu_megatron(seed=seed)


def config(**overrides):
    """The tests' tiny mHC config on this set-up's kernels (fp32 unless overridden)."""
    return tiny_config(mhc_kernel_backend=KERNELS, **overrides)


def model(cfg):
    """An mHC GPT of ``cfg`` on this rank's device, with this set-up's spec family.

    Local specs use norms that accept ``sequence_parallel`` (Megatron's torch norm refuses it;
    its SP-capable norms need apex or TE); TE specs use TE's own norms."""
    if USE_TE:
        spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=True)
    else:
        spec = sequence_parallel_capable_spec(cfg)
    return build_gpt(cfg, device=DEVICE, spec=spec)


def describe() -> str:
    return f"device={DEVICE} spec={SPEC_FAMILY} kernels={KERNELS}"


def worst_errors(errors: dict[str, float], k: int = 3) -> str:
    """The ``k`` largest of ``{name: relative error}`` as ``name=err`` (a mismatch's context)."""
    top = sorted(errors.items(), key=lambda item: -item[1])[:k]
    return " ".join(f"{name}={err:.1e}" for name, err in top)


def format_errors(errors: dict[str, float], baseline: dict[str, float] | None) -> str:
    """``name=err`` for each of mHC's ``errors``, then the baseline's (the same comparison
    without mHC: the layout's own rounding) as ``baseline_name=err``."""
    parts = [f"{k}={v:.2e}" for k, v in errors.items()]
    parts += [f"baseline_{k}={v:.2e}" for k, v in (baseline or {}).items()]
    return " ".join(parts)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


# bf16 comparisons: the error against an fp32 run of the same weights may be at most
# NOISE_FACTOR times the bf16 reference's own error against it, plus FLOOR (relative).
NOISE_FACTOR = 3.0
FLOOR = 5e-3


def check_within_bf16_noise(loss: float, loss16: float, loss32: float, grads: dict,
                            grads16: dict, grads32: dict, label: str) -> tuple[dict, str]:
    """A bf16 layout's ``loss`` and ``grads`` ({name: tensor}) against an fp32 run of the same
    weights (``loss32``, ``grads32``: the truth), bounded per tensor by the bf16 reference's
    own error against the truth (``loss16``, ``grads16``: the rounding noise) times
    NOISE_FACTOR, plus FLOOR. bf16 rounding alone moves small reductions (a 3-element
    gradient) by a few per cent, so a fixed bf16 tolerance is either loose or flaky; a wrong
    layout gives errors of order 1. Returns ``({"loss_rel_err", "worst_grad_vs_noise"},
    the worst gradient's description)``."""
    loss_err, noise = abs(loss - loss32), abs(loss16 - loss32)
    assert loss_err <= NOISE_FACTOR * noise + FLOOR * abs(loss32), \
        f"[{label}] loss {loss} vs fp32 {loss32} (the bf16 reference: {loss16})"
    worst, worst_name = 0.0, ""
    for n, g in grads.items():
        err, noise = relative_error(g, grads32[n]), relative_error(grads16[n], grads32[n])
        assert err <= NOISE_FACTOR * noise + FLOOR, (
            f"[{label}] grad of {n}: relative error {err:.2e} against fp32, the bf16 "
            f"reference has {noise:.2e}")
        ratio = err / (noise + FLOOR)
        if ratio > worst:
            worst, worst_name = ratio, f"{n}: {err:.2e} vs bf16 noise {noise:.2e}"
    return {"loss_rel_err": loss_err / abs(loss32), "worst_grad_vs_noise": worst}, worst_name


def full_params(model, name=lambda n: n) -> dict:
    """Every parameter of ``model`` as the whole tensor (TP shards all-gathered along
    ``partition_dim``), keyed by ``name(parameter name)``."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            torch.distributed.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name(n)] = t.clone()
    return out


def reference_tensor(part, tensors: dict):
    """The EP=1 reference's tensor for an EP=2 parameter: ``part`` its EP=1 name, or a
    function of the EP=1 tensors (a slice of a grouped tensor)."""
    return part(tensors) if callable(part) else tensors[part]


def ep_grad_errors(model, names: dict, ref_grads: dict, label: str) -> float:
    """Compare every gradient of an EP=2 ``model`` with the EP=1 reference's (``names``: this
    model's parameter name -> the reference's, see :func:`reference_tensor`): dense parameters
    summed over the two (data parallel) ranks first, expert parameters as they are. Returns
    the worst relative error."""
    worst = 0.0
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "allreduce", True):  # dense params: DP's sum over the two ranks
            torch.distributed.all_reduce(g)
        else:
            assert ".experts." in n, n
        expect = reference_tensor(names[n], ref_grads)
        torch.testing.assert_close(g, expect, rtol=2e-4, atol=2e-6,
                                   msg=lambda m, n=n: f"[{label}] grad of {n}: {m}")
        worst = max(worst, relative_error(g, expect))
    return worst


def data_parallel_reference(model, data):
    """The EP=1 reference of an EP=2 comparison, run on each rank's own batch: the loss, the
    parameters, and every gradient summed over the two (data parallel) ranks."""
    from helpers import lm_loss

    loss = lm_loss(model, data)
    loss.backward()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        torch.distributed.all_reduce(g)
        grads[n] = g
    return loss, params, grads

