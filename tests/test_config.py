"""MHCTransformerConfig: defaults, subclass behaviour and every documented refusal."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from helpers import CONFIG_BASE, assert_refused

from mhc_megatron.config import MHCMLATransformerConfig, MHCTransformerConfig

BASE = CONFIG_BASE


def test_defaults_and_subclassing():
    cfg = MHCTransformerConfig(**BASE)
    assert isinstance(cfg, TransformerConfig)
    assert (cfg.num_residual_streams, cfg.mhc_sinkhorn_iterations, cfg.mhc_init_gating_factor,
            cfg.mhc_kernel_backend, cfg.mhc_recompute, cfg.mhc_recompute_layer_num,
            cfg.mhc_params_dtype) == (4, 20, 0.1, "auto", False, None, None)
    # The initialisation the quality study chose (docs/results/study/REPORT.md).
    assert (cfg.mhc_init_static_mapping, cfg.mhc_init_res_diagonal) == ("zero", 0.95)
    replaced = dataclasses.replace(cfg, num_residual_streams=2)
    assert type(replaced) is MHCTransformerConfig and replaced.num_residual_streams == 2
    with pytest.raises(ValueError, match="num_residual_streams"):
        dataclasses.replace(cfg, num_residual_streams=0)


def test_mla_variant():
    cfg = MHCMLATransformerConfig(**BASE, q_lora_rank=16, kv_lora_rank=16,
                                  qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)
    assert isinstance(cfg, MLATransformerConfig) and isinstance(cfg, MHCTransformerConfig)
    assert cfg.multi_latent_attention and cfg.enable_hyper_connections
    assert cfg.normalization == MLATransformerConfig.normalization == "RMSNorm"
    with pytest.raises(ValueError, match="mhc_sinkhorn_iterations"):  # the mHC checks run too
        MHCMLATransformerConfig(**BASE, mhc_sinkhorn_iterations=0)


@pytest.mark.parametrize("layers,n,expected", [(8, 4, 2), (64, 4, 7), (61, 4, 6), (1, 1, 1)])
def test_recompute_block_size_defaults_to_eq20(layers, n, expected):
    cfg = MHCTransformerConfig(**{**BASE, "num_layers": layers}, num_residual_streams=n)
    assert cfg.mhc_recompute_block_size == expected == max(1, round(math.sqrt(n * layers / (n + 2))))
    cfg = MHCTransformerConfig(**BASE, mhc_recompute_layer_num=3)
    assert cfg.mhc_recompute_block_size == 3


# Megatron's MoE EP-overlap schedule (its own requirements: EP > 1, alltoall, bf16)
EP_OVERLAP = dict(overlap_moe_expert_parallel_comm=True, num_moe_experts=4,
                  expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                  bf16=True, pipeline_dtype=torch.bfloat16)

REFUSED = {
    "n_zero": (dict(num_residual_streams=0), "num_residual_streams"),
    "n_bool": (dict(num_residual_streams=True), "num_residual_streams"),
    "n_float": (dict(num_residual_streams=4.0), "num_residual_streams"),
    "sinkhorn_zero": (dict(mhc_sinkhorn_iterations=0), "mhc_sinkhorn_iterations"),
    "gating_negative": (dict(mhc_init_gating_factor=-0.1), "mhc_init_gating_factor"),
    "gating_nan": (dict(mhc_init_gating_factor=float("nan")), "mhc_init_gating_factor"),
    "eps_zero": (dict(mhc_rms_eps=0.0), "mhc_rms_eps"),
    "backend": (dict(mhc_kernel_backend="cuda"), "mhc_kernel_backend"),
    "mapping_form_unknown": (dict(mhc_mapping_form="deepseek"), "mhc_mapping_form"),
    "mapping_eps_zero": (dict(mhc_mapping_eps=0.0), "mhc_mapping_eps"),
    "mapping_eps_inf": (dict(mhc_mapping_eps=float("inf")), "mhc_mapping_eps"),
    "res_transposed_not_bool": (dict(mhc_res_transposed=1), "mhc_res_transposed"),
    "output_head_not_bool": (dict(mhc_output_head="yes"), "mhc_output_head"),
    "variant_unknown": (dict(mhc_variant="deepseek_v3"), "mhc_variant"),
    # a preset and a field it sets, set to another value: refused, not overridden
    "variant_vs_mapping_form": (dict(mhc_variant="deepseek_v4", mhc_mapping_form="paper"),
                                "mhc_variant / mhc_mapping_form"),
    "variant_vs_output_head": (dict(mhc_variant="deepseek_v4", mhc_output_head=False),
                               "mhc_variant / mhc_output_head"),
    "variant_vs_params_dtype": (dict(mhc_variant="deepseek_v4", mhc_params_dtype=torch.bfloat16),
                                "mhc_params_dtype"),
    "enable_not_bool": (dict(enable_hyper_connections="yes"), "enable_hyper_connections"),
    "recompute_not_bool": (dict(mhc_recompute=1), "mhc_recompute"),
    "layer_num_zero": (dict(mhc_recompute_layer_num=0), "mhc_recompute_layer_num"),
    "layer_num_negative": (dict(mhc_recompute_layer_num=-2), "mhc_recompute_layer_num"),
    "layer_num_bool": (dict(mhc_recompute_layer_num=True), "mhc_recompute_layer_num"),
    "params_dtype_int": (dict(mhc_params_dtype=torch.int32), "mhc_params_dtype"),
    "params_dtype_str": (dict(mhc_params_dtype="fp32"), "mhc_params_dtype"),
    "static_mapping_unknown": (dict(mhc_init_static_mapping="identity"), "mhc_init_static_mapping"),
    "res_diagonal_below_uniform": (dict(mhc_init_res_diagonal=0.2), "mhc_init_res_diagonal"),
    "res_diagonal_one": (dict(mhc_init_res_diagonal=1.0), "mhc_init_res_diagonal"),
    "mlp_recompute_with_mhc_recompute": (
        dict(mhc_recompute=True, recompute_granularity="selective", recompute_modules=["mlp"]),
        "recompute_modules"),
    "pipeline_moe_allgather": (dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                    num_moe_experts=4, moe_token_dispatcher_type="allgather"),
                               "moe_token_dispatcher_type"),
    # the interleaved schedule at PP=2 with batched P2P (TransformerConfig's defaults):
    # NCCL (and gloo) match the two directions' sends and receives in order, so activations
    # and gradients swap buffers (tests/distributed/pp_equivalence.py in this layout on CPU
    # ranks: micro-batch 2's loss is off, gradients are off by more than their own norm)
    "interleaved_pp2_batched_p2p": (dict(pipeline_model_parallel_size=2,
                                         virtual_pipeline_model_parallel_size=2,
                                         pipeline_dtype=torch.float32),
                                    "batch_p2p_comm / overlap_p2p_comm"),
    "full_recompute_with_mhc_recompute": (
        dict(mhc_recompute=True, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=1), "recompute_granularity"),
    "post_ln_residual": (dict(apply_residual_connection_post_layernorm=True),
                         "apply_residual_connection_post_layernorm"),
    "cuda_graph_moe_router_scope": (
        dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router"],
             num_moe_experts=4, moe_token_dispatcher_type="alltoall"), "cuda_graph_modules"),
    "cuda_graph_local_moe_preprocess": (
        dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router", "moe_preprocess"],
             num_moe_experts=4, moe_token_dispatcher_type="alltoall"), "cuda_graph_modules"),
    "cuda_graph_local_mhc_recompute": (dict(cuda_graph_impl="local", mhc_recompute=True),
                                       "mhc_recompute / cuda_graph_impl"),
    "cuda_graph_te_mhc_recompute": (dict(cuda_graph_impl="transformer_engine",
                                         mhc_recompute=True), "mhc_recompute / cuda_graph_impl"),
    "enable_cuda_graph_mhc_recompute": (dict(enable_cuda_graph=True, mhc_recompute=True),
                                        "mhc_recompute / cuda_graph_impl"),
    "cpu_offloading": (dict(cpu_offloading=True, cpu_offloading_num_layers=1), "cpu_offloading"),
    # fine_grained_activation_offloading itself is supported (tests/test_offloading.py)
    "stream_offloading_with_mhc_recompute": (
        dict(fine_grained_activation_offloading=True, offload_modules=["attn_norm"],
             mhc_recompute=True), "mhc_recompute / offload_modules"),
    "moe_ep_overlap_dense_last_layer": (dict(EP_OVERLAP, num_layers=2, moe_layer_freq=[1, 0]),
                                        "overlap_moe_expert_parallel_comm / moe_layer_freq"),
    "moe_ep_overlap_dense_last_layer_freq": (dict(EP_OVERLAP, num_layers=4, moe_layer_freq=2),
                                             "overlap_moe_expert_parallel_comm / moe_layer_freq"),
    "moe_ep_overlap_mhc_recompute": (dict(EP_OVERLAP, mhc_recompute=True),
                                     "overlap_moe_expert_parallel_comm / mhc_recompute"),
    "single_grouped_weight_built_on_cpu": (
        dict(num_moe_experts=4, moe_grouped_gemm=True, moe_single_grouped_weight=True,
             use_cpu_initialization=True), "moe_single_grouped_weight / use_cpu_initialization"),
    "moe_ep_overlap_mlp_norm_offload": (
        dict(EP_OVERLAP, fine_grained_activation_offloading=True, offload_modules=["mlp_norm"]),
        "overlap_moe_expert_parallel_comm / offload_modules"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(case):
    assert_refused(*REFUSED[case])


@pytest.mark.parametrize("overrides,field", [
    (dict(transformer_impl="inference_optimized"), "transformer_impl"),
    (dict(transformer_impl="inference_optimized", inference_fuse_tp_communication=True),
     "inference_fuse_tp_communication"),
])
def test_refused_inference_optimized(overrides, field):
    """Refused by us before Megatron's own assertions on these layers (with or without TE)."""
    with pytest.raises(ValueError, match=rf"mHC config: .*{field}.*Fix: "):
        MHCTransformerConfig(**{**BASE, **overrides})


