"""The examples' command lines and console output: ``--help`` works, Megatron's flags and
ours (the "mHC" group) are listed, and the demo prints our lines and Megatron's essential
ones, with log lines above the progress bar, not in it."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
from helpers import LOCAL_MODULE_FLAGS, ROOT, TINY_GPT_FLAGS, child_env, run_child

EXAMPLES = ROOT / "examples"


def _quiet_env() -> dict:
    """A CPU child's environment with Python's warnings as a user gets them (child_env turns
    them off)."""
    env = child_env(cpu_only=True)
    env.pop("PYTHONWARNINGS")
    return env


def test_pretrain_help_lists_the_mhc_group():
    proc = run_child([sys.executable, str(EXAMPLES / "pretrain_gpt_mhc.py"), "--help"],
                     _quiet_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = proc.stdout
    assert out.startswith("usage: pretrain_gpt_mhc.py"), out[:2000]  # no notices before it
    group = out[out.index("\nmHC:\n"):]
    for flag in ("--enable-hyper-connections", "--num-residual-streams",
                 "--mhc-sinkhorn-iterations", "--mhc-kernel-backend", "--mhc-params-dtype"):
        assert flag in group, flag
    assert "\npretrain_gpt_mhc.py:\n" in out and "--log-micro-batch-loss" in out
    assert "--moe-paged-stash-buffer-size-factor-cuda" in out  # Megatron's flags too


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_demo_output_is_ours_and_megatrons_essential_lines(tmp_path, model):
    """No third-party notices; Megatron's GPTModel deprecation once (two GPTs are built;
    none for its successor HybridModel, ``--model hybrid``); the kernel-backend line starts
    a line of its own, above the progress bar."""
    proc = run_child([sys.executable, str(EXAMPLES / "train_gpt_mhc.py"), "--preset", "smoke",
                      "--corpus-mb", "2", "--out", str(tmp_path), "--model", model],
                     _quiet_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    segments = re.split(r"[\r\n]", proc.stdout)
    assert segments[0].startswith("corpus: "), proc.stdout[:2000]
    assert ("model: HybridModel '*-*-'" in segments[0]) == (model == "hybrid"), segments[0]
    assert "Warning" not in proc.stdout and "warnings.warn" not in proc.stdout, proc.stdout
    assert "No CUDA runtime" not in proc.stdout
    assert proc.stdout.count("GPTModel IS DEPRECATED") == (1 if model == "gpt" else 0)
    backend = [s for s in segments if "mhc_kernel_backend='auto'" in s]
    assert len(backend) == 1 and backend[0].lstrip().startswith("[mhc_megatron.kernels.dispatch]")
    assert "mHC - baseline final val loss" in proc.stdout


def test_demo_plot_title_names_the_mapping_storage():
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt_mhc

    label = train_gpt_mhc.mhc_params_label
    assert label(SimpleNamespace(mhc_params="fp32", precision="bf16")) == "mHC mappings in fp32"
    assert label(SimpleNamespace(mhc_params="params", precision="bf16")) == \
        "mHC mappings in bf16 (params dtype)"
    assert "params params" not in label(SimpleNamespace(mhc_params="params", precision="fp32"))


@pytest.mark.parametrize("script", ["examples/generate_mhc.py", "benchmarks/bench_ep_overlap.py",
                                    "benchmarks/bench_inference.py"])
def test_gpu_scripts_parse_their_arguments_on_cpu(script):
    """The GPU-only scripts import and print their usage on a machine without CUDA."""
    proc = run_child([sys.executable, str(ROOT / script), "--help"], _quiet_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:2000]


def test_generate_stops_before_the_model_where_the_engines_cannot_run():
    """Without a CUDA device generate_mhc.py exits before it builds a model, with the
    requirement named (Megatron's engines would otherwise fail in the first forward)."""
    proc = run_child([sys.executable, str(EXAMPLES / "generate_mhc.py"), *TINY_GPT_FLAGS,
                      *LOCAL_MODULE_FLAGS, "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "257", "--micro-batch-size", "1", "--prompts", "x"],
                     _quiet_env(), timeout=300)
    assert proc.returncode != 0
    assert ("generate_mhc.py: Megatron-Core's inference engines need a CUDA device"
            in proc.stdout), proc.stdout[-4000:]


def test_engine_requirements_name_flashattention_and_einops(monkeypatch):
    """What the engines need beyond a GPU, each named with its install, as Megatron checks it
    (attention.py's FA4 / FA3 / flash-attn >= 2.7.3 assert; einops' ``rearrange``)."""
    import megatron.core.utils
    from megatron.core.transformer import attention

    from mhc_megatron.training.inference import inference_engines_unavailable

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(attention, "HAVE_FA4", False)
    monkeypatch.setattr(attention, "HAVE_FA3", False)

    def no_flash_attn(version):
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(megatron.core.utils, "is_fa_min_version", no_flash_attn)
    reason = inference_engines_unavailable()
    assert reason.startswith("FlashAttention") and "pip install flash-attn-4" in reason, reason
    monkeypatch.setattr(attention, "HAVE_FA4", True)
    monkeypatch.setattr(attention, "rearrange", None)
    assert inference_engines_unavailable().startswith("einops"), inference_engines_unavailable()
    monkeypatch.setattr(attention, "rearrange", lambda *a, **k: None)
    assert inference_engines_unavailable() is None


def test_the_demo_optimiser_keeps_fp32_parameters_as_their_own_masters():
    """MasterWeightAdamW on bf16 and fp32 parameters: the same bits as AdamW on fp32 master
    copies of every parameter (grads copied up and clipped together, bf16 weights rounded
    back); an fp32 parameter is updated in place, with no master copy of its own."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    import train_gpt_mhc as demo

    g = torch.Generator().manual_seed(0)
    shapes = [((4, 6), torch.bfloat16), ((6,), torch.float32), ((3, 3), torch.float32),
              ((5,), torch.bfloat16)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in shapes]
    grads = [[torch.randn(s, generator=g).to(d) for s, d in shapes] for _ in range(3)]
    reference = [p.detach().float().clone() for p in params]
    adamw = dict(lr=1e-2, betas=(0.9, 0.95))
    ref_opt = torch.optim.AdamW([{"params": reference, "weight_decay": 0.1}], **adamw)
    opt = demo.MasterWeightAdamW([{"params": params, "weight_decay": 0.1}], clip=0.5, **adamw)
    assert [m is p for m, p in zip(opt.master, params)] == [False, True, True, False]
    for step in grads:
        opt.zero_grad()
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
        for m, gr in zip(reference, step):
            m.grad = gr.float()
        torch.nn.utils.clip_grad_norm_(reference, 0.5)
        ref_opt.step()
        for p, m in zip(params, reference):
            assert torch.equal(p.detach(), m.to(p.dtype))
