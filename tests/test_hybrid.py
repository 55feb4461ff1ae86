"""HybridModel with mHC (mhc_megatron.specs.hybrid) against independent references: the GPT
mHC model with the same weights, Megatron's own HybridModel, and the model itself without
recompute.

A GPT layer's two sublayers are two hybrid layers, so the GPT mHC model with L layers and the
hybrid mHC model with pattern ``"*-" * L`` (``*E`` MoE, ``+-`` MLA, ``/*-`` an MTP depth) compute
the same function: logits and every gradient must agree (fp32; on one device the same ops run
in the same order, so they agree bit for bit). Spec families: Megatron's local modules
everywhere, Transformer Engine's where installed (a GPU host).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.hybrid import hybrid_block
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.spec_utils import ModuleSpec

from helpers import SEQ, SPEC_FAMILIES, VOCAB, batch, lm_loss, moe_overrides, tiny_config
from hybrid_models import (
    build_hybrid_model,
    gpt_and_hybrid,
    gpt_config,
    hybrid_config,
    unit_mappings,
)
from mhc_megatron.checkpoint import (
    gpt_hybrid_layer_pattern,
    gpt_to_hybrid_key,
    load_gpt_checkpoint_into_hybrid,
)
from mhc_megatron.layers.hybrid import (
    HybridHyperConnectionLayer,
    HyperConnectionMLPLayer,
    HyperConnectionMoETransformerLayer,
    MHCHybridStack,
)
from mhc_megatron.specs import get_hybrid_stack_local_spec, get_hybrid_stack_with_mhc_spec


def _forward_backward(model, data, labels: bool):
    """Logits (or per-token MTP-inclusive losses) and the gradient of a fixed function of
    them, for every parameter."""
    ids, pos, mask, lab = data
    out = model(ids, pos, mask, labels=lab if labels else None)
    (out.float().square().mean() if not labels else out.float().mean()).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same(gpt, hybrid, data, labels=False, exact=True):
    out_g, grads_g = _forward_backward(gpt, data, labels)
    out_h, grads_h = _forward_backward(hybrid, data, labels)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_h, out_g, **tol)
    assert len(grads_h) == len(grads_g)
    for name, grad in grads_g.items():
        assert grad is not None, name
        torch.testing.assert_close(grads_h[gpt_to_hybrid_key(name)], grad, **tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("kind", ["dense", "moe", "mla", "mtp"])
def test_hybrid_equals_gpt_with_the_same_weights(seeded, device, kind, spec_family):
    """``*-*-`` (dense), ``*E*E`` (MoE), ``+-+-`` (MLA), ``*-*-/*-`` (one MTP depth) == the
    2-layer GPT mHC model: logits (MTP: the training loss with the MTP term) and every
    gradient, mHC mappings included, on the Triton kernels where CUDA runs them."""
    if spec_family == "te" and kind == "moe":
        # Megatron's TE hybrid spec builds MoE experts as TEGroupedMLP; the GPT spec follows
        # the config
        overrides = dict(moe_grouped_gemm=True)
    else:
        overrides = {}
    backend = dict(mhc_kernel_backend="auto") if device.type == "cuda" else {}
    gpt, hybrid = gpt_and_hybrid(kind, device, te=spec_family == "te", **overrides, **backend)
    expected = {"dense": "*-*-", "moe": "*E*E", "mla": "+-+-", "mtp": "*-*-/*-"}[kind]
    assert hybrid.hybrid_layer_pattern == expected
    assert {type(layer) for layer in hybrid.decoder.layers} == (
        {HybridHyperConnectionLayer, HyperConnectionMoETransformerLayer} if kind == "moe"
        else {HybridHyperConnectionLayer, HyperConnectionMLPLayer})
    _assert_same(gpt, hybrid, batch(device=device, seed=1), labels=kind == "mtp",
                 exact=spec_family == "local")


def _megatron_hybrid(cfg, device, pattern, te, monkeypatch):
    """Megatron's own HybridModel (its HybridStack and layer classes). Without TE its stack's
    final ``TENorm`` cannot be built: the torch norm of Megatron's local modules stands in."""
    if te:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec
    else:
        local = get_hybrid_stack_local_spec(cfg)
        monkeypatch.setattr(hybrid_block, "TENorm", local.submodules.final_norm)
        spec = local
    assert spec.module is HybridStack
    return HybridModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope").to(device)


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
@pytest.mark.parametrize("mhc", ["n1_unit_mappings", "off"])
def test_equals_megatrons_hybrid_model(seeded, device, spec_family, mhc, monkeypatch):
    """n=1 with unit mappings (every hyper-connection the plain residual), and mHC off, ==
    Megatron's own HybridModel with the same weights: logits and every gradient."""
    te = spec_family == "te"
    extra = moe_overrides() | (dict(moe_grouped_gemm=True) if te else {})
    cfg = tiny_config(num_layers=4, num_residual_streams=1, **extra,
                      enable_hyper_connections=mhc != "off")
    ours = build_hybrid_model(cfg, device, "*-*E", te=te)
    plain_cfg = dataclasses.replace(cfg, enable_hyper_connections=False)
    megatron = _megatron_hybrid(plain_cfg, device, "*-*E", te, monkeypatch)
    state = {k.replace("decoder.final_norm.norm.", "decoder.final_norm."): v
             for k, v in ours.state_dict().items() if "hyper_connection" not in k}
    megatron.load_state_dict(state, strict=True)
    if mhc == "off":
        assert not any("hyper_connection" in n for n, _ in ours.named_parameters())
    else:
        assert unit_mappings(ours) == 4
    data = batch(device=device, seed=2)
    out_o, grads_o = _forward_backward(ours, data, labels=False)
    out_m, grads_m = _forward_backward(megatron, data, labels=False)
    tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_o, out_m, **tol)
    for name, grad in grads_m.items():
        ours_name = name.replace("decoder.final_norm.", "decoder.final_norm.norm.")
        torch.testing.assert_close(grads_o[ours_name], grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_streams_through_the_stack(seeded, device):
    """Layer 1 expands [s, b, C] into [s, b, n*C] whatever its symbol; every later layer maps
    streams to streams; the final norm contracts to [s, b, C]; one hyper-connection a layer."""
    cfg = tiny_config(num_layers=4, **moe_overrides())
    model = build_hybrid_model(cfg, device, "E-*E")
    shapes = []
    hooks = [layer.register_forward_hook(lambda m, i, o: shapes.append(
        (tuple(i[0].shape) if i else None, tuple(o.shape if torch.is_tensor(o) else o[0].shape))))
        for layer in model.decoder.layers]
    model(*batch(device=device)[:3])
    for h in hooks:
        h.remove()
    n, c = cfg.num_residual_streams, cfg.hidden_size
    assert [s[1][-1] for s in shapes] == [n * c] * 4
    for layer in model.decoder.layers:
        hcs = [name for name, _ in layer.named_children() if name.endswith("hyper_connection")]
        assert len(hcs) == 1, hcs
    assert isinstance(model.decoder, MHCHybridStack)


@pytest.mark.parametrize("pattern,error,match", [
    ("D-D-", ValueError, r"'D' layers, but this stack spec builds no dsa_layer"),
    ("*-M-", ImportError, r"Mamba \('M'\) layers need the package\(s\) .*mamba_ssm"),
    ("*-G-", ImportError, r"Gated delta net \('G'\) layers need the package\(s\) fla"),
])
def test_refuses_layers_it_cannot_build(seeded, pattern, error, match):
    """Layers the local spec has no module for, or whose package is missing, fail before any
    layer is built, with an error that names the package or field and the fix."""
    import importlib.util

    if "M" in pattern and importlib.util.find_spec("mamba_ssm") is not None:
        pytest.skip("mamba_ssm is installed")
    if "G" in pattern and importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is installed")
    with pytest.raises(error, match=match + r".*Fix: "):
        build_hybrid_model(tiny_config(num_layers=4), "cpu", pattern)


def test_refuses_moe_layers_without_experts(seeded):
    with pytest.raises(ValueError, match=r"'E' layers, but this stack spec builds no moe_layer"):
        build_hybrid_model(tiny_config(num_layers=2), "cpu", "*E")


def test_refuses_mhc_layers_in_megatrons_plain_stack(seeded):
    """mHC layers in Megatron's own HybridStack (whose final norm takes [s, b, C]) are refused
    while the stack is built, naming the mHC stack spec."""
    cfg = tiny_config(num_layers=2)
    spec = get_hybrid_stack_with_mhc_spec(cfg, use_transformer_engine=False)
    plain = ModuleSpec(module=HybridStack, submodules=spec.submodules)
    with pytest.raises(ValueError, match=r"builds Megatron's plain final norm.*"
                                         r"get_hybrid_stack_with_mhc_spec"):
        build_hybrid_model(cfg, "cpu", "*-", spec=plain)


def test_local_spec_needs_the_config():
    with pytest.raises(ValueError, match="needs the model's config"):
        get_hybrid_stack_with_mhc_spec(None, use_transformer_engine=False)


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
def test_mhc_recompute_gives_the_same_gradients(seeded, device, spec_family):
    """mhc_recompute (blocks of 2 hybrid layers, i.e. sublayers) recomputes the mHC ops in
    backward and gives the gradients of the model without it, bit for bit; the blocks run."""
    from mhc_megatron.recompute.manager import manager_for

    te = spec_family == "te"
    cfg = tiny_config(num_layers=6, mhc_kernel_backend="auto" if device.type == "cuda"
                      else "reference")
    plain = build_hybrid_model(cfg, device, "*-*-*-", te=te)
    rcfg = dataclasses.replace(cfg, mhc_recompute=True, mhc_recompute_layer_num=2)
    recomputed = build_hybrid_model(rcfg, device, "*-*-*-", te=te)
    recomputed.load_state_dict(plain.state_dict())
    data = batch(device=device, seed=5)
    out_p, grads_p = _forward_backward(plain, data, labels=True)
    out_r, grads_r = _forward_backward(recomputed, data, labels=True)
    torch.testing.assert_close(out_r, out_p, rtol=0, atol=0)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert manager_for(rcfg).blocks_recomputed == 3


def test_full_recompute_gives_the_same_gradients(seeded, device):
    """Megatron's full recompute of the hybrid stack (checkpointed_forward over its layers)
    replays the mHC layers too: the same gradients."""
    cfg = tiny_config(num_layers=4)
    plain = build_hybrid_model(cfg, device, "*-*-")
    fcfg = dataclasses.replace(cfg, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=2)
    full = build_hybrid_model(fcfg, device, "*-*-")
    full.load_state_dict(plain.state_dict())
    data = batch(device=device, seed=6)
    _, grads_p = _forward_backward(plain, data, labels=True)
    _, grads_f = _forward_backward(full, data, labels=True)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("spec_family", SPEC_FAMILIES)
def test_dist_checkpoint_round_trip(seeded, device, tmp_path, spec_family):
    from megatron.core import dist_checkpointing

    te = spec_family == "te"
    cfg = tiny_config(num_layers=4, **moe_overrides(),
                      **(dict(moe_grouped_gemm=True) if te else {}))
    model = build_hybrid_model(cfg, device, "*E*-", te=te)
    data = batch(device=device, seed=3)
    model.eval()
    with torch.no_grad():
        expected = model(*data[:3])
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    torch.manual_seed(999)
    fresh = build_hybrid_model(cfg, device, "*E*-", te=te)
    fresh.eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(*data[:3]), expected)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    with torch.no_grad():
        torch.testing.assert_close(fresh(*data[:3]), expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["dense", "moe", "mtp"])
def test_gpt_dist_checkpoint_loads_into_the_hybrid_model(seeded, device, tmp_path, kind):
    """A GPT mHC model's distributed checkpoint, loaded into the hybrid model of
    ``gpt_hybrid_layer_pattern`` (GPT keys and layer stacking mapped by
    ``gpt_layout_sharded_state_dict``), gives the GPT's logits exactly."""
    from megatron.core import dist_checkpointing

    from hybrid_models import build_gpt_model

    gcfg = gpt_config(kind)
    gpt = build_gpt_model(gcfg, device)
    dist_checkpointing.save(gpt.sharded_state_dict(), str(tmp_path))
    torch.manual_seed(4321)
    hybrid = build_hybrid_model(hybrid_config(gcfg), device, gpt_hybrid_layer_pattern(gcfg))
    load_gpt_checkpoint_into_hybrid(hybrid, str(tmp_path))
    data = batch(device=device, seed=8)
    gpt.eval()
    hybrid.eval()
    with torch.no_grad():
        torch.testing.assert_close(hybrid(*data[:3]), gpt(*data[:3]), rtol=0, atol=0)
        if kind == "mtp":
            torch.testing.assert_close(lm_loss(hybrid, data), lm_loss(gpt, data), rtol=0, atol=0)


def test_triton_kernels_match_the_reference(seeded, device):
    """The hybrid stack on the Triton kernels (Triton's interpreter on CPU) == the PyTorch
    reference ops: logits and every gradient, within the kernels' fp32 tolerance."""
    cfg = tiny_config(num_layers=4, mhc_kernel_backend="reference")
    ref = build_hybrid_model(cfg, device, "*-*-")
    tri = build_hybrid_model(dataclasses.replace(cfg, mhc_kernel_backend="triton"), device, "*-*-")
    tri.load_state_dict(ref.state_dict())
    data = batch(device=device, seed=9)
    out_r, grads_r = _forward_backward(ref, data, labels=False)
    out_t, grads_t = _forward_backward(tri, data, labels=False)
    torch.testing.assert_close(out_t, out_r, rtol=1e-4, atol=1e-5)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_t[name], grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


class _StandInMixer(torch.nn.Module):
    """A mixer with Megatron's ``MambaMixer`` interface (``[s, b, C] -> (out, bias)``) that
    needs no ``mamba_ssm``: a linear map. It stands in for the Mamba mixer to check how
    ``HyperConnectionMambaLayer`` wires the hyper-connection around whatever mixer it has."""

    def __init__(self, config, d_model, **kwargs):
        super().__init__()
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, hidden_states, inference_context=None, packed_seq_params=None):
        return self.proj(hidden_states), None


def _mamba_layer(cfg, layer_number, mhc=True):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
    from megatron.core.transformer.spec_utils import build_module

    from mhc_megatron.specs import to_mhc_hybrid_layer_spec

    norm = get_hybrid_stack_local_spec(cfg).submodules.final_norm
    spec = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=norm, mixer=ModuleSpec(module=_StandInMixer), mamba_bda=get_bias_dropout_add))
    if mhc:
        spec = to_mhc_hybrid_layer_spec(spec)
    return build_module(spec, config=cfg, layer_number=layer_number,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def test_mamba_layer_n1_unit_mappings_equals_megatrons(seeded):
    """``HyperConnectionMambaLayer`` at n=1 with unit mappings == Megatron's ``MambaLayer``
    with the same (stand-in) mixer and norm: output and every gradient."""
    cfg = tiny_config(num_residual_streams=1)
    ours, plain = _mamba_layer(cfg, 2), _mamba_layer(cfg, 2, mhc=False)
    result = plain.load_state_dict(ours.state_dict(), strict=False)
    assert not result.missing_keys and all("mixer_hyper_connection" in k
                                           for k in result.unexpected_keys)
    assert unit_mappings(ours) == 1
    x = torch.randn(SEQ, 2, cfg.hidden_size)
    xo, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_o, out_p = ours(xo), plain(xp)
    torch.testing.assert_close(out_o, out_p, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out_p)
    out_o.backward(g)
    out_p.backward(g)
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-5, atol=1e-6)
    plain_params = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        if "hyper_connection" not in name:
            torch.testing.assert_close(p.grad, plain_params[name].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_number", [1, 2])
def test_mamba_layer_equals_reference_composition(seeded, layer_number):
    """n=4: ``HyperConnectionMambaLayer`` == the reference mHC ops composed by hand around the
    layer's own norm and mixer (layer 1 expands ``[s, b, C]``)."""
    from mhc_megatron.kernels import reference as ref

    cfg = tiny_config()
    layer = _mamba_layer(cfg, layer_number).eval()
    n, c = cfg.num_residual_streams, cfg.hidden_size
    x = torch.randn(SEQ, 2, c if layer_number == 1 else n * c)
    out = layer(x)
    streams = x.unsqueeze(2).expand(SEQ, 2, n, c).reshape(SEQ, 2, n * c) if layer_number == 1 \
        else x
    hc = layer.mixer_hyper_connection
    with torch.no_grad():
        flat = streams.reshape(-1, n, c)
        h_pre, h_post, h_res = ref.compute_mappings(
            flat, hc.phi, hc.alpha, hc.bias, cfg.mhc_sinkhorn_iterations, cfg.mhc_rms_eps)
        y = ref.aggregate(flat, h_pre).view(SEQ, 2, c)
        f, f_bias = layer.mixer(layer.norm(y))
        expect = ref.expand_combine(flat, f.reshape(-1, c), f_bias, h_res, h_post)
    torch.testing.assert_close(out, expect.view(SEQ, 2, n * c), rtol=1e-5, atol=1e-5)
