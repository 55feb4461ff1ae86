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
from mhc_testing.cpu import setup_cpu_megatron

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _forward(model, data):
    ids, pos, mask, _ = data
    return model(ids, pos, mask)


@pytest.mark.parametrize("static,diag,pre", [("residual", 0.95, 0.25), ("residual", 0.5, 0.25),
                                             ("zero", None, 0.5)])
def test_stats_at_initialisation(seeded, static, diag, pre):
    """At step 0 the mappings are the static ones up to O(alpha = 0.01)."""
    model = build_gpt(tiny_config(mhc_init_static_mapping=static, mhc_init_gating_factor=0.01,
                                  **({"mhc_init_res_diagonal": diag} if diag else {})), DEV)
    with capture_mappings(model) as captured:
        _forward(model, batch(device=DEV, seed=1))
    rows = mapping_stats(captured)
    assert [r["name"] for r in rows] == [
        f"decoder.layers.{i}.{s}_hyper_connection" for i in (0, 1) for s in ("self_attention", "mlp")]
    expect_diag = diag if static == "residual" else 0.25
    for r in rows:
        assert abs(r["h_res_diag_mean"] - expect_diag) < 0.02, r
        assert abs(r["h_pre_mean"] - pre) < 0.02 and abs(r["h_post_mean"] - 1.0) < 0.05, r
        assert 0 <= r["h_res_diag_spread"] < 0.02 and r["h_pre_spread"] < 0.02, r


def test_capture_changes_nothing_and_is_undone(seeded):
    model = build_gpt(tiny_config(), DEV)
    data = batch(device=DEV, seed=2)
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
    model = build_gpt(tiny_config(mhc_init_gating_factor=0.5), DEV)  # mappings far from static
    with capture_mappings(model) as captured:
        _forward(model, batch(device=DEV, seed=3))
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
    model = build_gpt(tiny_config(), DEV)
    assert all(r["phi"] is None for r in mhc_grad_norms(model))
    lm_loss(model, batch(device=DEV, seed=4)).backward()
    rows = mhc_grad_norms(model)
    assert len(rows) == 4
    for r in rows:
        for p in ("phi", "alpha", "bias"):
            assert r[p] > 0 and torch.isfinite(torch.tensor(r[p])), r


def _h_res_over_h_post_bias_grads(**config) -> list[float]:
    """Per sublayer (forward order), after one backward from the initialisation: the norm of
    the H_res logits' bias gradient over the H_post bias gradient's."""
    model = build_gpt(tiny_config(num_layers=4, **config), DEV)
    lm_loss(model, batch(device=DEV, seed=4)).backward()
    ratios = []
    for module in model.modules():
        if isinstance(module, HyperConnectionModule):
            n, g = module.n, module.bias.grad
            assert torch.isfinite(g).all() and g[:n].norm() > 0 and g[n:2 * n].norm() > 0
            ratios.append((g[2 * n:].norm() / g[n:2 * n].norm()).item())
    return ratios


def test_default_init_gives_h_res_gradients_that_grow_with_the_gating_factor(seeded):
    """Why the defaults are zero static mapping + gating 0.1 (docs/results/study/REPORT.md):
    H_res mixes n streams that start as equal copies, and any doubly stochastic H_res maps
    equal streams to themselves, so its logits get gradients only as far as the streams
    differ, and they differ through the per-token (dynamic) part of H_post, whose size is the
    gating factor. At step 0 with the defaults: H_pre and H_post get gradients in every
    sublayer; H_res gets ~none in the first sublayer (its input is n equal copies) and the
    last (the final norm sums the streams, which every doubly stochastic H_res preserves, so
    that one never learns), and in between at least 10x (25-80x in this model) more, relative
    to H_post's, than with the paper's gating 0.01."""
    setup_cpu_megatron(seed=1234)
    default = _h_res_over_h_post_bias_grads()
    setup_cpu_megatron(seed=1234)  # the same weights
    paper = _h_res_over_h_post_bias_grads(mhc_init_gating_factor=0.01)
    assert len(default) == 8
    assert default[0] < 1e-5 and default[-1] < 1e-6, default
    for d, p in zip(default[1:-1], paper[1:-1]):
        assert d > 10 * p and d > 1e-6, (default, paper)
