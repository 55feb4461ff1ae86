"""The main job (smoke preset) and the kernel-backend dispatch."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from mhc_megatron.kernels import REFERENCE_OPS, dispatch, reference, select_ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))


@pytest.fixture
def demo(megatron_single_rank):
    """The demo module; its main() enables TF32 on CUDA, restored for the tests after it."""
    import train_gpt_mhc

    tf32 = torch.backends.cuda.matmul.allow_tf32
    yield train_gpt_mhc
    torch.backends.cuda.matmul.allow_tf32 = tf32


def test_demo_smoke(demo, tmp_path):
    results = demo.main(["--preset", "smoke", "--corpus-mb", "2", "--out", str(tmp_path)])
    assert [r.name for r in results] == ["baseline", "mHC n=4"]
    for r in results:
        assert len(r.train_loss) == 6 and all(math.isfinite(v) for v in r.train_loss)
        assert r.val_loss[-1] < math.log(256)  # better than uniform bytes
    assert results[1].params > results[0].params  # the mHC mappings exist
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    assert (tmp_path / "results.json").exists()


def test_demo_hybrid_smoke(demo, tmp_path):
    """``--model hybrid``: the GPT's layers as Megatron's HybridModel (``"*-"`` per layer).
    Its baseline is Megatron's hybrid model of the GPT's layers, which is the GPT: the same
    weights in the same order and the same function, so every loss equals the GPT demo's
    baseline, bit for bit. The mHC run has as many parameters as the GPT's (one
    hyper-connection per sublayer either way) and learns."""
    smoke = ["--preset", "smoke", "--corpus-mb", "2"]
    hybrid = demo.main([*smoke, "--model", "hybrid", "--out", str(tmp_path / "hybrid")])
    gpt = demo.main([*smoke, "--out", str(tmp_path / "gpt")])
    assert [r.name for r in hybrid] == ["baseline", "mHC n=4"]
    for r in hybrid:
        assert len(r.train_loss) == 6 and all(math.isfinite(v) for v in r.train_loss)
        assert r.val_loss[-1] < math.log(256)
    assert (hybrid[0].train_loss, hybrid[0].val_loss) == (gpt[0].train_loss, gpt[0].val_loss)
    assert [r.params for r in hybrid] == [r.params for r in gpt]
    assert hybrid[1].params > hybrid[0].params


def test_demo_stops_at_the_first_non_finite_loss(demo, monkeypatch, tmp_path):
    """The steps leave their losses on the device; the evaluation after them reads them back
    and stops the run at the first one that is not finite, naming its step (the smoke preset
    evaluates after step 3: step 2's loss is made NaN, step 3's follows from its update)."""
    build = demo.build_model

    def build_with_nan_at_second_forward(*args, **kwargs):
        model, forwards = build(*args, **kwargs), []

        def poison(module, inputs, output):
            forwards.append(None)
            return output * float("nan") if len(forwards) == 2 else output

        model.register_forward_hook(poison)
        return model

    monkeypatch.setattr(demo, "build_model", build_with_nan_at_second_forward)
    with pytest.raises(RuntimeError, match=r"^baseline: loss became nan at step 2$"):
        demo.main(["--preset", "smoke", "--corpus-mb", "2", "--out", str(tmp_path)])


def test_demo_bf16_with_master_weights(demo, tmp_path):
    results = demo.main(["--preset", "smoke", "--corpus-mb", "2", "--precision", "bf16",
                         "--out", str(tmp_path)])
    for r in results:
        assert all(math.isfinite(v) for v in r.train_loss) and r.val_loss[-1] < math.log(256)


def test_demo_fp8_needs_transformer_engine_spec(demo, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--precision", "fp8"])
    assert "--precision fp8 needs --spec te" in capsys.readouterr().err


def test_reference_backend():
    assert select_ops("reference", torch.zeros(2, 4, 8)) is REFERENCE_OPS


def test_triton_backend_refuses_clearly(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"mhc_kernel_backend='triton' cannot run: .*"
                       r"need a CUDA device.*Fix: "):
        select_ops("triton", torch.zeros(2, 4, 8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match=r"n=3 streams; supported n: \(1, 2, 4, 8\)"):
        select_ops("triton", torch.zeros(2, 3, 8))
    with pytest.raises(RuntimeError, match="dtype torch.float64"):
        select_ops("triton", torch.zeros(2, 4, 8, dtype=torch.float64))
    assert select_ops("triton", torch.zeros(2, 4, 8)).name == "triton"


def test_fused_kernels_run_every_mapping_form(monkeypatch):
    """DeepSeek-V4's mapping form (or H_res transposed) runs on the fused kernels too: the
    form does not change the choice ('triton' takes it, the reference too)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(2, 4, 8)
    for form in (reference.MappingForm("deepseek_v4"), reference.MappingForm(transposed=True),
                 reference.MappingForm("deepseek_v4", transposed=True), reference.PAPER):
        assert select_ops("triton", x, form=form).name == "triton"
        assert select_ops("reference", x, form=form) is REFERENCE_OPS


def test_auto_falls_back_and_says_so_once(caplog):
    dispatch._announced.clear()
    with caplog.at_level(logging.INFO, logger="mhc_megatron.kernels.dispatch"):
        for _ in range(3):
            assert select_ops("auto", torch.zeros(2, 4, 8)) is REFERENCE_OPS
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "runs the reference ops on cpu" in messages[0]
    assert "CUDA device" in messages[0]  # why: "auto" runs Triton on CUDA tensors only


def test_unknown_backend():
    with pytest.raises(ValueError, match="mhc_kernel_backend='cuda' is unknown"):
        select_ops("cuda", torch.zeros(1, 1, 1))


def test_pre_equals_mappings_then_aggregate():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 8, generator=g)
    phi = torch.randn(24, 32, generator=g) * 0.1
    alpha, bias = torch.rand(3, generator=g), torch.randn(24, generator=g)
    y, h_pre, h_post, h_res = REFERENCE_OPS.pre(x, phi, alpha, bias, 20, 1e-6)
    p2, q2, r2 = reference.compute_mappings(x, phi, alpha, bias, 20, 1e-6)
    torch.testing.assert_close(y, reference.aggregate(x, p2))
    for a, b in zip((h_pre, h_post, h_res), (p2, q2, r2)):
        torch.testing.assert_close(a, b)


_LOGGING_SCENARIOS = """
import logging, os, sys, torch
from mhc_megatron.kernels import dispatch, select_ops

def scenario(name):
    dispatch._announced.clear()
    print("@@" + name, file=sys.stderr, flush=True)
    select_ops("auto", torch.zeros(2, 4, 8))

os.environ["RANK"] = "1"
scenario("rank1")                       # rank 0 only
os.environ["RANK"] = "0"
scenario("unconfigured")                # no logging configured at all: still shown
logging.basicConfig(level=logging.WARNING)
scenario("user-handlers")               # the user's root handler shows it, ours stays quiet
logging.getLogger("mhc_megatron").setLevel(logging.WARNING)
scenario("opted-out")
"""


def test_backend_choice_shows_by_default_on_rank0():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "-c", _LOGGING_SCENARIOS], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    said = {part.split("\n", 1)[0]: part.count("mhc_kernel_backend='auto' runs the reference ops "
                                                "on cpu") for part in run.stderr.split("@@")[1:]}
    assert said == {"rank1": 0, "unconfigured": 1, "user-handlers": 1, "opted-out": 0}, run.stderr
