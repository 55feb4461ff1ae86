"""The mapping forms (``mhc_mapping_form``, ``mhc_res_transposed``) in whole models: the
DeepSeek-V4 form reaches every hyper-connection of a GPT and of a hybrid model, the model
trains, and ``mhc_recompute`` gives its gradients bit for bit (the recompute replays the
aggregate and the combine, which take the mappings as computed). The math itself is checked
against Hugging Face's implementation in ``tests/test_deepseek_v4_oracle.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import (
    assert_every_parameter_gets_gradient,
    assert_loads_to,
    batch,
    build_gpt,
    lm_loss,
    tiny_config,
)
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
            assert_every_parameter_gets_gradient(model)
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


def _res_grad_of_last_sublayer(model) -> float:
    """|grad| of the last decoder sublayer's H_res parameters (phi's H_res rows, alpha_res,
    bias's H_res entries), relative to |grad| of its H_pre/H_post parameters."""
    hc = model.decoder.layers[-1].mlp_hyper_connection
    n = hc.n
    res = torch.cat([hc.phi.grad[2 * n:].flatten(), hc.alpha.grad[2:], hc.bias.grad[2 * n:]])
    other = torch.cat([hc.phi.grad[:2 * n].flatten(), hc.alpha.grad[:2], hc.bias.grad[:2 * n]])
    return float(res.norm() / other.norm())


def test_output_head_gives_the_last_h_res_a_gradient(seeded, device):
    """Under the plain sum the last sublayer's H_res cancels out of the model (its columns sum
    to 1): its parameters get no gradient beyond rounding. With ``mhc_output_head`` they do.
    One head per final norm: the decoder's and each MTP depth's."""
    data = batch(device=device, seed=6)
    ratios = {}
    for head in (False, True):
        model = build_gpt(tiny_config(mhc_output_head=head), device)
        with torch.no_grad():  # away from the uniform H_res of the zero init
            for hc in _hyper_connections(model):
                hc.bias.normal_()
        lm_loss(model, data).backward()
        ratios[head] = _res_grad_of_last_sublayer(model)
        heads = [n for n, _ in model.named_parameters() if ".head." in n]
        assert heads == (["decoder.final_layernorm.head.phi", "decoder.final_layernorm.head.alpha",
                          "decoder.final_layernorm.head.bias"] if head else []), heads
    assert ratios[False] < 1e-5 and ratios[True] > 1e-2, ratios


