"""Transformer Engine paths that only exist with TE: fp8 GEMMs around the mHC math, and the
single grouped expert weight (``moe_single_grouped_weight``) on one GPU.

Runs where TE and a CUDA device are present (the GPU host), skipped elsewhere. The layer,
model and recompute tests run with TE specs too (``SPEC_FAMILIES`` in their modules).
"""

from __future__ import annotations

import pytest
import torch

from helpers import (
    batch,
    build_gpt,
    lm_loss,
    needs_te,
    single_grouped_step,
    te_single_grouped_weight_unsupported,
    tiny_config,
)
from mhc_megatron.layers import HyperConnectionModule
from mhc_testing.cpu import setup_cpu_megatron

pytestmark = needs_te

FP8_DIMS = dict(hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, bf16=True,
                params_dtype=torch.bfloat16, mhc_kernel_backend="triton")


def _fp8_supported():
    from transformer_engine.pytorch.fp8 import check_fp8_support

    ok, reason = check_fp8_support()
    if not ok:
        pytest.skip(f"fp8 not supported here: {reason}")


def _bf16_model(cfg, device):
    setup_cpu_megatron(seed=11)  # the same initial weights for every config
    return build_gpt(cfg, device, te=True).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_gemms_around_bf16_streams_and_fp32_mappings(seeded, device, monkeypatch, recipe):
    """With config.fp8 the TE linears run fp8 GEMMs; the mHC ops still see bf16 streams and
    return fp32 mappings; the loss stays close to the bf16 model with the same weights."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    _fp8_supported()
    model16 = _bf16_model(tiny_config(**FP8_DIMS), device)
    model8 = _bf16_model(tiny_config(fp8="hybrid", fp8_recipe=recipe, **FP8_DIMS), device)
    for (name, a), b in zip(model16.state_dict().items(), model8.state_dict().values()):
        if torch.is_tensor(a) and "_extra_state" not in name:
            assert torch.equal(a, b), name

    seen = []
    pre = HyperConnectionModule.pre

    def recording_pre(self, streams):
        y, maps = pre(self, streams)
        seen.append((streams.dtype, y.dtype, maps.h_res.dtype,
                     FP8GlobalStateManager.is_fp8_enabled()))
        return y, maps

    monkeypatch.setattr(HyperConnectionModule, "pre", recording_pre)
    data = batch(device=device, seed=5)
    loss16 = lm_loss(model16, data)
    n16 = len(seen)
    loss8 = lm_loss(model8, data)
    loss8.backward()

    assert all(not fp8 for *_, fp8 in seen[:n16])  # bf16 model: no fp8 anywhere
    assert len(seen) - n16 == 2 * model8.config.num_layers
    for streams, y, h_res, fp8 in seen[n16:]:  # inside TE's fp8 autocast ...
        assert fp8 and streams == torch.bfloat16 and y == torch.bfloat16
        assert h_res == torch.float32  # ... the mHC math is unchanged
    for layer in model8.decoder.layers:
        assert layer.self_attention.linear_qkv.fp8 and layer.mlp.linear_fc2.fp8  # fp8 GEMMs ran
    assert torch.isfinite(loss8) and abs(loss8.item() - loss16.item()) < 0.02 * loss16.item()
    for name, p in model8.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if "hyper_connection" in name:
            assert p.grad.abs().sum() > 0, name


def test_fp8_model_trains_like_bf16(seeded, device):
    """A few AdamW steps (fp8 weights re-quantised each step, as Megatron's schedule does):
    the fp8 mHC model's loss falls like the bf16 one's."""
    _fp8_supported()
    data = batch(batch_size=4, device=device, seed=1)
    finals = {}
    for name, extra in (("bf16", {}), ("fp8", dict(fp8="hybrid", fp8_recipe="delayed"))):
        model = _bf16_model(tiny_config(**FP8_DIMS, **extra), device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(10):
            model.set_is_first_microbatch()
            opt.zero_grad()
            loss = lm_loss(model, data)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.8 * losses[0], (name, losses)
        finals[name] = losses[-1]
    assert abs(finals["fp8"] - finals["bf16"]) < 0.05 * finals["bf16"], finals


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["dropless", "drop_and_pad"])
def test_single_grouped_expert_weight_step_beside_baseline(routing):
    """A training step (forward, backward) of an MoE GPT whose experts are Megatron-Core
    0.19.2's single grouped weight (TE's grouped-tensor GEMM, bf16, one GPU), with mHC and with
    Megatron's own layers, each in a child process, dropless and with drop-and-pad routing
    (every expert's input padded to capacity): mHC's step runs wherever the baseline's does,
    with a finite loss and a finite, non-zero gradient for every grouped weight. Where TE
    faults for the baseline too (its grouped-tensor GEMM with this GPU's cuBLASLt), the test is
    an expected failure that quotes the baseline's error."""
    reason = te_single_grouped_weight_unsupported()
    if reason is not None:
        pytest.skip(reason)
    base, base_error = single_grouped_step(mhc=False, routing=routing)
    ours, our_error = single_grouped_step(mhc=True, routing=routing)
    if base is None:
        pytest.xfail(f"TE cannot run Megatron's own model with the single grouped expert weight "
                     f"({routing}) on this GPU (mHC's step {'ran' if ours else 'stopped too'}): "
                     f"{base_error}")
    assert ours is not None, f"the baseline's step ran, mHC's did not: {our_error}"
    print(f"\n[single grouped] baseline loss {base['loss']:.5f}, mHC loss {ours['loss']:.5f}; "
          f"grouped weights {ours['grouped_weights']}")
    assert ours["grouped_weights"] == base["grouped_weights"] and ours["grouped_weights"]
    assert torch.isfinite(torch.tensor(ours["loss"]))
    norms = torch.tensor([float("nan") if g is None else g for g in ours["grouped_grad_norms"]])
    assert torch.isfinite(norms).all() and (norms > 0).all(), ours
