"""The mHC flags in Megatron's own argument parser, and args -> configs through Megatron's
``argument_utils`` (no training here; the pretraining runs are in test_pretrain_example.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import batch

from mhc_megatron.config import MHCMLATransformerConfig, MHCTransformerConfig
from mhc_megatron.training import (
    add_mhc_arguments,
    mhc_block_spec,
    mhc_gpt_model_config_from_args,
    mhc_transformer_config_from_args,
)

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--train-iters", "4", "--eval-interval", "10", "--transformer-impl", "local",
        "--no-persist-layer-norm", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
        "--mock-data"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
       "--normalization", "RMSNorm"]


def _args(*flags, monkeypatch):
    """Megatron's parse + validate with our extra args (without its global-state set-up)."""
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *TINY, *flags])
    monkeypatch.setenv("RANK", "0")  # what torchrun sets; Megatron warns without it
    args = parse_args(extra_args_provider=add_mhc_arguments)
    validate_args(args)
    return args


def test_defaults_are_the_config_defaults(monkeypatch):
    args = _args(monkeypatch=monkeypatch)
    config = mhc_transformer_config_from_args(args)
    default = MHCTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    for name in ("enable_hyper_connections", "num_residual_streams", "mhc_sinkhorn_iterations",
                 "mhc_init_gating_factor", "mhc_rms_eps", "mhc_kernel_backend", "mhc_recompute",
                 "mhc_recompute_layer_num", "mhc_params_dtype", "mhc_init_static_mapping",
                 "mhc_init_res_diagonal"):
        assert getattr(config, name) == getattr(default, name), name


def test_flags_reach_the_config(monkeypatch):
    args = _args("--enable-hyper-connections", "--num-residual-streams", "2",
                 "--mhc-sinkhorn-iterations", "7", "--mhc-init-gating-factor", "0.05",
                 "--mhc-rms-eps", "1e-5", "--mhc-kernel-backend", "reference", "--mhc-recompute",
                 "--mhc-recompute-layer-num", "3", "--mhc-params-dtype", "fp32",
                 monkeypatch=monkeypatch)
    c = mhc_transformer_config_from_args(args)
    assert type(c) is MHCTransformerConfig
    assert (c.enable_hyper_connections, c.num_residual_streams, c.mhc_sinkhorn_iterations,
            c.mhc_init_gating_factor, c.mhc_rms_eps, c.mhc_kernel_backend, c.mhc_recompute,
            c.mhc_recompute_layer_num, c.mhc_params_dtype) == (
        True, 2, 7, 0.05, 1e-5, "reference", True, 3, torch.float32)
    assert c.hidden_size == 64 and c.num_layers == 2  # Megatron's own flags still apply
    c = mhc_transformer_config_from_args(_args(
        "--enable-hyper-connections", "--mhc-init-static-mapping", "zero",
        "--mhc-init-res-diagonal", "0.5", monkeypatch=monkeypatch))
    assert (c.mhc_init_static_mapping, c.mhc_init_res_diagonal) == ("zero", 0.5)


def test_deepseek_v4_mapping_flags_reach_the_config(monkeypatch):
    from mhc_megatron.config import mhc_setting
    from mhc_megatron.kernels.reference import MappingForm

    c = mhc_transformer_config_from_args(_args(
        "--enable-hyper-connections", "--mhc-mapping-form", "deepseek_v4", "--mhc-mapping-eps",
        "1e-5", "--mhc-res-transposed", "--mhc-output-head", monkeypatch=monkeypatch))
    assert (c.mhc_mapping_form, c.mhc_mapping_eps, c.mhc_res_transposed, c.mhc_output_head) == (
        "deepseek_v4", 1e-5, True, True)
    c = mhc_transformer_config_from_args(_args("--enable-hyper-connections",
                                               monkeypatch=monkeypatch))
    assert c.mhc_mapping == MappingForm("paper", 1e-6, False)
    assert not mhc_setting(c, "mhc_output_head")
    c = mhc_transformer_config_from_args(_args("--enable-hyper-connections", "--mhc-variant",
                                               "deepseek-v4", monkeypatch=monkeypatch))
    assert (c.mhc_variant, c.mhc_mapping, mhc_setting(c, "mhc_output_head"),
            mhc_setting(c, "mhc_params_dtype")) == (
        "deepseek_v4", MappingForm("deepseek_v4", 1e-6, True), True, torch.float32)


