"""Transformer configs with the mHC (manifold-constrained hyper-connection) fields.

``MHCTransformerConfig`` extends Megatron-Core's ``TransformerConfig`` and
``MHCMLATransformerConfig`` its ``MLATransformerConfig`` (DeepSeek-style MLA). Both are
plain dataclasses, so ``dataclasses.replace`` keeps the subclass, and both validate the
mHC fields in ``__post_init__``: every combination this version does not implement is
refused with a ``ValueError`` that names the field(s) and the fix. Nothing is silently
ignored.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mhc_megatron._logging import log_rank0
from mhc_megatron.kernels import KERNEL_BACKENDS
from mhc_megatron.kernels.reference import MappingForm

_logger = logging.getLogger(__name__)

PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, None)

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(field_names: str, problem: str, fix: str) -> None:
    raise ValueError(f"mHC config: {field_names}: {problem}. Fix: {fix}.")


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """``TransformerConfig`` plus manifold-constrained hyper-connections (arXiv 2512.24880).

    With ``enable_hyper_connections=True`` the decoder carries ``n =
    num_residual_streams`` residual streams laid out stream-major as ``[s, b, n*C]``
    (stream ``i`` is ``x[..., i*C:(i+1)*C]``, ``C = hidden_size``). Every residual
    sublayer (attention, MLP/MoE) gets its own dynamic mapping.
    """

    enable_hyper_connections: bool = False
    """Turn mHC on. Off, an mHC layer spec behaves exactly like Megatron's own layer."""

    num_residual_streams: int = 4
    """n, the number of residual streams (expansion rate). n=1 is allowed (a learned,
    per-token scaled residual); the paper uses n=4."""

    mhc_sinkhorn_iterations: int = 20
    """t_max: Sinkhorn-Knopp iterations (one row and one column normalisation each)."""

    mhc_init_gating_factor: float = 0.1
    """Initial value of the gating scalars alpha_pre/alpha_post/alpha_res: the size of the
    per-token (dynamic) part of the mappings at step 0. 0.1, ten times the paper's 0.01, is
    what trained best in our quality study (docs/results/study/REPORT.md): the dynamic part
    is what makes the n streams differ, and H_res gets gradients only once they do."""

    mhc_init_static_mapping: Literal["residual", "zero"] = "zero"
    """The static mapping (``bias``) at step 0. "zero" (the default, as Megatron-LM's in-tree
    mHC): an all-zero bias, i.e. H_pre = 1/2, H_post = 1, H_res uniform 1/n; it trained best
    in the quality study and keeps the composite gain of the H_res product at 1 (Sinkhorn
    converges fast from uniform). "residual": H_pre = 1/n, H_post = 1 and H_res with diagonal
    ``mhc_init_res_diagonal`` (the model starts as a standard residual network up to O(alpha)
    terms)."""

    mhc_init_res_diagonal: float = 0.95
    """Diagonal of H_res at step 0 with ``mhc_init_static_mapping="residual"``, in
    [1/n, 1): 1/n is uniform mixing, values near 1 keep each stream to itself."""

    mhc_rms_eps: float = 1e-6
    """Epsilon of the RMS normalisation of the flattened streams (fp32)."""

    mhc_variant: Literal["paper", "deepseek_v4"] = "paper"
    """The conventions, as one preset. "paper" (arXiv 2512.24880): the defaults of the fields
    below. "deepseek_v4" (DeepSeek-V4, as Hugging Face's ``modeling_deepseek_v4`` implements
    it): ``mhc_mapping_form="deepseek_v4"``, ``mhc_res_transposed=True``,
    ``mhc_output_head=True`` (one head per final norm: the decoder's and each MTP depth's), and
    the mapping parameters stored in fp32 (``mhc_params_dtype=torch.float32``). Each of those
    fields left unset (None) takes the preset's value; one set to another value is refused (use
    ``mhc_variant="paper"`` and the single fields for a mix)."""

    mhc_mapping_form: Optional[Literal["paper", "deepseek_v4"]] = None
    """How the per-token logits become the mappings (None: ``mhc_variant``'s). "paper" (arXiv
    2512.24880): H_pre = sigmoid, H_post = 2 sigmoid, H_res = log-domain Sinkhorn-Knopp of
    exp(logits). "deepseek_v4" (DeepSeek-V4; Hugging Face's ``DeepseekV4HyperConnection``):
    H_pre = sigmoid + eps, H_post = 2 sigmoid, H_res = a row softmax + eps, one column
    normalisation, then ``mhc_sinkhorn_iterations - 1`` row and column normalisations, each
    dividing by (sum + eps), with eps = ``mhc_mapping_eps``. The parameters (phi, alpha,
    bias) are the same in both forms, and both run on the fused Triton kernels and the
    PyTorch reference."""

    mhc_mapping_eps: float = 1e-6
    """eps of the "deepseek_v4" mapping form (DeepSeek-V4's ``hc_eps``); unused by "paper"."""

    mhc_res_transposed: Optional[bool] = None
    """Mix the streams with H_res transposed, ``x'_i = sum_j H_res[j, i] x_j`` (DeepSeek-V4's
    ``comb^T @ h``), instead of the paper's ``H_res x`` (None: ``mhc_variant``'s, False for
    "paper"). H_res is doubly stochastic but not
    symmetric, so a checkpoint trained one way computes another function the other way."""

    mhc_output_head: Optional[bool] = None
    """Contract the streams before the final norm (the decoder's, and each MTP depth's) with
    DeepSeek-V4's learned head (its ``hc_head``): a per-token weighted sum ``sum_i w_i x_i``,
    ``w = sigmoid(alpha * (vec(x) @ phi^T) / r + bias) + mhc_mapping_eps`` with its own
    ``phi [n, n*C]``, ``alpha [1]``, ``bias [n]``, instead of the plain sum (the default).
    Under the plain sum the last sublayer's H_res cancels out (its columns sum to 1, so
    ``sum_i (H_res x)_i = sum_j x_j``) and never learns; the learned head weighs the streams
    apart. Runs on the ``mhc_kernel_backend``'s ops. None: ``mhc_variant``'s, False for
    "paper"."""

    mhc_kernel_backend: Literal["auto", "triton", "reference"] = "auto"
    """Which implementation of the mHC ops runs: "reference" (PyTorch, fp32 inside),
    "triton" (fused kernels; refused with a clear error where they cannot run) or
    "auto" (Triton on CUDA when available and the shape is supported, else reference)."""

    mhc_recompute: bool = False
    """Cross-layer recompute of the mHC activations (MHCRecomputeManager)."""

    mhc_recompute_layer_num: Optional[int] = None
    """Layers per recompute block; None = eq. 20 of the paper, sqrt(n*L/(n+2))."""

    mhc_params_dtype: Optional[torch.dtype] = None
    """Storage dtype of the mapping parameters (phi, alpha, bias). None (default): follow
    ``params_dtype`` like every other weight (with ``mhc_variant="deepseek_v4"``: fp32).
    torch.float32 (as Megatron-LM's in-tree mHC): they stay fp32 through Float16Module and any
    model-wide dtype cast, so the forward never sees bf16-rounded H_res logits. Megatron-Core
    0.19.2's optimisers train such a model but do not checkpoint it by themselves: apply
    ``mhc_megatron.training.fp32_params.make_fp32_params_checkpointable`` to the optimiser
    from ``get_megatron_optimizer``, or run Megatron's ``pretrain`` inside
    ``fp32_params_in_megatron_training()`` (``examples/pretrain_gpt_mhc.py`` does)."""

    def __post_init__(self):
        _derive_pipeline_fields(self)
        # Before Megatron's own checks: where Megatron asserts on the same feature (e.g.
        # inference_optimized layers), the user sees the mHC refusal and its fix instead.
        validate_mhc_config(self)
        super().__post_init__()
        # And after: Megatron derives some fields (cuda_graph_impl from enable_cuda_graph,
        # the virtual pipeline size from num_layers_per_virtual_pipeline_stage, ...).
        validate_mhc_config(self)

    @property
    def mhc_mapping(self) -> MappingForm:
        """The mapping form the mHC ops compute (``mhc_mapping_form``, ``mhc_mapping_eps``,
        ``mhc_res_transposed``)."""
        return MappingForm(mhc_setting(self, "mhc_mapping_form"), float(self.mhc_mapping_eps),
                           mhc_setting(self, "mhc_res_transposed"))

    @property
    def mhc_recompute_block_size(self) -> int:
        """Layers per mHC recompute block: the configured number or the paper's eq. 20."""
        if self.mhc_recompute_layer_num is not None:
            return self.mhc_recompute_layer_num
        n, layers = self.num_residual_streams, self.num_layers
        return max(1, round(math.sqrt(n * layers / (n + 2))))