def test_output_head_per_mtp_depth_and_in_the_hybrid_stack(seeded, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from helpers import SEQ, VOCAB
    from mhc_megatron.specs import (
        get_gpt_decoder_block_with_mhc_spec,
        get_gpt_mtp_block_with_mhc_spec,
    )

    cfg = tiny_config(mtp_num_layers=2, mhc_output_head=True, **DSV4)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    gpt = GPTModel(cfg, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                   position_embedding_type="rope",
                   mtp_block_spec=get_gpt_mtp_block_with_mhc_spec(cfg, block, False)).to(device)
    hybrid = build_hybrid_model(dataclasses.replace(cfg, num_layers=4, mtp_num_layers=1), device,
                                "*-*-/*-")
    for model, owners in ((gpt, {"decoder.final_layernorm", "mtp.layers.0.final_layernorm",
                                 "mtp.layers.1.final_layernorm"}),
                          (hybrid, {"decoder.final_norm", "mtp.layers.0.final_layernorm"})):
        heads = {n.rsplit(".head.", 1)[0] for n, _ in model.named_parameters() if ".head." in n}
        assert heads == owners, heads
        MTPLossLoggingHelper.tracker.clear()  # Megatron sizes it by the first model that logs
        lm_loss(model, batch(device=device, seed=7)).backward()
        for name, p in model.named_parameters():
            if ".head." in name:
                assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_deepseek_v4_preset_is_its_fields(seeded, device):
    """``mhc_variant="deepseek_v4"`` builds the model of its single fields (mapping form,
    H_res transposed, output head) with fp32 mapping parameters: the same outputs from the
    same weights; in a bf16 model its mapping parameters stay fp32."""
    preset = build_gpt(tiny_config(mhc_variant="deepseek_v4"), device)
    fields = build_gpt(tiny_config(mhc_output_head=True, mhc_params_dtype=torch.float32,
                                   **DSV4), device)
    fields.load_state_dict(preset.state_dict())
    data = batch(device=device, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(preset(*data[:3]), fields(*data[:3]), rtol=0, atol=0)
    bf16 = build_gpt(tiny_config(mhc_variant="deepseek_v4", params_dtype=torch.bfloat16,
                                 bf16=True), device).bfloat16()
    mapping = {n: p.dtype for n, p in bf16.named_parameters()
               if "hyper_connection" in n or ".head." in n}
    assert mapping and set(mapping.values()) == {torch.float32}, mapping


def test_deepseek_v4_preset_dist_checkpoint_round_trip(seeded, device, tmp_path):
    """The output head's parameters (and the fp32 mappings) go through Megatron's distributed
    checkpoint: a fresh model loads them and gives the saved model's logits exactly."""
    from megatron.core import dist_checkpointing

    cfg = tiny_config(mhc_variant="deepseek_v4")
    model = build_gpt(cfg, device)
    data = batch(device=device, seed=9)
    model.eval()
    with torch.no_grad():
        expected = model(*data[:3])
    sharded = model.sharded_state_dict()
    assert any(".head." in k for k in sharded)
    dist_checkpointing.save(sharded, str(tmp_path))
    torch.manual_seed(99)
    assert_loads_to(build_gpt(cfg, device).eval(), tmp_path, data, expected)


@pytest.mark.parametrize("recompute", [False, True])
def test_deepseek_v4_preset_triton_backend_matches_reference(seeded, monkeypatch, recompute):
    """The DeepSeek-V4 preset (form, H_res transposed, output heads of the decoder and of
    each MTP depth) on the fused Triton kernels equals the PyTorch reference from the same
    weights: loss and every gradient, with and without ``mhc_recompute`` (CPU: the kernels
    under TRITON_INTERPRET; CUDA: compiled, fp32 with TF32/3xTF32 dots). Every
    hyper-connection and head runs the Triton ops."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from helpers import SEQ, VOCAB
    from mhc_megatron.kernels import dispatch
    from mhc_megatron.specs import (
        get_gpt_decoder_block_with_mhc_spec,
        get_gpt_mtp_block_with_mhc_spec,
    )
    from mhc_testing.cpu import setup_cpu_megatron

    device = "cuda" if torch.cuda.is_available() else "cpu"
    import mhc_megatron.layers.hyper_connection as hc_module

    chosen = []

    def recording_select(*args, **kwargs):  # the layers' choice of backend, recorded
        ops = dispatch.select_ops(*args, **kwargs)
        chosen.append(ops.name)
        return ops

    monkeypatch.setattr(hc_module, "select_ops", recording_select)
    runs = []
    for backend, dtype in (("triton", torch.float32), ("reference", torch.float32),
                           ("reference", torch.float64)):
        chosen.clear()
        cfg = tiny_config(num_layers=3, mtp_num_layers=1, mhc_variant="deepseek_v4",
                          mhc_kernel_backend=backend, mhc_recompute=recompute,
                          mhc_recompute_layer_num=2 if recompute else None)
        setup_cpu_megatron(seed=31)
        block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
        model = GPTModel(cfg, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope",
                         mtp_block_spec=get_gpt_mtp_block_with_mhc_spec(cfg, block, False))
        model = model.to(device, dtype)
        with torch.no_grad():  # mappings away from the symmetric initial H_res
            g = torch.Generator().manual_seed(5)
            for name, p in model.named_parameters():
                if "hyper_connection.bias" in name or ".head.bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g).to(p.device))
        MTPLossLoggingHelper.tracker.clear()
        loss = lm_loss(model, batch(device=device, seed=12))
        loss.backward()
        assert set(chosen) == {backend} and len(chosen) >= 3 * 2 + 2 + 2, chosen
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_t, grads_t), (loss_r, grads_r), (loss_64, grads_64) = runs

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

    # against the float64 reference: the kernels within tol, or (a sum of many terms of
    # mixed sign, e.g. alpha's gradient) within twice the fp32 reference's own error on that
    # module's parameters: a mapping's or head's phi, alpha and bias gradients are sums of
    # the same per-token gradient, so they share its fp32 accuracy, and one of them can land
    # nearer the float64 value by chance
    tol = 2e-3 if device == "cuda" else 1e-5
    assert rel(loss_t, loss_64) < tol
    ref_errs = {name: rel(grads_r[name], g) for name, g in grads_64.items()}
    module_ref_err = {}
    for name, ref_err in ref_errs.items():
        module = name.rsplit(".", 1)[0]
        module_ref_err[module] = max(module_ref_err.get(module, 0.0), ref_err)
    for name, g in grads_64.items():
        err, ref_err = rel(grads_t[name], g), module_ref_err[name.rsplit(".", 1)[0]]
        assert err < max(tol, 2 * ref_err), (
            f"{name}: {err:.2e} (fp32 reference, its module's largest: {ref_err:.2e})")
