"""What the mHC mappings learn: per-sublayer statistics, the composite gain, gradient sizes.

For studies and monitoring (``examples/mhc_study.py``), not for the training step itself:
capturing the mappings keeps an fp32 copy of every sublayer's ``H_pre [T, n]``,
``H_post [T, n]`` and ``H_res [T, n, n]`` (``T = s*b`` tokens) of one forward pass.

    with capture_mappings(model) as captured:
        model(tokens, position_ids, attention_mask)
    rows = mapping_stats(captured)            # one dict per sublayer, in forward order
    gain = composite_gain(captured)           # the paper's stability measure

``composite_gain``: the residual stream after the last sublayer is ``P x_0 + ...`` with
``P = H_res^(K) ... H_res^(1)`` (forward order, per token). Its forward gain is the largest
absolute row sum of ``P`` (how much a stream can be amplified going up), its backward gain
the largest absolute column sum (the same for gradients going down). Doubly stochastic
``H_res`` keep both at 1; unconstrained hyper-connections can let them grow with depth.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mhc_megatron.layers.hyper_connection import HyperConnectionModule


@dataclass
class CapturedMappings:
    """One sublayer's mappings from one forward pass (fp32, detached, tokens flattened)."""

    name: str  # the HyperConnectionModule's name in the model
    h_pre: torch.Tensor  # [T, n]
    h_post: torch.Tensor  # [T, n]
    h_res: torch.Tensor  # [T, n, n]


@contextlib.contextmanager
def capture_mappings(model: torch.nn.Module):
    """Within the block, every ``HyperConnectionModule.pre`` of ``model`` records its mappings
    (a list, in forward order). The modules' ``pre`` is wrapped per instance and restored on
    exit; nothing else changes (the same ops, kernels and outputs)."""
    captured: list[CapturedMappings] = []
    wrapped = []
    for name, module in model.named_modules():
        if not isinstance(module, HyperConnectionModule):
            continue

        def pre(streams, _orig=module.pre, _name=name):
            y, m = _orig(streams)
            captured.append(CapturedMappings(_name, m.h_pre.detach().float().clone(),
                                             m.h_post.detach().float().clone(),
                                             m.h_res.detach().float().clone()))
            return y, m

        module.pre = pre
        wrapped.append(module)
    try:
        yield captured
    finally:
        for module in wrapped:
            del module.pre  # the class's method again


def mapping_stats(captured: list[CapturedMappings]) -> list[dict]:
    """Per sublayer: mean and per-token spread (std over tokens) of H_res's mean diagonal,
    H_res's largest off-diagonal weight, and mean / spread of H_pre and H_post entries."""
    rows = []
    for c in captured:
        n = c.h_res.shape[-1]
        diag = torch.diagonal(c.h_res, dim1=-2, dim2=-1).mean(-1)  # [T]
        off = c.h_res.masked_fill(torch.eye(n, dtype=torch.bool, device=c.h_res.device), 0.0)
        rows.append({
            "name": c.name,
            "h_res_diag_mean": diag.mean().item(),
            "h_res_diag_spread": diag.std(unbiased=False).item(),
            "h_res_offdiag_max": off.amax().item(),
            "h_pre_mean": c.h_pre.mean().item(),
            "h_pre_spread": c.h_pre.std(dim=0, unbiased=False).mean().item(),
            "h_post_mean": c.h_post.mean().item(),
            "h_post_spread": c.h_post.std(dim=0, unbiased=False).mean().item(),
        })
    return rows


def composite_gain(captured: list[CapturedMappings]) -> dict:
    """Forward and backward gain of ``H_res^(K) ... H_res^(1)`` over the captured sublayers:
    the largest (``*_max``) and the mean over tokens (``*_mean``) of the largest absolute row
    sum (forward) and column sum (backward)."""
    if not captured:
        raise ValueError("no mappings captured. Fix: run the model's forward inside "
                         "capture_mappings(model), on a model built with mHC specs.")
    product = None
    for c in captured:  # forward order: P <- H_res P
        product = c.h_res.double() if product is None else torch.bmm(c.h_res.double(), product)
    forward = product.abs().sum(-1).amax(-1)  # [T]: largest row sum
    backward = product.abs().sum(-2).amax(-1)  # [T]: largest column sum
    return {"forward_max": forward.max().item(), "forward_mean": forward.mean().item(),
            "backward_max": backward.max().item(), "backward_mean": backward.mean().item(),
            "sublayers": len(captured)}


def mhc_grad_norms(model: torch.nn.Module) -> list[dict]:
    """Per HyperConnectionModule, in model order: the L2 norms of the gradients of ``phi``,
    ``alpha`` and ``bias``, and of their H_res parts, ``phi_res`` and ``bias_res`` (rows
    ``2n:``: what makes H_res learn) (``None`` where a parameter has no gradient yet)."""
    def norm(grad):
        return None if grad is None else grad.float().norm().item()

    rows = []
    for name, module in model.named_modules():
        if isinstance(module, HyperConnectionModule):
            res = slice(2 * module.n, None)
            rows.append({"name": name,
                         **{p: norm(getattr(module, p).grad) for p in ("phi", "alpha", "bias")},
                         **{f"{p}_res": norm(None if getattr(module, p).grad is None
                                             else getattr(module, p).grad[res])
                            for p in ("phi", "bias")}})
    return rows