@dataclass
class MHCMLATransformerConfig(MLATransformerConfig, MHCTransformerConfig):
    """``MLATransformerConfig`` (DeepSeek-style multi-latent attention) plus the mHC fields.

    The base order matters: dataclasses merge fields along the reversed MRO, so
    ``MLATransformerConfig`` must come first for its defaults (``multi_latent_attention=
    True``, ``normalization="RMSNorm"``) to win over the plain ``TransformerConfig`` ones
    that ``MHCTransformerConfig`` inherits. ``__post_init__`` runs MLA's, then ours
    (validation), then ``TransformerConfig``'s, through the cooperative ``super()`` chain.
    """


# The values each preset gives the fields it covers, where they are None.
VARIANTS = {
    "paper": {"mhc_mapping_form": "paper", "mhc_res_transposed": False,
              "mhc_output_head": False},
    "deepseek_v4": {"mhc_mapping_form": "deepseek_v4", "mhc_res_transposed": True,
                    "mhc_output_head": True, "mhc_params_dtype": torch.float32},
}


def mhc_setting(config, name: str):
    """The value of the mHC field ``name`` in effect: the field itself where set, else what
    ``config.mhc_variant`` gives it (None where neither does). Works for any config (a plain
    ``TransformerConfig`` has neither: None)."""
    value = getattr(config, name, None)
    if value is None:
        value = VARIANTS.get(getattr(config, "mhc_variant", "paper"), {}).get(name)
    return value


