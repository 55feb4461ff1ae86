"""HyperConnectionModule: one dynamic mHC mapping around one residual sublayer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from mhc_megatron.config import MHCTransformerConfig, mhc_setting
from mhc_megatron.kernels import select_ops, site_ops
from mhc_megatron.kernels.reference import PAPER, num_mapping_coefficients
from mhc_megatron.layers.streams import is_broadcast_streams
from mhc_megatron.recompute.manager import active_recompute_block, record_as, run_recorded

# Static part of the mapping at step 0 (the dynamic part is O(mhc_init_gating_factor)).
# ``mhc_init_static_mapping="zero"`` (the default): an all-zero bias (H_pre = 1/2,
# H_post = 1, H_res = 1/n), as Megatron-LM's in-tree mHC. ``"residual"``: H_pre = 1/n, so
# the sublayer reads the mean of the streams, which at step 0 (n equal copies of h) is
# exactly the input a standard residual layer would see; H_post = 1, so every stream
# receives the sublayer output, as a standard residual does; H_res with diagonal
# ``mhc_init_res_diagonal`` (default 0.95: identity-dominant, doubly stochastic).
_INIT_H_RES_DIAGONAL = MHCTransformerConfig.mhc_init_res_diagonal
_MAX_INIT_H_PRE = 1.0 - 3e-4  # sigmoid cannot reach 1: n=1 starts at H_pre ~ 1


def initial_mapping_bias(n: int, static: str = "residual",
                         res_diagonal: float = _INIT_H_RES_DIAGONAL) -> Tensor:
    """The static bias ``b [2n + n^2]`` (fp32) described above."""
    if static == "zero":
        return torch.zeros(2 * n + n * n)
    p = min(1.0 / n, _MAX_INIT_H_PRE)
    pre = torch.full((n,), math.log(p / (1.0 - p)))
    post = torch.zeros(n)  # 2 * sigmoid(0) = 1
    res = torch.zeros(n, n)
    if n > 1:
        # Row [1, e^-c, ...] normalises to diagonal 1 / (1 + (n-1) e^-c) = res_diagonal.
        res.fill_(math.log((1.0 - res_diagonal) / ((n - 1) * res_diagonal)))
        res.fill_diagonal_(0.0)
    return torch.cat([pre, post, res.flatten()])


@dataclass
class StreamMappings:
    """Per-token mappings of one sublayer, fp32, tokens flattened (``T = s*b``)."""

    h_pre: Tensor  # [T, n]
    h_post: Tensor  # [T, n]
    h_res: Tensor  # [T, n, n]


class MappingParameters(MegatronModule):
    """The parameters every mHC mapping has: ``phi [rows, n*C]`` (projection of the flattened
    streams), ``alpha [alphas]`` (gating scalars) and ``bias [rows]`` (static part),
    initialised by the subclass's :meth:`reset_parameters`. They are replicated on every
    tensor-parallel rank and tagged ``sequence_parallel`` like Megatron's norm weights (under
    sequence parallelism each TP rank sees other tokens, and ``finalize_model_grads`` sums
    their gradients over the TP group). Stored in ``params_dtype``, or in
    ``config.mhc_params_dtype`` when that is set, kept through model-wide dtype casts
    (:meth:`_apply`).

    ``tensor_model_parallel = False``: Megatron-FSDP's module registry reads it to classify
    the parameters as replicated over tensor parallelism (it knows Megatron's own module
    types by name)."""

    tensor_model_parallel = False

    def __init__(self, config, hidden_size: int | None, rows: int, alphas: int):
        super().__init__(config=config)
        self.n = config.num_residual_streams
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.params_dtype = mhc_setting(config, "mhc_params_dtype")
        kwargs = dict(device=device, dtype=self.params_dtype or config.params_dtype)
        self.phi = torch.nn.Parameter(torch.empty(rows, self.n * self.hidden_size, **kwargs))
        self.alpha = torch.nn.Parameter(torch.empty(alphas, **kwargs))
        self.bias = torch.nn.Parameter(torch.empty(rows, **kwargs))
        if config.perform_initialization:
            self.reset_parameters()
        for p in (self.phi, self.alpha, self.bias):
            p.sequence_parallel = config.sequence_parallel

    def reset_parameters(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must initialise phi, alpha and bias")

    def _apply(self, fn, recurse=True):
        """Device moves apply as usual; dtype casts of the model (``Float16Module``'s
        ``.bfloat16()``, ``model.to(dtype)``, ``.half()``) leave the mapping parameters (and
        their grads) in ``mhc_params_dtype`` when that is set."""
        pinned = self.params_dtype
        if pinned is None:
            return super()._apply(fn, recurse)

        def keep_dtype(t):
            out = fn(t)
            return out.to(pinned) if out.is_floating_point() and out.dtype != pinned else out

        return super()._apply(keep_dtype, recurse)


class StreamOutputHead(MappingParameters):
    """DeepSeek-V4's learned contraction of the streams (its ``hc_head``), used by the final
    norm with ``mhc_output_head=True``: ``[s, b, n*C]`` -> ``[s, b, C]``, ``sum_i w_i x_i``
    with per-token weights ``w = sigmoid(alpha * (vec(x) @ phi^T) / r + bias) + eps``
    (:func:`mhc_megatron.kernels.reference.output_head`; ``eps`` = ``mhc_mapping_eps``, ``r``
    with ``mhc_rms_eps``). ``phi [n, n*C]``, ``alpha [1]``, ``bias [n]``, initialised as
    DeepSeek-V4's (``phi`` ~ ``config.init_method``, ``alpha`` = 1, ``bias`` = 0). Runs the
    op of ``config.mhc_kernel_backend`` (fused Triton, or the PyTorch reference; fp32 inside)
    on the streams as they are (no reshape in the autograd graph)."""

    def __init__(self, config, hidden_size: int | None = None):
        super().__init__(config, hidden_size, config.num_residual_streams, alphas=1)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.config.init_method(self.phi)
        self.alpha.fill_(1.0)
        self.bias.zero_()

    def forward(self, streams: Tensor) -> Tensor:
        s, b, width = streams.shape
        if width != self.n * self.hidden_size:
            raise ValueError(
                f"the output head expects the residual streams [s, b, {self.n}*{self.hidden_size}]"
                f", got {tuple(streams.shape)}. Fix: use mhc_megatron's specs for every layer.")
        ops = select_ops(self.config.mhc_kernel_backend, streams, self.n)
        return ops.output_head(streams, self.phi, self.alpha, self.bias, self.config.mhc_rms_eps,
                               self.config.mhc_mapping_eps, n=self.n)


class HyperConnectionModule(MappingParameters):
    """Dynamic manifold-constrained hyper-connection for one residual sublayer.

    Streams are ``[s, b, n*C]`` stream-major (stream ``i`` is ``x[..., i*C:(i+1)*C]``), or,
    for global layer 1's first sublayer, the n equal streams as a view ``[s, b, n, C]`` of
    the embeddings (:func:`~mhc_megatron.layers.streams.broadcast_streams`: never
    materialised; the combine's output is ``[s, b, n*C]`` either way).
    ``pre`` computes the mappings and the sublayer input ``y = sum_i H_pre[i] x_i``
    (``[s, b, C]``); ``combine`` returns ``x' = H_res x + H_post^T dropout(f + bias)``
    (``[s, b, n*C]``). The mappings are in the config's form (``config.mhc_mapping``: the
    paper's, or DeepSeek-V4's with ``H_res`` transposed). The math is in
    :mod:`mhc_megatron.kernels.reference`; which
    implementation runs is chosen per call from ``config.mhc_kernel_backend``. With
    ``mhc_recompute`` their large outputs are recomputed in backward instead of stored: the
    combine's streams (:func:`~mhc_megatron.recompute.run_recorded`) and pre's ``y``, by the
    aggregate alone from the kept per-token mappings (:func:`~mhc_megatron.recompute.record_as`).

    Parameters (``m = 2n + n^2``; layout documented in the reference module):
      * ``phi``   ``[m, n*C]``  projection (an RMSNorm weight, if any, is folded in);
      * ``alpha`` ``[3]``       gating scalars (pre, post, res), init ``mhc_init_gating_factor``;
      * ``bias``  ``[m]``       static mapping, see :func:`initial_mapping_bias`.
    They are replicated on every tensor-parallel rank and tagged ``sequence_parallel``
    like Megatron's norm weights, so under sequence parallelism (each TP rank sees other
    tokens) ``finalize_model_grads`` sums their gradients over the TP group. They are stored
    in ``params_dtype``, or in ``config.mhc_params_dtype`` when that is set (kept through
    model-wide dtype casts, see :meth:`_apply`; Megatron's optimisers checkpoint such fp32
    parameters of a bf16/fp16 model with :mod:`mhc_megatron.training.fp32_params`). The math
    runs in fp32 whatever the parameter and activation dtypes.
    """

    def __init__(self, config, hidden_size: int | None = None):
        super().__init__(config, hidden_size, num_mapping_coefficients(config.num_residual_streams),
                         alphas=3)
        self.mapping = getattr(config, "mhc_mapping", PAPER)
        # the keywords the module's recorded op calls take (one dict, shared by the records:
        # a recompute block's replay only reads it)
        self._record_kwargs = {"n": self.n}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """phi ~ config.init_method, alpha = mhc_init_gating_factor, bias = static mapping."""
        self.config.init_method(self.phi)
        self.alpha.fill_(self.config.mhc_init_gating_factor)
        self.bias.copy_(initial_mapping_bias(
            self.n, getattr(self.config, "mhc_init_static_mapping",
                            MHCTransformerConfig.mhc_init_static_mapping),
            getattr(self.config, "mhc_init_res_diagonal", _INIT_H_RES_DIAGONAL)))

    def _op_input(self, streams: Tensor) -> tuple[Tensor, int | None]:
        """``(x, n)`` as the ops take the streams, checked: ``[s, b, n*C]`` as they are with
        ``n``; broadcast streams ``[s, b, n, C]`` as tokens ``[s*b, n, C]`` (a view, stream
        stride 0 kept) with ``n`` None. A ValueError for any other shape."""
        expected = self.n * self.hidden_size
        if is_broadcast_streams(streams):
            if streams.shape[2:] != (self.n, self.hidden_size):
                raise ValueError(
                    f"HyperConnectionModule expects broadcast streams [s, b, n, C] = "
                    f"[s, b, {self.n}, {self.hidden_size}], got {tuple(streams.shape)}. Fix: "
                    "build them with mhc_megatron.layers.streams.broadcast_streams(h, n).")
            s, b, n, c = streams.shape
            return streams.view(s * b, n, c), None
        if streams.dim() != 3 or streams.shape[-1] != expected:
            raise ValueError(
                f"HyperConnectionModule expects residual streams [s, b, n*C] = "
                f"[s, b, {self.n}*{self.hidden_size}={expected}], got {tuple(streams.shape)}. "
                "Fix: build the model with mhc_megatron's decoder block spec (its first layer "
                "expands [s, b, C] into n streams and its final norm contracts them)."
            )
        return streams, self.n

    def _ops(self, streams: Tensor):
        return select_ops(self.config.mhc_kernel_backend, streams, self.n, self.mapping)

    def pre(self, streams: Tensor) -> tuple[Tensor, StreamMappings]:
        """``[s, b, n*C]`` -> (sublayer input ``[s, b, C]`` in the streams' dtype, mappings).

        Runs as the module's call (its ``forward``), so that the module's forward pre-hooks
        run before ``phi``, ``alpha`` and ``bias`` are read: Megatron's DDP with
        ``overlap_param_gather`` waits there for these parameters' all-gather after an
        optimiser step of the distributed optimiser."""
        return self(streams)

    def forward(self, streams: Tensor) -> tuple[Tensor, StreamMappings]:
        """:meth:`pre`. The ops take the streams in their layout (``n`` given): no reshape of
        the streams, and so no view node, in the autograd graph. A call like the module's last
        one replays from that call's site in one call into the ops' extension
        (``pre_at_site``), which checks the streams against what that call checked here."""
        config = self.config
        ops = site_ops() if config.mhc_kernel_backend != "reference" else None
        if ops is not None:
            params = self._parameters  # (what self.phi reads, without Module.__getattr__)
            block = active_recompute_block()
            record = None if block is None else self._site_record(block, ops.aggregate)
            outs = ops.pre_at_site(streams, params["phi"], params["alpha"], params["bias"],
                                   (config.mhc_sinkhorn_iterations, config.mhc_rms_eps, self.n,
                                    self.mapping), config.gradient_accumulation_fusion, record)
            if outs is not None:
                y, h_pre, h_post, h_res = outs
                if block is not None and record is None:  # (else recorded in the call)
                    record_as(y, ops.aggregate, streams, h_pre, n=self.n)  # (as below)
                return y, StreamMappings(h_pre, h_post, h_res)
        x, n = self._op_input(streams)
        ops = self._ops(streams)
        y, h_pre, h_post, h_res = ops.pre(x, self.phi, self.alpha, self.bias,
                                          self.config.mhc_sinkhorn_iterations,
                                          self.config.mhc_rms_eps, n=n, form=self.mapping,
                                          main_grads=self.config.gradient_accumulation_fusion)
        # mhc_recompute: only y (as large as a stream) is recomputed, by the aggregate from the
        # kept per-token mappings
        record_as(y, ops.aggregate, x, h_pre, n=n)
        if n is None:  # broadcast streams: y [s*b, C] -> [s, b, C]
            y = y.view(*streams.shape[:2], self.hidden_size)
        return y, StreamMappings(h_pre, h_post, h_res)

    def combine(
        self,
        streams: Tensor,
        output_with_bias: tuple[Tensor, Tensor | None],
        mappings: StreamMappings,
        dropout_prob: float,
        training: bool,
    ) -> Tensor:
        """``x' = H_res x + H_post^T dropout(f + bias)``; ``f`` is ``[s, b, C]`` -> ``[s, b, n*C]``.

        ``output_with_bias`` is what Megatron's sublayers return: ``(f, bias or None)``.
        """
        f, f_bias = output_with_bias
        if training and dropout_prob > 0.0:  # (checked first: f + f_bias needs f's shape)
            self._check_sublayer_output(streams, f)
            f = F.dropout(f if f_bias is None else f + f_bias, p=dropout_prob, training=True)
            f_bias = None
        ops = site_ops() if self.config.mhc_kernel_backend != "reference" else None
        if ops is not None:
            # a call like the last one replays from its site (combine_at_site), which checks
            # the streams and f against what that call checked below
            block = active_recompute_block()
            record = None if block is None else self._site_record(block, ops.combine)
            out = ops.combine_at_site(streams, f, f_bias, mappings.h_res, mappings.h_post,
                                      self._parameters["phi"], self.n, record)
            if out is not None:
                if block is not None and record is None:  # (else recorded in the call)
                    record_as(out, ops.combine, streams, f, f_bias, mappings.h_res,
                              mappings.h_post, n=self.n)  # (as run_recorded below)
                return out
        x, n = self._op_input(streams)
        self._check_sublayer_output(streams, f)
        if n is None:  # broadcast streams: tokens [s*b, n, C] in (f too), [s, b, n*C] out
            f = f.reshape(-1, self.hidden_size)
        out = run_recorded(self._ops(streams).combine, x, f, f_bias, mappings.h_res,
                           mappings.h_post, n=n)
        return out if n is not None else out.view(*streams.shape[:2], self.n * self.hidden_size)

    def _site_record(self, block, fn) -> tuple | None:
        """What a call at the module's site records in the open ``mhc_recompute`` block
        ``block``, in the same call into the extension: ``(the block's C++ ranges, fn,
        {"n": n})``, or None where the block's ranges are Python (the call is then recorded
        after it returns, by :func:`~mhc_megatron.recompute.record_as`)."""
        return (block.ranges, fn, self._record_kwargs) if block.native else None

    def _check_sublayer_output(self, streams: Tensor, f: Tensor) -> None:
        """A ValueError unless ``f`` is ``[s, b, C]`` for the streams ``[s, b, ...]``."""
        if f.shape[:-1] != streams.shape[:2] or f.shape[-1] != self.hidden_size:
            raise ValueError(
                f"sublayer output {tuple(f.shape)} does not match the streams "
                f"{tuple(streams.shape)} (expected [s, b, {self.hidden_size}]). Fix: the "
                "attention / MLP submodule must return hidden_size-wide outputs for the tokens "
                "of the streams (as Megatron's do)."
            )
