"""mhc_megatron.diagnostics: mapping statistics, composite gain and gradient norms."""

from __future__ import annotations

import pytest
import torch
from helpers import batch, build_gpt, lm_loss, tiny_config

from mhc_megatron.diagnostics import (
    CapturedMappings,
    capture_mappings,
    composite_gain,
    mapping_stats,
    mhc_grad_norms,
)
from mhc_megatron.layers import HyperConnectionModule


def _forward(model, data):
    ids, pos, mask, _ = data
    return model(ids, pos, mask)


@pytest.mark.parametrize("static,diag,pre", [("residual", 0.95, 0.25), ("residual", 0.5, 0.25),
                                             ("zero", None, 0.5)])
def test_stats_at_initialisation(seeded, static, diag, pre):
    """At step 0 the mappings are the static ones up to O(alpha = 0.01)."""
    model = build_gpt(tiny_config(mhc_init_static_mapping=static,
                                  **({"mhc_init_res_diagonal": diag} if diag else {})))
    with capture_mappings(model) as captured:
        _forward(model, batch(seed=1))
    rows = mapping_stats(captured)
    assert [r["name"] for r in rows] == [
        f"decoder.layers.{i}.{s}_hyper_connection" for i in (0, 1) for s in ("self_attention", "mlp")]
    expect_diag = diag if static == "residual" else 0.25
    for r in rows:
        assert abs(r["h_res_diag_mean"] - expect_diag) < 0.02, r
        assert abs(r["h_pre_mean"] - pre) < 0.02 and abs(r["h_post_mean"] - 1.0) < 0.05, r
        assert 0 <= r["h_res_diag_spread"] < 0.02 and r["h_pre_spread"] < 0.02, r


def test_capture_changes_nothing_and_is_undone(seeded):
    model = build_gpt(tiny_config())
    data = batch(seed=2)
    plain = _forward(model, data)
    with capture_mappings(model) as captured:
        inside = _forward(model, data)
    assert torch.equal(plain, inside) and len(captured) == 4
    assert all("pre" not in vars(m) for m in model.modules() if isinstance(m, HyperConnectionModule))
    with capture_mappings(model) as again:
        pass
    assert again == []


def test_composite_gain_against_a_product_by_hand(seeded):
    """The model's gains equal the per-token product of its H_res, formed here token by
    token with multi_dot; (nearly) doubly stochastic H_res keep both gains at 1."""
    model = build_gpt(tiny_config(mhc_init_gating_factor=0.5))  # mappings far from static
    with capture_mappings(model) as captured:
        _forward(model, batch(seed=3))
    gain = composite_gain(captured)
    fwd, bwd = [], []
    for t in range(captured[0].h_res.shape[0]):
        p = torch.linalg.multi_dot([c.h_res[t].double() for c in reversed(captured)])
        fwd.append(p.abs().sum(1).max().item())
        bwd.append(p.abs().sum(0).max().item())
    assert gain["sublayers"] == 4
    assert gain["forward_max"] == pytest.approx(max(fwd), rel=1e-9)
    assert gain["backward_mean"] == pytest.approx(sum(bwd) / len(bwd), rel=1e-9)
    # Sinkhorn normalises columns last: column sums are 1 up to rounding, row sums converge
    # with the iterations (20 here), so the forward gain is 1 only up to that convergence.
    assert gain["backward_max"] == pytest.approx(1.0, abs=1e-5)
    assert gain["forward_max"] == pytest.approx(1.0, abs=1e-2)


def test_composite_gain_grows_for_unconstrained_mixing():
    """Not doubly stochastic: H_res = [[2, 0], [1, 1]] three times: the product is
    [[8, 0], [7, 1]]; forward gain 8 (row sums 8 and 8), backward 15 (column sums 15, 1)."""
    h = torch.tensor([[[2.0, 0.0], [1.0, 1.0]]])
    captured = [CapturedMappings(f"l{i}", torch.zeros(1, 2), torch.zeros(1, 2), h) for i in range(3)]
    gain = composite_gain(captured)
    assert (gain["forward_max"], gain["backward_max"]) == (8.0, 15.0)
    with pytest.raises(ValueError, match="Fix: "):
        composite_gain([])


def test_grad_norms(seeded):
    model = build_gpt(tiny_config())
    assert all(r["phi"] is None for r in mhc_grad_norms(model))
    lm_loss(model, batch(seed=4)).backward()
    rows = mhc_grad_norms(model)
    assert len(rows) == 4
    for r in rows:
        for p in ("phi", "alpha", "bias"):
            assert r[p] > 0 and torch.isfinite(torch.tensor(r[p])), r