def _validate_variant(config) -> None:
    """``mhc_variant`` is known, and no field it covers is set to another value."""
    if config.mhc_variant not in VARIANTS:
        _fail("mhc_variant", f"must be one of {sorted(VARIANTS)}, got {config.mhc_variant!r}",
              "use 'paper' (the default) or 'deepseek_v4'")
    if config.mhc_variant == "paper":
        return
    for field, value in VARIANTS[config.mhc_variant].items():
        current = getattr(config, field)
        if current is not None and current != value:
            _fail(f"mhc_variant / {field}",
                  f"mhc_variant={config.mhc_variant!r} sets {field}={value!r}, but it is "
                  f"{current!r}",
                  f"leave {field} unset (None) with the preset, or use mhc_variant='paper' and "
                  "set the fields one by one")


def _derive_pipeline_fields(config) -> None:
    """With pipeline parallelism the n streams ``[s, b, n*C]`` cross the stage boundaries,
    but Megatron's schedules size their fixed P2P buffers ``[s, b, hidden_size]``. mHC therefore
    turns on ``variable_seq_lengths`` (Megatron sends each tensor's 3-int shape ahead of it;
    ``megatron.training`` has no flag for it and always sets it False). Megatron 0.19 refuses
    that with the ``allgather`` token dispatcher even in dense models, where the dispatcher is
    never built, so a dense model's dispatcher field becomes ``alltoall``; an MoE model with
    ``allgather`` is refused by :func:`validate_mhc_config`. Logged once."""
    if config.enable_hyper_connections is not True or config.pipeline_model_parallel_size <= 1:
        return
    changed = []
    if not config.variable_seq_lengths:
        config.variable_seq_lengths = True
        changed.append("variable_seq_lengths=True")
    if config.num_moe_experts is None and config.moe_token_dispatcher_type == "allgather":
        config.moe_token_dispatcher_type = "alltoall"  # unused without experts
        changed.append("moe_token_dispatcher_type='alltoall' (unused: no experts)")
    if changed and not getattr(_derive_pipeline_fields, "logged", False):
        _derive_pipeline_fields.logged = True
        log_rank0(_logger, logging.INFO,
                  "mHC with pipeline parallelism: the stage boundaries carry the n streams "
                  "[s, b, n*C], so Megatron's P2P exchanges shapes first; set %s",
                  ", ".join(changed))