def test_moe_ep_overlap_is_accepted():
    """The EP-overlap schedule runs mHC MoE layers through their own schedule nodes
    (:mod:`mhc_megatron.layers.fine_grained`, tests/test_fine_grained.py); dense layers
    before the last are fine."""
    assert MHCTransformerConfig(**{**BASE, **EP_OVERLAP}).overlap_moe_expert_parallel_comm
    assert MHCTransformerConfig(**{**BASE, **EP_OVERLAP, "num_layers": 2,
                                   "moe_layer_freq": [0, 1]}).overlap_moe_expert_parallel_comm


def test_unsupported_settings_are_fine_when_mhc_is_off():
    cfg = MHCTransformerConfig(**{**BASE, "enable_hyper_connections": False},
                               recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)
    assert not cfg.enable_hyper_connections


def test_selective_recompute_is_accepted():
    cfg = MHCTransformerConfig(**BASE, recompute_granularity="selective",
                               recompute_modules=["core_attn", "mlp", "layernorm"])
    assert cfg.recompute_granularity == "selective"


def test_mhc_recompute_is_accepted_with_sublayer_recompute():
    cfg = MHCTransformerConfig(**BASE, mhc_recompute=True, recompute_granularity="selective",
                               recompute_modules=["core_attn", "layernorm", "moe"])
    assert cfg.mhc_recompute and cfg.mhc_recompute_block_size >= 1