def test_megatron_lm_in_tree_names_are_aliases(monkeypatch):
    args = _args("--enable-mhc-connections", "--mhc-num-residual-streams", "2",
                 "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mhc",
                 monkeypatch=monkeypatch)
    c = mhc_transformer_config_from_args(args)
    assert c.enable_hyper_connections and c.num_residual_streams == 2
    assert c.mhc_recompute and c.recompute_modules == ["core_attn"]
    assert args.recompute_modules == ["core_attn"]  # the training loop reads args too


def test_mla_flags_give_the_mhc_mla_config(monkeypatch):
    import megatron.core.transformer as mct

    before = mct.MLATransformerConfig
    c = mhc_transformer_config_from_args(_args("--enable-hyper-connections", *MLA,
                                               monkeypatch=monkeypatch))
    assert type(c) is MHCMLATransformerConfig and c.multi_latent_attention
    assert c.enable_hyper_connections and c.q_lora_rank == 16
    assert mct.MLATransformerConfig is before  # the scoped swap is undone


@pytest.mark.parametrize("flags,field", [
    (["--num-residual-streams", "0"], "num_residual_streams"),
    (["--mhc-sinkhorn-iterations", "0"], "mhc_sinkhorn_iterations"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--mhc-recompute"], "mhc_recompute / recompute_granularity"),
])
def test_bad_flags_get_the_config_refusal(monkeypatch, flags, field):
    args = _args("--enable-hyper-connections", *flags, monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match=rf"mHC config: {field}.*Fix: "):
        mhc_transformer_config_from_args(args)


def test_bad_params_dtype_is_an_argparse_error(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _args("--mhc-params-dtype", "fp64", monkeypatch=monkeypatch)
    assert "--mhc-params-dtype: 'fp64' is not one of" in capsys.readouterr().err


def test_gpt_model_config_uses_the_mhc_block_spec(monkeypatch, megatron_single_rank):
    from mhc_megatron.layers import HyperConnectionTransformerLayer, StreamContractingNorm

    args = _args("--enable-hyper-connections", monkeypatch=monkeypatch)
    model_cfg = mhc_gpt_model_config_from_args(args)
    assert model_cfg.transformer_layer_spec is mhc_block_spec
    assert isinstance(model_cfg.transformer, MHCTransformerConfig)
    block = mhc_block_spec(model_cfg)
    assert all(s.module is HyperConnectionTransformerLayer for s in block.layer_specs)
    norm = block.layer_norm(config=model_cfg.transformer, hidden_size=64, eps=1e-5)
    assert isinstance(norm, StreamContractingNorm) and norm.n == 4


def test_config_container_style(megatron_single_rank, device):
    """GPTModelConfig(transformer=MHCTransformerConfig(...), transformer_layer_spec=mhc_block_spec)
    built by Megatron's own GPTModelBuilder, run on the test device (Megatron's local attention
    takes its buffers from CUDA where present)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelConfig

    from mhc_megatron.layers import HyperConnectionTransformerLayer

    transformer = MHCTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                       use_cpu_initialization=True, enable_hyper_connections=True,
                                       mhc_kernel_backend="reference", transformer_impl="local")
    model_cfg = GPTModelConfig(transformer=transformer, transformer_layer_spec=mhc_block_spec,
                               vocab_size=128, seq_length=32)
    model = model_cfg.get_builder_cls()(model_cfg).build_model(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    assert all(isinstance(layer, HyperConnectionTransformerLayer) and layer.mhc_enabled
               for layer in model.decoder.layers)
    ids, pos, mask, _ = batch(seq=32, device=device)
    assert model(ids, pos, mask).shape == (2, 32, 128)


def test_sequence_parallel_with_local_norms_is_a_clear_error(monkeypatch, megatron_single_rank):
    """--tensor-model-parallel-size 2 --sequence-parallel with Megatron's local modules: its
    torch norm refuses SP (the baseline fails the same, with an AssertionError); the spec
    says why and what to do instead."""
    import megatron.training.arguments as megatron_arguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asks for it with TP > 1
    if not torch.cuda.is_available():  # TP > 1 asks for the GPU architecture
        monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    args = _args("--enable-hyper-connections", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", monkeypatch=monkeypatch)
    model_cfg = mhc_gpt_model_config_from_args(args)
    assert model_cfg.transformer.sequence_parallel
    with pytest.raises(ValueError, match=r"--sequence-parallel.*WrappedTorchNorm.*Fix: install "
                       r"Transformer Engine.*--transformer-impl transformer_engine.*or drop "
                       r"--sequence-parallel"):
        mhc_block_spec(model_cfg)


def test_sequence_parallel_check_accepts_norms_that_support_it(megatron_single_rank):
    """The check looks at the norms the spec really builds: a spec whose norms support SP (the
    tests' CPU stand-in for TE's) passes; so does Megatron's torch norm without SP."""
    from helpers import sequence_parallel_capable_spec, tiny_config

    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
    from mhc_megatron.specs.gpt import check_sequence_parallel_norms

    sp = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
    check_sequence_parallel_norms(sp, sequence_parallel_capable_spec(sp))
    local = get_gpt_decoder_block_with_mhc_spec(sp, use_transformer_engine=False)
    check_sequence_parallel_norms(tiny_config(), local)
    with pytest.raises(ValueError, match="sequence_parallel"):
        check_sequence_parallel_norms(sp, local)


def _megatron_parser():
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_help_repair_touches_only_the_known_action():
    """Megatron-Core 0.19.2's help of --moe-paged-stash-buffer-size-factor-cuda holds a bare
    '%', so argparse's --help raises ValueError; add_mhc_arguments escapes it there and
    changes no other help string."""
    import megatron.core

    from mhc_megatron.training.arguments import KNOWN_UNFORMATTABLE_HELP

    parser = _megatron_parser()
    before = [(action, action.help) for action in parser._actions]
    known = KNOWN_UNFORMATTABLE_HELP.get(megatron.core.__version__.split("+")[0], ())
    if known:
        with pytest.raises(ValueError, match="unsupported format character"):
            parser.format_help()
    add_mhc_arguments(parser)
    changed = {a.option_strings[0]: text for a, text in before if a.help != text}
    assert sorted(changed) == sorted(known)
    for option, text in changed.items():
        assert text.count("%") == 1 and parser._option_string_actions[option].help == \
            text.replace("%", "%%")
    text = " ".join(parser.format_help().split())
    assert "Magnitude is headroom (e.g. 1.10 = 10%)." in text or not known


def test_help_repair_safety_net_escapes_only_bare_percent():
    """Any action whose help argparse cannot format is repaired, whatever the release:
    bare '%' doubled; '%%' and %(default)s placeholders kept; formattable helps untouched."""
    import argparse

    from mhc_megatron.training.arguments import repair_help_strings

    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--ratio", default=7, help="at most 50% (default %(default)s, 100%%)")
    parser.add_argument("--fine", default=3, help="fine: %(default)s")
    parser.add_argument("--unknown-key", help="%(nonexistent)s and 5%")
    assert repair_help_strings(parser) == ["--ratio", "--unknown-key"]
    text = " ".join(parser.format_help().split())
    assert "at most 50% (default 7, 100%)" in text and "fine: 3" in text
    assert "%(nonexistent)s and 5%" in text
    assert repair_help_strings(parser) == []  # idempotent


MEGATRON_FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--use-distributed-optimizer", "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("mhc", [[], ["--enable-hyper-connections"]], ids=["baseline", "mhc"])
def test_megatron_refuses_megatron_fsdp_checkpoints_without_megatron_fsdp(mhc, monkeypatch):
    """Megatron-Core 0.19.2's loop cannot move a Megatron-FSDP checkpoint into a model without
    Megatron-FSDP, for any model: Megatron-FSDP saves only ``fsdp_dtensor``, and
    ``fsdp_dtensor`` loads only under Megatron-FSDP (both refused at argument validation,
    mHC or not). Such a checkpoint loads into a plain model by torch's distributed checkpoint
    (``tests/distributed/fsdp_equivalence.py``, on GPUs)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # (Megatron-FSDP's requirement)
    with pytest.raises(AssertionError, match="Megatron-FSDP requires the `fsdp_dtensor`"):
        _args(*mhc, *MEGATRON_FSDP, "--ckpt-format", "torch_dist", monkeypatch=monkeypatch)
    with pytest.raises(AssertionError, match="fsdp_dtensor is only tested with Megatron FSDP"):
        _args(*mhc, "--ckpt-format", "fsdp_dtensor", monkeypatch=monkeypatch)