def validate_mhc_config(config: MHCTransformerConfig) -> None:
    """Raise ``ValueError`` for every mHC setting or combination this version refuses."""
    if not isinstance(config.enable_hyper_connections, bool):
        _fail("enable_hyper_connections", f"must be a bool, got {config.enable_hyper_connections!r}",
              "pass True or False")
    n = config.num_residual_streams
    if not _is_int(n) or n < 1:
        _fail("num_residual_streams", f"must be an int >= 1, got {n!r}",
              "use the number of residual streams n (the paper uses 4)")
    t = config.mhc_sinkhorn_iterations
    if not _is_int(t) or t < 1:
        _fail("mhc_sinkhorn_iterations", f"must be an int >= 1, got {t!r}",
              "use the paper's 20")
    if config.mhc_init_static_mapping not in ("residual", "zero"):
        _fail("mhc_init_static_mapping", f"must be 'residual' or 'zero', got "
              f"{config.mhc_init_static_mapping!r}", "use 'zero' (the default) or 'residual'")
    d = config.mhc_init_res_diagonal
    if isinstance(n, int) and n > 1 and (isinstance(d, bool) or not isinstance(d, (int, float))
                                         or not 1.0 / n <= d < 1.0):
        _fail("mhc_init_res_diagonal", f"must be a float in [1/n, 1) = [{1.0 / n:g}, 1) for "
              f"n={n}, got {d!r}", "use e.g. 0.95 (near-identity) or 1/n (uniform)")
    g = config.mhc_init_gating_factor
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
        _fail("mhc_init_gating_factor", f"must be a finite float >= 0, got {g!r}",
              "use the default 0.1 (or the paper's 0.01)")
    eps = config.mhc_rms_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        _fail("mhc_rms_eps", f"must be a float > 0, got {eps!r}", "use e.g. 1e-6")
    if config.mhc_params_dtype not in PARAMS_DTYPES:
        _fail("mhc_params_dtype", f"must be one of {PARAMS_DTYPES}, got {config.mhc_params_dtype!r}",
              "use None (the default: follow params_dtype) or torch.float32")
    _validate_variant(config)
    if config.mhc_mapping_form not in (None, "paper", "deepseek_v4"):
        _fail("mhc_mapping_form", f"must be 'paper' or 'deepseek_v4', got "
              f"{config.mhc_mapping_form!r}", "use 'paper', 'deepseek_v4' or None (the preset's)")
    e = config.mhc_mapping_eps
    if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e <= 0:
        _fail("mhc_mapping_eps", f"must be a finite float > 0, got {e!r}",
              "use DeepSeek-V4's 1e-6 (the default)")
    if config.mhc_output_head is not None and not isinstance(config.mhc_output_head, bool):
        _fail("mhc_output_head", f"must be a bool or None, got {config.mhc_output_head!r}",
              "pass True (DeepSeek-V4's learned head), False (the plain sum) or None (the "
              "preset's)")
    if config.mhc_res_transposed is not None and not isinstance(config.mhc_res_transposed, bool):
        _fail("mhc_res_transposed", f"must be a bool or None, got {config.mhc_res_transposed!r}",
              "pass True (DeepSeek-V4's H_res^T x), False (the paper's H_res x) or None (the "
              "preset's)")
    if config.mhc_kernel_backend not in KERNEL_BACKENDS:
        _fail("mhc_kernel_backend", f"unknown backend {config.mhc_kernel_backend!r}",
              f"use one of {KERNEL_BACKENDS}")
    if not isinstance(config.mhc_recompute, bool):
        _fail("mhc_recompute", f"must be a bool, got {config.mhc_recompute!r}", "pass True or False")
    k = config.mhc_recompute_layer_num
    if k is not None and (not _is_int(k) or k < 1):
        _fail("mhc_recompute_layer_num", f"must be None or an int >= 1, got {k!r}",
              "leave it None for the paper's eq. 20 block size, or give a positive layer count")

    if not config.enable_hyper_connections:
        return

    if config.pipeline_model_parallel_size > 1 and config.num_moe_experts and \
            config.moe_token_dispatcher_type == "allgather":
        _fail("moe_token_dispatcher_type",
              "mHC with pipeline parallelism needs variable_seq_lengths (the stage boundaries "
              "carry [s, b, n*C]), which Megatron 0.19 refuses with the allgather dispatcher",
              "set moe_token_dispatcher_type='alltoall' (--moe-token-dispatcher-type alltoall)")
    if config.pipeline_model_parallel_size == 2 and \
            config.virtual_pipeline_model_parallel_size is not None and \
            config.batch_p2p_comm and not config.overlap_p2p_comm:
        _fail("batch_p2p_comm / overlap_p2p_comm",
              "the interleaved schedule at pipeline_model_parallel_size=2 with batched P2P "
              "posts a send and a receive in each direction between the same two ranks in one "
              "batch, and NCCL matches them in order, not by direction: activations and "
              "gradients land in each other's buffers, silently (the streams and their "
              "gradients have one shape; megatron.training refuses this layout too)",
              "set overlap_p2p_comm=True and batch_p2p_comm=False (megatron.training's "
              "default for the interleaved schedule), or use pipeline_model_parallel_size > 2")
    if config.mhc_recompute and config.recompute_granularity == "full":
        _fail("mhc_recompute / recompute_granularity",
              "mhc_recompute=True with 'full' recompute is not supported: Megatron's full "
              "recompute already replays whole layers (the mHC ops included) in backward, and "
              "an mHC recompute block spanning one of its checkpoint chunks would replay ops its "
              "first, gradient-free forward never recorded",
              "use one of them: recompute_granularity='full' alone (the least memory), or "
              "mhc_recompute=True with recompute_granularity=None/'selective'")
    if config.mhc_recompute and config.recompute_granularity == "selective" and \
            "mlp" in (config.recompute_modules or []):
        _fail("recompute_modules", "'mlp' selective recompute with mhc_recompute=True is not "
              "supported: Megatron checkpoints the MLP with its reentrant CheckpointFunction, "
              "whose backward recurses without end on CPU even for a plain Megatron model, so the "
              "combination cannot be verified",
              "drop 'mlp' from recompute_modules (keep 'core_attn', 'layernorm', 'moe', "
              "'moe_act', ...) or set mhc_recompute=False")
    if config.apply_residual_connection_post_layernorm:
        _fail("apply_residual_connection_post_layernorm",
              "the residual of an mHC layer is the n-stream state, not a layernorm output",
              "set apply_residual_connection_post_layernorm=False")
    _validate_cuda_graphs(config)
    _validate_offloading(config)
    if config.moe_single_grouped_weight and config.use_cpu_initialization:
        _fail("moe_single_grouped_weight / use_cpu_initialization",
              "Transformer Engine's single grouped expert weight (its GroupedTensor, TE 2.20.2) "
              "does not follow the move of a model built on the CPU to the GPU (Megatron's "
              ".cuda(), or .to('cuda')): the buffer its grouped GEMM reads stays in host "
              "memory, and the first expert GEMM fails to launch or faults with an illegal "
              "memory access (Megatron's own model too)",
              "build the model on its GPU: use_cpu_initialization=False (drop "
              "--use-cpu-initialization and --lazy-mpu-init), or set "
              "moe_single_grouped_weight=False (one weight per expert)")
    if config.overlap_moe_expert_parallel_comm and _last_layer_is_dense(config):
        _fail("overlap_moe_expert_parallel_comm / moe_layer_freq",
              "the decoder's last layer is dense, and Megatron-Core 0.19.2's EP-overlap "
              "schedule applies the decoder's final norm only in a MoE layer's last node (a "
              "plain Megatron model then skips its final norm silently; an mHC model's final "
              "norm also contracts the streams)",
              "make the last layer a MoE layer (moe_layer_freq, e.g. dense layers first as "
              "DeepSeek's), or set overlap_moe_expert_parallel_comm=False")
    if config.overlap_moe_expert_parallel_comm and config.mhc_recompute:
        _fail("overlap_moe_expert_parallel_comm / mhc_recompute",
              "the MoE EP-overlap schedule runs a layer as separate schedule nodes, each with "
              "its own autograd graph, and mhc_recompute's blocks replay whole layers across "
              "them",
              "set mhc_recompute=False (the overlap's own memory savings remain), or "
              "overlap_moe_expert_parallel_comm=False")
    if config.overlap_moe_expert_parallel_comm and config.fine_grained_activation_offloading \
            and "mlp_norm" in (config.offload_modules or []):
        _fail("overlap_moe_expert_parallel_comm / offload_modules",
              "offloading 'mlp_norm' (an mHC layer's MLP input streams) is not supported with "
              "the MoE EP-overlap schedule's mHC nodes",
              "drop 'mlp_norm' from offload_modules, or set "
              "overlap_moe_expert_parallel_comm=False")
    if config.inference_fuse_tp_communication:
        _fail("inference_fuse_tp_communication",
              "the fused residual-add of the inference kernels bypasses the mHC combine",
              "set inference_fuse_tp_communication=False")
    if config.transformer_impl == "inference_optimized":
        _fail("transformer_impl", "'inference_optimized' layers fuse the residual add",
              "use transformer_impl='local' or 'transformer_engine'")


