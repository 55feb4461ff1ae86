"""The mapping forms (``mhc_mapping_form``, ``mhc_res_transposed``) in whole models: the
DeepSeek-V4 form reaches every hyper-connection of a GPT and of a hybrid model, the model
trains, and ``mhc_recompute`` gives its gradients bit for bit (the recompute replays the
aggregate and the combine, which take the mappings as computed). The math itself is checked
against Hugging Face's implementation in ``tests/test_deepseek_v4_oracle.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import batch, build_gpt, lm_loss, tiny_config
from hybrid_models import build_hybrid_model
from mhc_megatron.kernels.reference import MappingForm

DSV4 = dict(mhc_mapping_form="deepseek_v4", mhc_res_transposed=True, mhc_mapping_eps=1e-6)


def _hyper_connections(model):
    return [m for name, m in model.named_modules() if name.endswith("hyper_connection")]


@pytest.mark.parametrize("model_kind", ["gpt", "hybrid"])
def test_deepseek_v4_form_reaches_every_mapping_and_trains(seeded, device, model_kind):
    cfg = tiny_config(num_layers=2, **DSV4)
    if model_kind == "gpt":
        model = build_gpt(cfg, device)
    else:
        model = build_hybrid_model(dataclasses.replace(cfg, num_layers=4), device, "*-*-")
    hcs = _hyper_connections(model)
    assert len(hcs) == 4 and all(
        hc.mapping == MappingForm("deepseek_v4", 1e-6, True) for hc in hcs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batch(device=device, seed=3)
    losses = []
    for step in range(8):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, data)
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
                assert p.grad.abs().sum() > 0, f"{name} gets no gradient"
        losses.append(loss.item())
        opt.step()
    assert losses[-1] < 0.8 * losses[0], losses


def test_deepseek_v4_form_with_mhc_recompute_is_bitwise(seeded, device):
    cfg = tiny_config(num_layers=3, **DSV4)
    plain = build_gpt(cfg, device)
    rcfg = dataclasses.replace(cfg, mhc_recompute=True, mhc_recompute_layer_num=2)
    recomputed = build_gpt(rcfg, device)
    recomputed.load_state_dict(plain.state_dict())
    data = batch(device=device, seed=4)
    grads = []
    for model in (plain, recomputed):
        lm_loss(model, data).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_forms_give_different_models(seeded, device):
    """The same weights in the paper's form and in DeepSeek-V4's are different functions
    (so a checkpoint must be used in the form it was trained in)."""
    paper = build_gpt(tiny_config(), device)
    with torch.no_grad():  # mappings away from the initial uniform (symmetric) H_res
        for hc in _hyper_connections(paper):
            hc.bias.normal_()
    ds = build_gpt(tiny_config(**DSV4), device)
    ds.load_state_dict(paper.state_dict())
    data = batch(device=device, seed=5)
    with torch.no_grad():
        assert not torch.allclose(paper(*data[:3]), ds(*data[:3]), rtol=1e-4, atol=1e-5)
