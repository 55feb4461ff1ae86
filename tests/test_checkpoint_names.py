"""mHC parameter names across checkpoint schemes (mhc_megatron.checkpoint.names and
``python -m mhc_megatron.convert``): exact round trips, and a converted model that the
independent implementation (Hugging Face's DeepSeek-V4 modules) loads and runs to the same
mappings and head output."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from helpers import SEQ, VOCAB, child_env, run_python, tiny_config
from mhc_megatron.checkpoint.names import SCHEMES, convert_state_dict, format_name, parse_name
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec, get_gpt_mtp_block_with_mhc_spec


def _dsv4_gpt(mtp_depths: int | None = 1):
    cfg = tiny_config(num_layers=2, mhc_variant="deepseek_v4", mtp_num_layers=mtp_depths)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_with_mhc_spec(cfg, block, False) if mtp_depths else None
    return GPTModel(cfg, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", mtp_block_spec=mtp)


def test_names_of_every_mhc_parameter(seeded):
    """Every mHC parameter of a GPT with an MTP depth and output heads is named in each
    scheme (HF: except MTP), and the names are the documented ones."""
    state = _dsv4_gpt().state_dict()
    mhc = [k for k in state if parse_name(k, "megatron_core") is not None]
    # 2 layers x 2 hyper-connections + the MTP depth's 2, and 2 heads: 3 tensors each
    assert len(mhc) == (2 * 2 + 2 + 2) * 3, mhc
    p = parse_name("decoder.layers.1.mlp_hyper_connection.alpha", "megatron_core")
    assert format_name(p, "hf") == "model.layers.1.ffn_hc.scale"
    assert format_name(p, "deepseek") == "layers.1.hc_ffn_scale"
    head = parse_name("decoder.final_layernorm.head.phi", "megatron_core")
    assert (format_name(head, "hf"), format_name(head, "deepseek")) == (
        "model.hc_head.hc_fn", "hc_head_fn")
    mtp = parse_name("mtp.layers.0.mtp_model_layer.self_attention_hyper_connection.bias",
                     "megatron_core")
    assert format_name(mtp, "deepseek") == "mtp.0.hc_attn_base"
    assert format_name(parse_name("mtp.layers.0.final_layernorm.head.alpha", "megatron_core"),
                       "deepseek") == "mtp.0.hc_head_scale"
    with pytest.raises(ValueError, match=r"no MTP modules.*Fix: "):
        format_name(mtp, "hf")


@pytest.mark.parametrize("chain", [("deepseek", "megatron_core"),
                                   ("hf", "deepseek", "megatron_core"),
                                   ("deepseek", "hf", "megatron_core")])
def test_round_trips_are_exact(seeded, chain):
    """megatron_core -> ... -> megatron_core gives back every key and the very tensors (HF
    without MTP: the model without MTP); other keys pass through unchanged."""
    state = _dsv4_gpt(mtp_depths=None if "hf" in chain else 1).state_dict()
    current, scheme = state, "megatron_core"
    for target in chain:
        current = convert_state_dict(current, scheme, target)
        scheme = target
    assert list(current) == list(state)
    for key, value in state.items():
        assert current[key] is value, key


def test_hf_drops_mtp_only_when_asked(seeded):
    state = _dsv4_gpt().state_dict()
    with pytest.raises(ValueError, match="no MTP modules"):
        convert_state_dict(state, "megatron_core", "hf")
    hf = convert_state_dict(state, "megatron_core", "hf", drop_unnamed=True)
    assert not any("hyper_connection" in k or ".head." in k for k in hf)
    assert len(state) - len(hf) == (2 + 1) * 3  # the MTP depth's 2 HCs and its head


def test_unknown_mhc_names_are_refused(seeded):
    with pytest.raises(ValueError, match=r"looks like an mHC parameter.*Fix: "):
        convert_state_dict({"decoder.final_norm.head.phi": torch.zeros(1)}, "megatron_core",
                           "deepseek")
    with pytest.raises(ValueError, match="unknown checkpoint naming scheme"):
        convert_state_dict({}, "megatron", "hf")


def test_converted_weights_run_in_hugging_faces_modules(seeded):
    """Our DeepSeek-V4-preset GPT's state dict, converted to HF names, loads into HF's
    ``DeepseekV4HyperConnection`` (layer 1's MLP mapping) and ``DeepseekV4HyperHead``; on the
    same streams they give our modules' mappings, aggregate and head output."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    model = _dsv4_gpt(mtp_depths=None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hyper_connection" in name or ".head." in name:
                p.normal_(0, 0.05 if p.dim() == 2 else 1.0)
    cfg = model.config
    n, c = cfg.num_residual_streams, cfg.hidden_size
    hf_cfg = DeepseekV4Config(hidden_size=c, hc_mult=n, hc_sinkhorn_iters=cfg.mhc_sinkhorn_iterations,
                              hc_eps=cfg.mhc_mapping_eps, rms_norm_eps=cfg.mhc_rms_eps,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                              vocab_size=VOCAB, intermediate_size=2 * c, moe_intermediate_size=c,
                              n_routed_experts=4, num_experts_per_tok=2)
    state = convert_state_dict(model.state_dict(), "megatron_core", "hf")
    theirs = hf.DeepseekV4HyperConnection(hf_cfg)
    theirs.load_state_dict({k.rsplit(".", 1)[1]: state[k] for k in state
                            if k.startswith("model.layers.1.ffn_hc.")})
    head = hf.DeepseekV4HyperHead(hf_cfg)
    head.load_state_dict({k.rsplit(".", 1)[1]: state[k] for k in state
                          if k.startswith("model.hc_head.")})
    h = torch.randn(3, 5, n, c)
    with torch.no_grad():
        post, comb, collapsed = theirs(h)
        y, mappings = model.decoder.layers[1].mlp_hyper_connection.pre(h.reshape(3, 5, n * c))
        torch.testing.assert_close(y, collapsed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mappings.h_res.view(3, 5, n, n), comb.transpose(-1, -2),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.decoder.final_layernorm.head(h.reshape(3, 5, n * c)),
                                   head(h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_cli_converts_files(seeded, tmp_path, suffix):
    """``python -m mhc_megatron.convert`` renames a file's mHC parameters and keeps the
    tensors bit for bit; converting back restores the original keys."""
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    from mhc_megatron.convert import load, save

    state = {k: v for k, v in _dsv4_gpt().state_dict().items() if torch.is_tensor(v)}
    src, mid, back = (tmp_path / f"{name}{suffix}" for name in ("ours", "deepseek", "back"))
    save(state, str(src))
    for a, b, frm, to in ((src, mid, "megatron_core", "deepseek"),
                          (mid, back, "deepseek", "megatron_core")):
        run = run_python("-m", "mhc_megatron.convert", "--from", frm, "--to", to, a, b,
                         env=child_env(cpu_only=True), timeout=300)
        assert run.returncode == 0, run.stdout
        assert "mHC parameters renamed" in run.stdout
    assert any(k.startswith("hc_head_") for k in load(str(mid)))
    restored = load(str(back))
    assert sorted(restored) == sorted(state)
    for key, value in state.items():
        assert torch.equal(restored[key], value), key


def test_megatron_lm_names_round_trip(seeded):
    """Megatron-LM's in-tree names: ``mapping_proj.weight`` and ``bias`` as they are, ``scale``
    as ``alpha_pre`` / ``alpha_post`` / ``alpha_res`` of shape [1]; back to ours bit for bit
    (a paper-convention model without head or MTP, which is what Megatron-LM has)."""
    cfg = tiny_config(num_layers=2)
    model = GPTModel(cfg, get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("hyper_connection.alpha"):
                p.copy_(torch.tensor([0.1, 0.2, 0.3]))
    state = model.state_dict()
    lm = convert_state_dict(state, "megatron_core", "megatron_lm")
    prefix = "decoder.layers.1.mlp_hyper_connection."
    n, c = cfg.num_residual_streams, cfg.hidden_size
    assert lm[prefix + "mapping_proj.weight"].shape == (2 * n + n * n, n * c)
    assert lm[prefix + "bias"].shape == (2 * n + n * n,)
    assert [float(lm[prefix + f"alpha_{q}"]) for q in ("pre", "post", "res")] == pytest.approx(
        [0.1, 0.2, 0.3])
    back = convert_state_dict(lm, "megatron_lm", "megatron_core")
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        if torch.is_tensor(value):
            assert torch.equal(back[key], value), key
    partial = {k: v for k, v in lm.items() if not k.endswith("alpha_res")}
    with pytest.raises(ValueError, match=r"alpha_res'\] missing"):
        convert_state_dict(partial, "megatron_lm", "megatron_core")


def test_megatron_lm_deepseek_v4_names_round_trip(seeded):
    """Megatron-LM's DeepSeek-V4 names (as Megatron-Bridge maps them): the heads as
    ``decoder.hc_head_X`` and ``mtp.layers.d.hc_head_X`` (scale [1] as it is), the MTP depth's
    hyper-connections under ``mtp_model_layer``, our final norms' inner norm as Megatron's
    ``final_layernorm.weight``; back to ours bit for bit; Bridge's ``hc_head_params.`` form
    reads the same."""
    state = _dsv4_gpt().state_dict()
    lm = convert_state_dict(state, "megatron_core", "megatron_lm")
    n, c = 4, 32
    assert lm["decoder.hc_head_fn"].shape == (n, n * c)
    assert lm["decoder.hc_head_scale"].shape == (1,)
    assert lm["mtp.layers.0.hc_head_base"].shape == (n,)
    assert lm["mtp.layers.0.mtp_model_layer.mlp_hyper_connection.alpha_res"].shape == (1,)
    assert "decoder.final_layernorm.weight" in lm and "mtp.layers.0.final_layernorm.weight" in lm
    assert not [k for k in lm if ".head." in k or "final_layernorm.norm." in k]
    back = convert_state_dict(lm, "megatron_lm", "megatron_core")
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        if torch.is_tensor(value):
            assert torch.equal(back[key], value), key
    bridge = {k.replace("decoder.hc_head_", "decoder.hc_head_params.hc_head_"): v
              for k, v in lm.items()}
    assert sorted(convert_state_dict(bridge, "megatron_lm", "megatron_core")) == sorted(state)
    deepseek = convert_state_dict(lm, "megatron_lm", "deepseek")
    assert torch.equal(deepseek["hc_head_fn"], state["decoder.final_layernorm.head.phi"])
    assert torch.equal(deepseek["layers.1.hc_attn_scale"],
                       state["decoder.layers.1.self_attention_hyper_connection.alpha"])