def _last_layer_is_dense(config) -> bool:
    """Whether the decoder's last layer has a dense MLP (Megatron's ``moe_layer_freq``: an int
    k makes every k-th layer from the first MoE, a list gives one 0/1 a layer)."""
    if not config.num_moe_experts:
        return True
    freq, last = config.moe_layer_freq, config.num_layers - 1
    if isinstance(freq, int):
        return last % freq != 0
    if isinstance(freq, (list, tuple)) and freq:
        return not freq[-1]
    return False


# Partial MoE graph scopes: the graph ends after the router (and the dispatch preprocess), and
# Megatron resumes the layer with ``_forward_post_mlp(output, residual)``, outside the mHC
# hooks of ``_forward_mlp``, so the expand-combine would never see the streams.
_PARTIAL_MOE_GRAPH_SCOPES = ("moe_router", "moe_preprocess")


def _graph_impl(config) -> str:
    """The CUDA-graph implementation in effect (Megatron maps the deprecated flags to it only
    in its own ``__post_init__``, which runs after our first validation)."""
    if config.enable_cuda_graph:
        return "local"
    if config.external_cuda_graph:
        return "transformer_engine"
    return config.cuda_graph_impl


def _validate_cuda_graphs(config) -> None:
    """CUDA graphs with mHC: per-layer graphs (``local``, ``transformer_engine``) capture the
    whole ``HyperConnectionTransformerLayer`` forward, the mHC ops included (static shapes:
    ``get_layer_static_inputs`` gives ``[s, b, n*C]``, ``[s, b, C]`` for layer 1; the Triton
    kernels and their dispatch neither sync with the host nor allocate outside the graph
    pool), and so does ``full_iteration``. Refused: the partial MoE scopes, and mhc_recompute
    with per-layer graphs."""
    impl = _graph_impl(config)
    if impl == "none":
        return
    scopes = {getattr(m, "name", m) for m in (config.cuda_graph_modules or [])}
    partial = sorted(scopes.intersection(_PARTIAL_MOE_GRAPH_SCOPES))
    if partial:
        _fail("cuda_graph_modules",
              f"{partial} end the graph inside the MoE sublayer and resume the layer through "
              "Megatron's _forward_post_mlp with its residual, bypassing the mHC combine of "
              "the n streams",
              "capture whole layers (cuda_graph_modules=[]) or the 'attn' / 'moe' / 'mlp' "
              "scopes")
    if config.mhc_recompute and impl in ("local", "transformer_engine"):
        _fail("mhc_recompute / cuda_graph_impl",
              f"mhc_recompute with per-layer CUDA graphs ({impl!r}) is not supported: a "
              "recompute block spans several layers, and its recompute runs in the backward of "
              "the block's last layer, from Python state the other layers' graphs never see "
              "on replay",
              "use mhc_recompute=False with per-layer graphs (or Megatron's selective "
              "recompute), or cuda_graph_impl='none' with mhc_recompute=True")


