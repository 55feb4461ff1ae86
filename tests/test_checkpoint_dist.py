"""The name converter on Megatron distributed checkpoints (``python -m mhc_megatron.convert``
with a checkpoint directory; :mod:`mhc_megatron.checkpoint.dist_files`): a DeepSeek-V4-preset
GPT with an MTP depth saved by Megatron's ``dist_checkpointing`` goes to Megatron-LM's names
(layers still stacked, the alphas split along the last axis) and to DeepSeek's release names
in a safetensors file (layers split), and back to a distributed checkpoint that a fresh model
loads to the saved model's logits and weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel

from helpers import SEQ, VOCAB, assert_loads_to, batch, child_env, run_python, tiny_config
from mhc_megatron.checkpoint import read_dist_checkpoint, stack_layers, unstack_layers
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec, get_gpt_mtp_block_with_mhc_spec


def _dsv4_gpt(seed: int, device):
    """The DeepSeek-V4-preset GPT (2 layers, MTP depth 1) on ``device`` (the test device:
    Megatron computes RoPE on CUDA where present)."""
    torch.manual_seed(seed)
    cfg = tiny_config(num_layers=2, mhc_variant="deepseek_v4", mtp_num_layers=1)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    return GPTModel(cfg, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_with_mhc_spec(cfg, block, False)).to(
                        device).eval()


def _convert(source, target, frm, to):
    """``python -m mhc_megatron.convert`` (``helpers.run_python``); its output."""
    run = run_python("-m", "mhc_megatron.convert", "--from", frm, "--to", to, source, target,
                     env=child_env(cpu_only=True), timeout=300)
    assert run.returncode == 0, run.stdout
    return run.stdout


def _loaded_matches(model, path, data, strict="assume_ok_unexpected"):
    fresh = _dsv4_gpt(seed=99, device=data[0].device)
    with torch.no_grad():
        want = model(*data[:3])
    assert_loads_to(fresh, path, data, want, strict)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("via", ["megatron_lm", "deepseek"])
def test_dist_checkpoint_round_trip_through_other_names(seeded, device, tmp_path, via):
    model = _dsv4_gpt(seed=3, device=device)
    with torch.no_grad():  # mappings away from their initial values
        for name, p in model.named_parameters():
            if "hyper_connection" in name or ".head." in name:
                p.add_(torch.randn_like(p) * 0.1)
    ours = tmp_path / "ours"
    ours.mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(ours))
    middle = tmp_path / ("lm" if via == "megatron_lm" else "deepseek.safetensors")
    if via == "deepseek":
        pytest.importorskip("safetensors")
    out = _convert(ours, middle, "megatron_core", via)
    assert "0 dropped" in out, out
    if via == "megatron_lm":
        lm = read_dist_checkpoint(str(middle)).tensors
        alphas = [lm[f"decoder.layers.mlp_hyper_connection.alpha_{q}"] for q in ("pre", "post",
                                                                                  "res")]
        stacked = model.state_dict()  # per layer: decoder.layers.{i}.mlp_hyper_connection.alpha
        for i in range(2):
            want = stacked[f"decoder.layers.{i}.mlp_hyper_connection.alpha"].cpu()
            assert torch.equal(torch.cat([a[i] for a in alphas]), want)
        assert "decoder.hc_head_fn" in lm and "decoder.final_layernorm.weight" in lm
        assert "decoder.layers.self_attention_hyper_connection.mapping_proj.weight" in lm
    else:
        from mhc_megatron.convert import load

        names = load(str(middle))
        assert "layers.1.hc_ffn_fn" in names and "mtp.0.hc_head_scale" in names
    back = tmp_path / "back"
    out = _convert(middle, back, via, "megatron_core")
    # from a file: no sharded objects (the local modules' empty _extra_state), which
    # Megatron's non-strict load skips (every tensor is checked below)
    strict = "assume_ok_unexpected" if via == "megatron_lm" else "log_unexpected"
    assert (via == "deepseek") == ("--dist-ckpt-strictness log_unexpected" in out), out
    _loaded_matches(model, back, batch(device=device, seed=5), strict)


def test_stacking_and_refusals(seeded, tmp_path):
    stacked = {"decoder.layers.mlp.w": torch.arange(6.0).view(3, 2), "embedding.w": torch.ones(2)}
    per_layer = unstack_layers(stacked)
    assert sorted(per_layer) == ["decoder.layers.0.mlp.w", "decoder.layers.1.mlp.w",
                                 "decoder.layers.2.mlp.w", "embedding.w"]
    assert torch.equal(stack_layers(per_layer)["decoder.layers.mlp.w"], stacked["decoder.layers.mlp.w"])
    with pytest.raises(ValueError, match=r"not 0..L-1.*Fix: "):
        stack_layers({"decoder.layers.1.mlp.w": torch.ones(2)})
    with pytest.raises(ValueError, match=r"shapes differ.*Fix: "):
        stack_layers({"decoder.layers.0.mlp.w": torch.ones(2), "decoder.layers.1.mlp.w": torch.ones(3)})
    from mhc_megatron.convert import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--from", "megatron_core", "--to", "hf", str(tmp_path / "x.pt"), str(tmp_path / "d")])
    assert exit_info.value.code == 2
    with pytest.raises(FileNotFoundError, match="no metadata.json"):
        read_dist_checkpoint(str(tmp_path))
