"""What Megatron-Core 0.19.2's inference engines need on this host, checked before a model is
built, so that a missing package stops a run with its name rather than an assertion deep in
the first forward."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError

import torch


def inference_engines_unavailable() -> str | None:
    """Why Megatron's inference engines (``DynamicInferenceEngine``, and
    ``StaticInferenceEngine``, which runs the dynamic one in 0.19.2) cannot run here, or None.

    Megatron's own requirements: a CUDA device; FlashAttention, for ``Attention.forward``
    asserts FA4, FA3 or flash-attn >= 2.7.3 under dynamic batching; einops, which its dynamic
    attention path calls (``rearrange`` is None there without it)."""
    if not torch.cuda.is_available():
        return "a CUDA device (Megatron-Core's inference engines are CUDA-only)"
    from megatron.core.transformer import attention
    from megatron.core.utils import is_fa_min_version

    try:
        fa2 = is_fa_min_version("2.7.3")
    except (ImportError, PackageNotFoundError):
        fa2 = False
    if not (attention.HAVE_FA4 or attention.HAVE_FA3 or fa2):
        return ("FlashAttention: flash-attn >= 2.7.3, FA3 or FA4 >= 4.0.0b20 (e.g. `pip install "
                "flash-attn-4`); Megatron's attention asserts it for dynamic batching, which "
                "both engines use, and none is installed")
    if attention.rearrange is None:
        return "einops (`pip install einops`), which Megatron's dynamic attention path calls"
    return None
