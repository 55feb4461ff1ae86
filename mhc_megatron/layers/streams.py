"""Where the residual streams begin and end: expand ``[s,b,C] -> [s,b,n*C]`` and contract.

* Expand (start of the decoder, inside global layer 1): ``x_0 = [h, h, ..., h]``. Layer 1
  hands its first sublayer the n streams as a view of ``h`` (:func:`broadcast_streams`:
  ``[s, b, n, C]`` with stream stride 0), which the mHC ops read as it is (the Triton
  kernels load each token's row once for all n streams); the first combine writes the
  first real streams ``[s, b, n*C]``. :func:`expand_streams` is the materialised copy.
* Contract (the decoder's final norm, :class:`StreamContractingNorm`):
  ``h = norm(sum_i x_L[i])``. We normalise the sum (as the hyper-connection papers do).

Precision: both directions reduce or copy over the stream axis only, and the one reduction
(the contraction) accumulates in fp32. The sum itself can leave the activation dtype's
range (fp16: n streams of 2e4 sum to 8e4 > 65504) even though the normalised result is
well inside it, so the contraction never materialises the sum: it hands the norm the
stream **mean** (``|mean| <= max_i |x_i|``, so it fits whatever dtype the streams fit) and
builds the norm with ``eps / n^2``. For LayerNorm and RMSNorm alike
``norm(sum, eps) == norm(mean, eps / n^2)`` in exact arithmetic (both are invariant to the
scale of their input up to ``eps``), so the model is the same function as "normalise the
sum", without its overflow.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from mhc_megatron.config import hyper_connections_enabled, mhc_setting


def expand_streams(hidden_states: Tensor, n: int) -> Tensor:
    """``[s, b, C]`` -> ``[s, b, n*C]``, n copies, stream-major."""
    s, b, c = hidden_states.shape
    return hidden_states.unsqueeze(2).expand(s, b, n, c).reshape(s, b, n * c)


def broadcast_streams(hidden_states: Tensor, n: int) -> Tensor:
    """``[s, b, C]`` -> the n equal streams as a view ``[s, b, n, C]`` (stream stride 0, no
    copy); the mHC modules take it in place of ``expand_streams(hidden_states, n)``. n=1:
    ``hidden_states`` itself (one stream is ``[s, b, 1*C]`` already)."""
    if n == 1:
        return hidden_states
    s, b, c = hidden_states.shape
    return hidden_states.contiguous().unsqueeze(2).expand(s, b, n, c)


def is_broadcast_streams(streams: Tensor) -> bool:
    """True for a :func:`broadcast_streams` view ``[s, b, n, C]``."""
    return streams.dim() == 4 and streams.stride(2) == 0


def contract_streams(streams: Tensor, n: int) -> Tensor:
    """``[s, b, n*C]`` -> ``[s, b, C]``: the mean of the n streams, accumulated in fp32.

    Returned in the streams' dtype; it cannot overflow it (``|mean| <= max_i |x_i|``). One
    pass each way: torch's reductions accumulate bf16/fp16 in fp32 (``at::acc_type``) and
    write the result in the input's dtype, and the backward writes ``grad / n`` to each stream
    once. (``mean(dtype=float32).to(dtype)`` would write and re-read an fp32 copy forward and
    run the backward's n-fold expansion in fp32, then cast it: ~5x the bytes.)
    ``tests/test_precision_extremes.py`` holds the fp32 accumulation to extreme streams.
    """
    s, b, nc = streams.shape
    return streams.view(s, b, n, nc // n).mean(dim=2)


class StreamContractingNorm(MegatronModule):
    """The decoder's final norm for an mHC model: normalise the sum of the streams.

    Set it as ``TransformerBlockSubmodules.layer_norm`` through :meth:`wrapping`; the
    block calls it as ``layer_norm(config=, hidden_size=, eps=)``. Input ``[s, b, n*C]``
    (stream-major), output ``[s, b, C]``: ``norm_eps(sum_i x_i)``, computed overflow-free
    as ``norm_{eps/n^2}(mean_i x_i)`` (module docstring); with ``mhc_output_head=True``
    (n > 1), DeepSeek-V4's learned weighted sum instead, ``norm_eps(sum_i w_i x_i)``
    (:class:`~mhc_megatron.layers.hyper_connection.StreamOutputHead`, parameters under
    ``head.*``). With ``enable_hyper_connections=False`` it is the plain norm. The wrapped
    norm's parameters appear as ``final_layernorm.norm.*``; ``self.eps`` is the configured
    epsilon.
    """

    def __init__(self, norm, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config=config)
        self.n = config.num_residual_streams if hyper_connections_enabled(config) else 1
        self.hidden_size = hidden_size
        self.eps = eps
        self.head = None
        if self.n > 1 and mhc_setting(config, "mhc_output_head"):
            from mhc_megatron.layers.hyper_connection import StreamOutputHead

            # a learned weighted sum, not the mean: the norm takes it with its own eps
            self.head = StreamOutputHead(config, hidden_size)
            self.norm = norm(config=config, hidden_size=hidden_size, eps=eps)
        else:
            self.norm = norm(config=config, hidden_size=hidden_size, eps=eps / self.n**2)

    @classmethod
    def wrapping(cls, norm):
        """A ``layer_norm`` builder that contracts the streams before ``norm``."""
        return functools.partial(cls, norm)

    @staticmethod
    def is_builder(layer_norm) -> bool:
        """True if ``layer_norm`` (a block's ``layer_norm`` builder) builds this class."""
        target = layer_norm.func if isinstance(layer_norm, functools.partial) else layer_norm
        return isinstance(target, type) and issubclass(target, StreamContractingNorm)

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.n > 1:
            if hidden_states.shape[-1] != self.n * self.hidden_size:
                raise ValueError(
                    f"final norm expects the residual streams [s, b, {self.n}*{self.hidden_size}]"
                    f", got {tuple(hidden_states.shape)}. Fix: use HyperConnectionTransformerLayer"
                    " specs (mhc_megatron.specs) for every decoder layer."
                )
            hidden_states = (contract_streams(hidden_states, self.n) if self.head is None
                             else self.head(hidden_states))
        return self.norm(hidden_states)