STREAM_OFFLOAD_MODULES = ("attn_norm", "mlp_norm")


def _validate_offloading(config) -> None:
    """Activation offloading with mHC. ``fine_grained_activation_offloading`` is supported:
    every offload module does what it does in Megatron's layer, and ``attn_norm`` /
    ``mlp_norm`` also offload the sublayer's input streams ``[s, b, n*C]`` and release them
    after the combine, as Megatron releases its residual
    (:mod:`mhc_megatron.layers.stream_offload`). Refused: the legacy ``cpu_offloading``, and
    the stream offload together with mhc_recompute or full recompute; offloading with CUDA
    graphs."""
    if config.cpu_offloading:
        _fail("cpu_offloading",
              "the legacy layer-level offloading (Transformer Engine's CPU offload context "
              "around whole layers) is not verified with the n-stream residual, and "
              "mhc_recompute's saved-tensor hooks would take precedence over it inside each "
              "layer",
              "use fine_grained_activation_offloading=True with 'attn_norm' / 'mlp_norm' in "
              "offload_modules (--fine-grained-activation-offloading --offload-modules "
              "attn_norm mlp_norm): they offload the n streams; or set cpu_offloading=False")
    if not config.fine_grained_activation_offloading:
        return
    streams = [m for m in STREAM_OFFLOAD_MODULES if m in (config.offload_modules or [])]
    if streams and config.mhc_recompute:
        _fail("mhc_recompute / offload_modules",
              f"mhc_recompute=True with {streams} in offload_modules is not supported: those "
              "modules offload the sublayer's input streams and free their GPU storage after "
              "the combine, and the recompute replays its blocks from those streams",
              "use one of them for the n streams: mhc_recompute=True with offload_modules "
              "without 'attn_norm' / 'mlp_norm' (e.g. ['qkv_linear'] or ['core_attn', "
              "'attn_proj']), or the offload of 'attn_norm' / 'mlp_norm' with "
              "mhc_recompute=False")
    if streams and config.recompute_granularity == "full":
        _fail("recompute_granularity / offload_modules",
              f"full recompute with {streams} in offload_modules is not supported: full "
              "recompute re-runs each layer's forward inside backward, where the streams' "
              "offload group would be opened and committed while Megatron is reloading, and "
              "the release of the streams would free the recompute's saved layer input",
              "drop 'attn_norm' / 'mlp_norm' from offload_modules, or use "
              "recompute_granularity='selective' (or None)")
    if _graph_impl(config) != "none":
        _fail("fine_grained_activation_offloading / cuda_graph_impl",
              "fine-grained activation offloading with CUDA graphs is not verified with mHC "
              "layers (the offload groups would be opened and committed inside the captured "
              "layers)",
              "set cuda_graph_impl='none', or fine_grained_activation_offloading=False")


def hyper_connections_enabled(config: TransformerConfig) -> bool:
    """True when ``config`` is an mHC config with ``enable_hyper_connections=True``."""
    return bool(getattr(config, "enable_hyper_connections", False))