def test_fp32_mapping_params_in_a_bf16_model_are_accepted_quietly():
    """Checkpointing them is mhc_megatron.training.fp32_params' job
    (tests/test_fp32_mapping_params.py)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = MHCTransformerConfig(**BASE, bf16=True, params_dtype=torch.bfloat16,
                                   mhc_params_dtype=torch.float32)
    assert cfg.mhc_params_dtype == torch.float32
    assert not [w for w in caught if "mhc_params_dtype" in str(w.message)]


@pytest.mark.parametrize("pp,vp,p2p", [
    (2, None, {}),
    (2, 2, dict(overlap_p2p_comm=True, batch_p2p_comm=False)),  # megatron.training's default
    (4, 2, {}),  # batched P2P: one send and one receive a direction and peer
], ids=["pp2", "pp2_vp2_overlap", "pp4_vp2_batched"])
@pytest.mark.parametrize("experts", [None, 4])
def test_pipeline_parallel_is_accepted_with_shape_exchange(pp, vp, p2p, experts):
    """PP (and virtual stages) are accepted: the n streams cross the stage boundaries, so the
    config turns on Megatron's P2P shape exchange (variable_seq_lengths); a dense model's
    unused dispatcher becomes alltoall, which Megatron requires with it; an MoE model keeps
    the alltoall dispatcher it was given."""
    extra = dict(num_moe_experts=experts, moe_token_dispatcher_type="alltoall") if experts else {}
    cfg = MHCTransformerConfig(**{**BASE, "num_layers": 8}, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vp,
                               pipeline_dtype=torch.float32, **p2p, **extra)
    assert cfg.variable_seq_lengths and cfg.moe_token_dispatcher_type == "alltoall"
    plain = MHCTransformerConfig(**BASE)  # without PP nothing changes
    assert not plain.variable_seq_lengths and plain.moe_token_dispatcher_type == "allgather"



@pytest.mark.parametrize("overrides", [
    dict(cuda_graph_impl="local"),
    dict(cuda_graph_impl="transformer_engine"),
    dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"]),
    dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4,
         moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
         moe_token_dispatcher_type="alltoall"),
    dict(cuda_graph_impl="full_iteration"),
    dict(cuda_graph_impl="full_iteration", mhc_recompute=True),
], ids=["local", "te", "te_attn", "local_attn_moe", "full_iteration", "full_iteration_recompute"])
def test_cuda_graphs_are_accepted(overrides):
    """Whole-layer, attention and whole-MoE graph scopes capture the mHC layer's own forward;
    full-iteration graphs capture the whole step (the recompute hooks included)."""
    config = MHCTransformerConfig(**{**BASE, **overrides})
    assert config.cuda_graph_impl == overrides["cuda_graph_impl"]


def test_deprecated_cuda_graph_flag_is_accepted():
    """Megatron maps enable_cuda_graph to cuda_graph_impl='local' (after our first check)."""
    with pytest.warns(UserWarning, match="enable_cuda_graph is deprecated"):
        config = MHCTransformerConfig(**{**BASE, "enable_cuda_graph": True})
    assert config.cuda_graph_impl == "local"


def test_deepseek_v4_preset_sets_its_fields_and_replace_switches_it():
    """``mhc_variant="deepseek_v4"`` gives DeepSeek-V4's mapping form, H_res transposed, the
    learned output head and fp32 mapping parameters to the fields left unset; a field set to
    the preset's own value is fine; ``dataclasses.replace`` switches the preset either way."""
    import dataclasses

    from mhc_megatron.config import mhc_setting
    from mhc_megatron.kernels.reference import MappingForm

    def settings(c):
        return (c.mhc_mapping, mhc_setting(c, "mhc_output_head"),
                mhc_setting(c, "mhc_params_dtype"))

    ds = (MappingForm("deepseek_v4", 1e-6, True), True, torch.float32)
    paper = (MappingForm("paper", 1e-6, False), False, None)
    c = MHCTransformerConfig(**CONFIG_BASE, mhc_variant="deepseek_v4")
    assert settings(c) == ds
    assert settings(MHCTransformerConfig(**CONFIG_BASE, mhc_variant="deepseek_v4",
                                         mhc_res_transposed=True)) == ds
    assert settings(MHCTransformerConfig(**CONFIG_BASE)) == paper
    assert settings(dataclasses.replace(c, mhc_variant="paper")) == paper
    assert settings(dataclasses.replace(MHCTransformerConfig(**CONFIG_BASE),
                                        mhc_variant="deepseek_v4")) == ds
