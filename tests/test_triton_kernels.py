"""Fused Triton kernels against the PyTorch reference, forward and every gradient.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py sets it before triton is
imported) on small odd shapes; on a CUDA machine the same tests run compiled, plus real sizes.
"""

from __future__ import annotations

import pytest
import torch

from mhc_megatron.kernels import reference as ref
from mhc_megatron.kernels import triton_mhc
from mhc_megatron.kernels.handoff import DxLink

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# fp32 activations: TF32 projection on GPU (~1e-3); bf16/fp16: rounding of x, y and x'.
TOL = {torch.float32: 2e-3 if CUDA else 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 4e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _params(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    phi = (torch.randn(m, n * c, generator=g) * 0.5 / (n * c) ** 0.5).to(DEV)
    alpha = (torch.rand(3, generator=g) + 0.5).to(DEV)
    bias = torch.randn(m, generator=g).to(DEV)
    return phi, alpha, bias


def _pre_case(t, n, c, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    phi, alpha, bias = _params(n, c, seed + 1)
    grads = [torch.randn(t, c, generator=g).to(DEV, dtype), torch.randn(t, n, generator=g).to(DEV),
             torch.randn(t, n, generator=g).to(DEV), torch.randn(t, n, n, generator=g).to(DEV)]
    return x, phi, alpha, bias, grads


def _run_pre(fn, x, phi, alpha, bias, grads, iters=20, eps=1e-6):
    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, alpha, bias)]
    outs = fn(*leaves, iters, eps)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [l.grad for l in leaves]


CPU_SHAPES = [(5, 1, 7), (19, 2, 33), (17, 4, 24), (3, 8, 5), (21, 4, 130)]
GPU_SHAPES = CPU_SHAPES + [(4097, 4, 1000), (8191, 8, 257), (1000, 4, 4096)]


@pytest.mark.parametrize("t,n,c", GPU_SHAPES if CUDA else CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pre_matches_reference(t, n, c, dtype):
    if not CUDA and dtype == torch.float16 and n != 4:
        pytest.skip("fp16 on the CPU interpreter: one shape is enough")
    x, phi, alpha, bias, grads = _pre_case(t, n, c, dtype, seed=t + 10 * n + c)
    (y, hp, hq, hr), (dx, dphi, dalpha, dbias) = _run_pre(triton_mhc.pre, x, phi, alpha, bias, grads)
    (y0, hp0, hq0, hr0), (dx0, dphi0, dalpha0, dbias0) = _run_pre(ref.pre, x, phi, alpha, bias, grads)
    tol = TOL[dtype]
    assert y.dtype == dtype and hr.dtype == torch.float32
    for name, a, b in [("y", y, y0), ("h_pre", hp, hp0), ("h_post", hq, hq0), ("h_res", hr, hr0),
                       ("dx", dx, dx0), ("dphi", dphi, dphi0), ("dalpha", dalpha, dalpha0),
                       ("dbias", dbias, dbias0)]:
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e} >= {tol}"


@pytest.mark.parametrize("t,n,c", GPU_SHAPES if CUDA else CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aggregate_replays_pre_bitwise(t, n, c, dtype):
    """``aggregate(x, h_pre)`` (what mhc_recompute replays) gives pre's ``y`` bit for bit,
    and the reference aggregate to rounding; it refuses to run where autograd would need it."""
    x, phi, alpha, bias, _ = _pre_case(t, n, c, dtype, seed=t + n + c)
    with torch.no_grad():
        y, h_pre, _, _ = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6)
        again = triton_mhc.aggregate(x, h_pre)
    assert again.dtype == dtype and torch.equal(again, y)
    assert rel_err(again, ref.aggregate(x, h_pre)) < TOL[dtype]
    with pytest.raises(RuntimeError, match="no backward"):
        triton_mhc.aggregate(x.detach().requires_grad_(), h_pre)


@pytest.mark.parametrize("t,n,c", [(5, 1, 7), (19, 2, 33), (17, 4, 130), (3, 8, 5)]
                         + ([(300, 4, 1000)] if CUDA else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["paper", "deepseek_v4"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_aggregate_in_the_mapping_kernel_changes_no_bit(monkeypatch, t, n, c, dtype, form,
                                                        broadcast):
    """Small inputs: pre's mapping kernel forms ``y`` too (``TILES.maps_agg``), one launch
    fewer. Every output equals the separate aggregate kernel's path bit for bit, in both
    mapping forms, also for broadcast streams (global layer 1's view of the embeddings)."""
    from mhc_megatron.kernels import triton_common
    from mhc_megatron.kernels.reference import MappingForm
    from mhc_megatron.kernels.triton_common import TILES

    x, phi, alpha, bias, _ = _pre_case(t, n, c, dtype, seed=3 * t + n + c)
    if broadcast and n == 1:
        pytest.skip("one stream: nothing to broadcast")
    if broadcast:  # one row a token read n times (stream stride 0), as broadcast_streams
        x = x[:, 0].contiguous().view(t, 1, c).expand(t, n, c)
        assert triton_common.streams_operand(x)[1]
    runs = []
    step = TILES.maps_agg[2]
    for bound in (1 << 62, 0):  # in the mapping kernel; in the aggregate's own kernel
        monkeypatch.setattr(TILES, "maps_agg", (bound, bound, step))
        with torch.no_grad():
            runs.append(triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6,
                                       form=MappingForm(form, 1e-6, form == "deepseek_v4")))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("t,n,c", GPU_SHAPES if CUDA else CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_combine_matches_reference(t, n, c, dtype, with_bias):
    g = torch.Generator().manual_seed(t * n + c)
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    f = torch.randn(t, c, generator=g).to(DEV, dtype)
    fb = torch.randn(c, generator=g).to(DEV, dtype) if with_bias else None
    h_res = ref.sinkhorn(torch.randn(t, n, n, generator=g), 20).to(DEV)
    h_post = (2 * torch.rand(t, n, generator=g)).to(DEV)
    up = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    results = []
    for fn in (triton_mhc.combine, ref.expand_combine):
        leaves = [None if v is None else v.detach().clone().requires_grad_()
                  for v in (x, f, fb, h_res, h_post)]
        out = fn(*leaves)
        out.backward(up)
        results.append([out.detach()] + [None if v is None else v.grad for v in leaves])
    for name, a, b in zip(("out", "dx", "df", "dbias", "dh_res", "dh_post"), *results):
        if b is None:
            assert a is None
            continue
        assert rel_err(a, b) < TOL[dtype], f"{name}: rel err {rel_err(a, b):.2e}"


@pytest.mark.parametrize("t,n,c", GPU_SHAPES if CUDA else CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_layout", ["tokens", "streams", "broadcast"])
def test_combine_aggregate_equals_combine_then_aggregate(t, n, c, dtype, x_layout):
    """``combine_aggregate`` (mhc_recompute's replay of a combine and of the next pre's
    aggregate of its output, one kernel) returns bit for bit what ``combine`` and then
    ``aggregate`` return: compiled too, where the two kernels' tiles and layouts differ (both
    add the streams in order through one helper). The aggregate is held to the reference; the
    op refuses to run where autograd would need it."""
    if not CUDA and dtype == torch.float16 and n != 4:
        pytest.skip("fp16 on the CPU interpreter: one shape is enough")
    g = torch.Generator().manual_seed(7 * t + n + c)
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    if x_layout == "broadcast":  # global layer 1's first combine
        x = x[:, :1].expand(t, n, c)
    f = torch.randn(t, c, generator=g).to(DEV, dtype)
    fb = torch.randn(c, generator=g).to(DEV, dtype) if t % 2 else None
    h_res = ref.sinkhorn(torch.randn(t, n, n, generator=g), 20).to(DEV)
    h_post = (2 * torch.rand(t, n, generator=g)).to(DEV)
    h_next = torch.rand(t, n, generator=g).to(DEV)
    kw = {}
    if x_layout == "streams":  # [s, b, n*C] as the layers carry them
        x, f, kw = x.reshape(t, 1, n * c), f.view(t, 1, c), {"n": n}
    with torch.no_grad():
        out = triton_mhc.combine(x, f, fb, h_res, h_post, **kw)
        y = triton_mhc.aggregate(out, h_next, **kw)
        out_fused, y_fused = triton_mhc.combine_aggregate(x, f, fb, h_res, h_post, h_next, **kw)
    assert out_fused.shape == out.shape and y_fused.shape == y.shape and y_fused.dtype == dtype
    assert torch.equal(out_fused, out)
    differ = y_fused != y
    assert not differ.any(), (f"{int(differ.sum())} of {y.numel()} differ, max "
                              f"{(y_fused.float() - y.float()).abs().max().item():.3e}")
    out3 = out.reshape(t, n, c)
    assert rel_err(y.reshape(t, c), ref.aggregate(out3, h_next)) < TOL[dtype]
    with pytest.raises(RuntimeError, match="no backward"):
        triton_mhc.combine_aggregate(x, f.detach().requires_grad_(), fb, h_res, h_post, h_next,
                                     **kw)


@pytest.mark.parametrize("t,n,c", [(37, 4, 48)] + ([(16384, 4, 2048)] if CUDA else []))
def test_deterministic_bitwise(t, n, c):
    """Run to run bitwise equality; on the GPU also at a real size (hundreds of programs
    writing the split partials that are summed in a fixed order)."""
    x, phi, alpha, bias, grads = _pre_case(t, n, c, torch.bfloat16, seed=3)
    first = _run_pre(triton_mhc.pre, x, phi, alpha, bias, grads)
    for _ in range(3):
        again = _run_pre(triton_mhc.pre, x, phi, alpha, bias, grads)
        for a, b in zip(first[0] + first[1], again[0] + again[1]):
            assert torch.equal(a, b)


def test_non_contiguous_input_and_partial_grads():
    x, phi, alpha, bias, grads = _pre_case(18, 4, 16, torch.float32, seed=5)
    x_nc = x.transpose(0, 2).contiguous().transpose(0, 2)  # same values, other strides
    assert not x_nc.is_contiguous()
    y, hp, hq, hr = triton_mhc.pre(x_nc, phi, alpha, bias, 20, 1e-6)
    y0, _, _, _ = ref.pre(x, phi, alpha, bias, 20, 1e-6)
    assert rel_err(y, y0) < TOL[torch.float32]
    # Only y used downstream: the mapping outputs get no gradient (None) and that is fine.
    xl = x.clone().requires_grad_()
    triton_mhc.pre(xl, phi, alpha, bias, 20, 1e-6)[0].sum().backward()
    xr = x.clone().requires_grad_()
    ref.pre(xr, phi, alpha, bias, 20, 1e-6)[0].sum().backward()
    assert rel_err(xl.grad, xr.grad) < TOL[torch.float32]


def test_combine_low_precision_mappings_get_grads_in_their_dtype():
    x = torch.randn(20, 4, 16, device=DEV)
    f = torch.randn(20, 16, device=DEV)
    h_res = ref.sinkhorn(torch.randn(20, 4, 4), 20).to(DEV, torch.bfloat16).requires_grad_()
    h_post = torch.rand(20, 4, device=DEV, dtype=torch.bfloat16).requires_grad_()
    triton_mhc.combine(x, f, None, h_res, h_post).sum().backward()
    assert h_res.grad.dtype == torch.bfloat16 and h_post.grad.dtype == torch.bfloat16
    ref_res = h_res.detach().clone().requires_grad_()
    ref.expand_combine(x, f, None, ref_res, h_post.detach()).sum().backward()
    assert rel_err(h_res.grad, ref_res.grad) < TOL[torch.bfloat16]


def test_empty_token_count():
    x, phi, alpha, bias, _ = _pre_case(0, 4, 8, torch.float32, seed=1)
    y, hp, hq, hr = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6)
    assert y.shape == (0, 8) and hr.shape == (0, 4, 4)


def test_unsupported_streams_are_refused():
    x = torch.zeros(4, 3, 8, device=DEV)
    with pytest.raises(ValueError, match=r"support n in \(1, 2, 4, 8\), got n=3"):
        triton_mhc.pre(x, *_params(3, 8, 0), 20, 1e-6)


def test_gpt_model_triton_backend_matches_reference(seeded, monkeypatch):
    """End to end through the layer: same weights, Triton vs reference backend; the layer's
    combine hands its dx to pre's kernel in every sublayer."""
    from helpers import batch, build_gpt, lm_loss, tiny_config

    claims = []
    claim = DxLink.claim
    monkeypatch.setattr(DxLink, "claim",
                        lambda self, x: claims.append(claim(self, x)) or claims[-1])
    runs = []
    for backend in ("triton", "reference"):
        cfg = tiny_config(mhc_kernel_backend=backend, add_bias_linear=True)
        from mhc_testing.cpu import setup_cpu_megatron

        setup_cpu_megatron(seed=21)
        model = build_gpt(cfg, DEV)
        loss = lm_loss(model, batch(device=DEV, seed=2))
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_t, grads_t), (loss_r, grads_r) = runs
    assert claims and all(claims), claims
    assert rel_err(loss_t, loss_r) < 1e-5
    for name, g in grads_r.items():
        assert rel_err(grads_t[name], g) < 2e-3, name


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_layer1_reads_the_embeddings_as_broadcast_streams(seeded, monkeypatch, backend):
    """Global layer 1 hands its first sublayer the embeddings as n broadcast streams (a view;
    ``expand_streams`` never runs), and the model's loss and every gradient equal those of
    the materialised expansion bit for bit (the fused ops read the same values in the same
    order; the reference copies the view; autograd sums the n stream gradients alike)."""
    from helpers import batch, build_gpt, lm_loss, tiny_config

    from mhc_megatron.layers import transformer_layer
    from mhc_testing.cpu import setup_cpu_megatron

    expand = transformer_layer.expand_streams
    expansions = []
    monkeypatch.setattr(transformer_layer, "expand_streams",
                        lambda h, n: expansions.append(n) or expand(h, n))
    runs = []
    for materialised in (False, True):
        if materialised:
            monkeypatch.setattr(transformer_layer, "broadcast_streams",
                                transformer_layer.expand_streams)
        cfg = tiny_config(mhc_kernel_backend=backend, num_residual_streams=4)
        setup_cpu_megatron(seed=21)
        model = build_gpt(cfg, DEV)
        loss = lm_loss(model, batch(device=DEV, seed=2))
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert len(expansions) == (1 if materialised else 0), expansions
    (loss_b, grads_b), (loss_m, grads_m) = runs
    assert torch.equal(loss_b, loss_m)
    for name, g in grads_m.items():
        assert torch.equal(grads_b[name], g), name


def _sublayer(ops_pre, ops_combine, base, n, phi, alpha, bias, w, fb, up, as_views):
    """One mHC sublayer as the layer runs it: pre -> f = y * w -> combine, on ``base``.

    ``as_views``: pre and combine each get their own reshape of ``base [s, b, n*C]`` (what
    HyperConnectionModule does), else both get the same tensor."""
    c = w.shape[0]
    leaves = [t.detach().clone().requires_grad_() for t in (base, phi, alpha, bias, w, fb)]
    b, phi_l, alpha_l, bias_l, w_l, fb_l = leaves
    x_pre = b.reshape(-1, n, c) if as_views else b
    y, h_pre, h_post, h_res = ops_pre(x_pre, phi_l, alpha_l, bias_l, 20, 1e-6)
    x_comb = b.reshape(-1, n, c) if as_views else x_pre
    out = ops_combine(x_comb, y * w_l, fb_l, h_res, h_post)
    out.backward(up)
    return out.detach(), [t.grad for t in leaves], h_res


@pytest.mark.parametrize("as_views", [False, True])
def test_sublayer_dx_of_pre_and_combine_summed_in_pre_kernel(as_views):
    """x feeds pre and combine; Triton sums the two dx in pre's kernel (no autograd add)."""
    t, n, c = 23, 4, 40
    x, phi, alpha, bias, _ = _pre_case(t, n, c, torch.float32, seed=11)
    base = x.view(t, 1, n * c) if as_views else x
    g = torch.Generator().manual_seed(12)
    w = torch.randn(c, generator=g).to(DEV)
    fb = torch.randn(c, generator=g).to(DEV)
    up = torch.randn(t, n, c, generator=g).to(DEV)
    out, grads, h_res = _sublayer(triton_mhc.pre, triton_mhc.combine, base, n, phi, alpha, bias,
                                  w, fb, up, as_views)
    assert h_res._mhc_dx_link.claimed, "combine did not hand its dx to pre"
    out0, grads0, _ = _sublayer(ref.pre, ref.expand_combine, base, n, phi, alpha, bias, w, fb,
                                up, as_views)
    assert rel_err(out.view_as(out0), out0) < TOL[torch.float32]
    for name, a, b in zip(("x", "phi", "alpha", "bias", "w", "f_bias"), grads, grads0):
        assert rel_err(a, b) < TOL[torch.float32], f"d{name}: rel err {rel_err(a, b):.2e}"


def test_combine_on_other_tensor_keeps_its_own_dx():
    """A combine whose x is not pre's x (detached, or another tensor) must not hand over dx."""
    x, phi, alpha, bias, _ = _pre_case(9, 4, 16, torch.float32, seed=4)
    xl = x.clone().requires_grad_()
    other = (x + 1).requires_grad_()
    y, _, h_post, h_res = triton_mhc.pre(xl, phi, alpha, bias, 20, 1e-6)
    out = triton_mhc.combine(other, y, None, h_res, h_post)
    assert not h_res._mhc_dx_link.claimed
    out.sum().backward()
    xr = x.clone().requires_grad_()
    other_r = (x + 1).requires_grad_()
    y0, _, h_post0, h_res0 = ref.pre(xr, phi, alpha, bias, 20, 1e-6)
    ref.expand_combine(other_r, y0, None, h_res0, h_post0).sum().backward()
    assert rel_err(other.grad, other_r.grad) < TOL[torch.float32]
    assert rel_err(xl.grad, xr.grad) < TOL[torch.float32]


def test_dx_link_survives_pre_view_being_freed():
    """Under the cross-layer recompute nothing keeps pre's input view alive until combine
    runs; the link must still be taken for an equal view of the same base, and the
    gradient must equal the reference's."""
    import gc

    t, n, c = 11, 4, 16
    x, phi, alpha, bias, _ = _pre_case(t, n, c, torch.float32, seed=21)
    g = torch.Generator().manual_seed(22)
    up = torch.randn(t, n, c, generator=g).to(DEV)
    grads = []
    for ops_pre, ops_combine in ((triton_mhc.pre, triton_mhc.combine),
                                 (ref.pre, ref.expand_combine)):
        base = x.view(t, 1, n * c).clone().requires_grad_()
        streams = base * 1.0  # a non-leaf, as the layer's streams are
        # what the recompute does: autograd keeps no reference to pre's saved tensors
        with torch.autograd.graph.saved_tensors_hooks(lambda v: v.detach().clone(),
                                                      lambda v: v):
            y, _, h_post, h_res = ops_pre(streams.view(t, n, c), phi, alpha, bias, 20, 1e-6)
        gc.collect()  # pre's view object is gone now
        out = ops_combine(streams.view(t, n, c), y, None, h_res, h_post)
        if ops_pre is triton_mhc.pre:
            assert h_res._mhc_dx_link.claimed
        out.backward(up)
        grads.append(base.grad)
    assert rel_err(grads[0], grads[1]) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_streams_layout_equals_token_layout(backend):
    """The ops on the streams as layers carry them (``[s, b, n*C]``, ``n`` given) equal the
    ops on ``[T, n, C]`` bit for bit, and for Triton the autograd graph has no view nodes:
    ``y`` and ``x'`` come straight from the ops' backward nodes."""
    from mhc_megatron.kernels.dispatch import REFERENCE_OPS, _load_triton_ops

    ops = _load_triton_ops() if backend == "triton" else REFERENCE_OPS
    s, b, n, c = 7, 3, 4, 24
    x, phi, alpha, bias, _ = _pre_case(s * b, n, c, torch.float32, seed=21)
    g = torch.Generator().manual_seed(22)
    w = torch.randn(c, generator=g).to(DEV)
    up = torch.randn(s, b, n * c, generator=g).to(DEV)
    results = []
    for streams_layout in (False, True):
        xl = (x.reshape(s, b, n * c) if streams_layout else x).detach().clone().requires_grad_()
        params = [t.detach().clone().requires_grad_() for t in (phi, alpha, bias)]
        kw = {"n": n} if streams_layout else {}
        y, h_pre, h_post, h_res = ops.pre(xl, *params, 20, 1e-6, **kw)
        out = ops.combine(xl, y * w, None, h_res, h_post, **kw)
        with torch.no_grad():
            y_again = ops.aggregate(xl.detach(), h_pre.detach(), **kw)
        if streams_layout:
            assert y.shape == (s, b, c) and out.shape == (s, b, n * c) == y_again.shape[:2] + (
                n * c,)
            if backend == "triton":  # (the Python functions, or their C++ nodes)
                assert y.grad_fn.name() in ("_PreFnBackward", "MHCPreBackward")
                assert out.grad_fn.name() in ("_CombineFnBackward", "MHCCombineBackward")
        out.backward(up if streams_layout else up.view(s * b, n, c))
        results.append([t.reshape(-1) for t in (y, y_again, out, xl.grad,
                                                *[p.grad for p in params])])
    for name, a, bb in zip(("y", "aggregate", "out", "dx", "dphi", "dalpha", "dbias"), *results):
        if backend == "triton":
            assert torch.equal(a, bb), name
        else:  # autograd adds pre's and combine's dx in another order through the reshapes
            assert rel_err(a, bb) < 1e-6, name


BROADCAST_CASES = [(17, 4, 24, torch.float32), (21, 2, 130, torch.bfloat16),
                   (9, 8, 40, torch.float32), (13, 4, 33, torch.float16)]
GPU_BROADCAST_CASES = [(4097, 4, 1024, torch.bfloat16), (1000, 4, 4096, torch.bfloat16),
                       (2049, 8, 256, torch.float32), (4097, 4, 1000, torch.bfloat16),
                       (2049, 8, 257, torch.float32)]


@pytest.mark.parametrize("t,n,c,dtype", BROADCAST_CASES + (GPU_BROADCAST_CASES if CUDA else []))
def test_broadcast_streams_equal_their_copy(t, n, c, dtype, monkeypatch):
    """Global layer 1's n equal streams as a view of one row a token (``[T, n, C]`` with
    stream stride 0) give what their materialised copy gives: ``y``, the mappings, ``x'``,
    the replayed aggregate and every gradient (the input's is autograd's sum of the n stream
    gradients either way), bit for bit when ``C`` is a multiple of 16 (hidden sizes are) or
    on the interpreter. (Compiled, the projection's loads of the view are addressed
    ``t*C + k % C``; Triton proves their contiguity, and so picks the same register layout
    and reduction order as for the copy, only when it knows ``C % 16 == 0``.) The copy is
    itself held to the PyTorch reference. The ops read the view as it is: what pre
    and combine save for backward is ``h``'s own storage, and combine hands its dx to pre
    (read in the Python autograd functions' saved tensors: the ops' C++ nodes, which save the
    same tensors, are held to those functions in tests/test_native_autograd.py)."""
    from mhc_megatron.kernels import native_autograd

    monkeypatch.setattr(native_autograd, "_ENABLED", False)
    g = torch.Generator().manual_seed(t + n)
    h = torch.randn(t, c, generator=g).to(DEV, dtype)
    phi, alpha, bias = _params(n, c, seed=t)
    w = torch.randn(c, generator=g).to(DEV, dtype)
    up = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    runs = {}
    for mode, ops_pre, ops_combine, ops_agg in (
            ("broadcast", triton_mhc.pre, triton_mhc.combine, triton_mhc.aggregate),
            ("copy", triton_mhc.pre, triton_mhc.combine, triton_mhc.aggregate),
            ("reference", ref.pre, ref.expand_combine, ref.aggregate)):
        hl = h.detach().clone().requires_grad_()
        params = [p.detach().clone().requires_grad_() for p in (phi, alpha, bias, w)]
        x = hl.view(t, 1, c).expand(t, n, c)
        if mode != "broadcast":
            x = x.contiguous()
        y, h_pre, h_post, h_res = ops_pre(x, *params[:3], 20, 1e-6)
        out = ops_combine(x, y * params[3], None, h_res, h_post)
        if mode == "broadcast":
            for node in (y.grad_fn, out.grad_fn):
                saved_x = node.saved_tensors[0]
                assert saved_x.untyped_storage().data_ptr() == hl.untyped_storage().data_ptr()
                assert saved_x.stride(1) == 0, "the op materialised the streams"
            assert h_res._mhc_dx_link.claimed, "combine did not hand its dx to pre"
        with torch.no_grad():
            y_again = ops_agg(x.detach(), h_pre.detach())
        out.backward(up)
        runs[mode] = [y, h_pre, h_post, h_res, out, y_again, hl.grad, *[p.grad for p in params]]
    names = ("y", "h_pre", "h_post", "h_res", "out", "aggregate", "dh", "dphi", "dalpha", "dbias",
             "dw")
    bitwise = not CUDA or c % 16 == 0
    for name, a, b, r in zip(names, runs["broadcast"], runs["copy"], runs["reference"]):
        if bitwise:
            assert torch.equal(a, b), name
        else:
            assert rel_err(a, b) < (1e-5 if dtype == torch.float32 else TOL[dtype] / 4), name
        assert rel_err(b, r) < TOL[dtype], f"{name}: rel err {rel_err(b, r):.2e} to the reference"


# (t, n, c, streams a program): every n with each of its stream counts once
DX_STREAMS_CASES = [(19, 2, 33, 2), (17, 4, 24, 2), (21, 4, 130, 4), (3, 8, 5, 8), (9, 8, 40, 4)]
GPU_DX_STREAMS_CASES = [(4097, 4, 1000, 2), (4097, 4, 1000, 4), (1000, 4, 4096, 4),
                        (2049, 8, 256, 8)]


@pytest.mark.parametrize("t,n,c,streams",
                         DX_STREAMS_CASES + (GPU_DX_STREAMS_CASES if CUDA else []))
@pytest.mark.parametrize("layout", ["streams", "broadcast"])
def test_dx_pass_over_several_streams_a_program(monkeypatch, t, n, c, streams, layout):
    """``TILES.dx_streams``: programs of pre's dx pass that cover 2, 4 or 8 streams (at most
    n; the tile's channels split among them) give the same ``dx`` bits as one stream a
    program (a token's dx is formed in one program either way), with the combine's ``g``
    handed over (a sublayer: pre, then the combine on pre's x) and without (pre alone), on
    the streams and on global layer 1's broadcast view; ``dphi`` and the other gradients (their
    split sums can fall in other places) equal one stream a program's to fp32 rounding and
    the reference to the usual tolerance."""
    from mhc_megatron.kernels import native_autograd
    from mhc_megatron.kernels.triton_common import TILES

    monkeypatch.setattr(native_autograd, "_ENABLED", False)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(t + n + c)
    h = torch.randn(t, c, generator=g).to(DEV, dtype)
    xs = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    phi, alpha, bias = _params(n, c, seed=t)
    w = torch.randn(c, generator=g).to(DEV, dtype)
    up = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    dy = torch.randn(t, c, generator=g).to(DEV, dtype)

    def run(ops_pre, ops_combine, sublayer):
        leaves = [v.detach().clone().requires_grad_() for v in (h, xs, phi, alpha, bias, w)]
        hl, xl, *params = leaves
        x = hl.view(t, 1, c).expand(t, n, c) if layout == "broadcast" else xl
        y, h_pre, h_post, h_res = ops_pre(x, *params[:3], 20, 1e-6)
        if sublayer:
            ops_combine(x, y * params[3], None, h_res, h_post).backward(up)
        else:
            y.backward(dy)
        source = hl if layout == "broadcast" else xl
        return [source.grad] + [p.grad for p in params[:3]]

    for sublayer in (True, False):
        monkeypatch.setattr(TILES, "dx_streams", 1)
        one = run(triton_mhc.pre, triton_mhc.combine, sublayer)
        monkeypatch.setattr(TILES, "dx_streams", streams)
        several = run(triton_mhc.pre, triton_mhc.combine, sublayer)
        reference = run(ref.pre, ref.expand_combine, sublayer)
        assert torch.equal(several[0], one[0]), ("dx", sublayer)
        for name, a, b, r in zip(("dx", "dphi", "dalpha", "dbias"), several, one, reference):
            assert rel_err(a, b) < 1e-5, (name, sublayer, rel_err(a, b))
            assert rel_err(a, r) < TOL[dtype], (name, sublayer, rel_err(a, r))


def test_dx_pass_drops_loop_stages_that_do_not_fit_in_shared_memory(monkeypatch):
    """With the combine's ``g`` each loop stage of pre's dx pass buffers n stream tiles of it;
    where the GPU's shared memory cannot hold the plan's stages (n=8 in fp32 on an H100),
    the launch retries with one stage fewer and keeps that in the plan, down to 1, then
    raises."""
    from triton.runtime.errors import OutOfResources

    from mhc_megatron.kernels import triton_pre_bwd
    from mhc_megatron.kernels.triton_common import plan

    p = plan(triton_pre_bwd._PreBackwardPlan, 64, 8, 32, torch.float32, None, True, True, False)
    old_meta = p.dx_meta
    tried = []

    def launch(grid, meta, *args):
        tried.append(meta.kwargs["LOOP_STAGES"])
        if meta.kwargs["LOOP_STAGES"] > fits:
            raise OutOfResources(300000, 232448, "shared memory")

    class _Launcher:  # stands in for the kernel's Launcher
        def signed(self, plan, sig, grid, meta, *args):
            launch(grid, meta, *args)

    monkeypatch.setattr(triton_pre_bwd, "_DX_DPHI", _Launcher())
    try:
        fits = 1
        triton_pre_bwd._launch_dx_dphi(p, None, "args")
        assert tried == [3, 2, 1] and p.dx_meta.kwargs["LOOP_STAGES"] == 1
        assert p.dx_meta.kwargs["num_stages"] == 1
        triton_pre_bwd._launch_dx_dphi(p, None, "args")  # the plan keeps what fit
        assert tried == [3, 2, 1, 1]
        fits = 0
        with pytest.raises(OutOfResources):
            triton_pre_bwd._launch_dx_dphi(p, None, "args")
    finally:
        p.dx_meta = old_meta


def test_param_grads_drop_loop_stages_that_do_not_fit_in_shared_memory(monkeypatch):
    """The parameter-gradient sums pipeline their loads 8 stages deep; where shared memory
    cannot hold them, the launch retries with one stage fewer and keeps that in the plan,
    for its plain launch and for the gradient-accumulation fusion's alike."""
    from triton.runtime.errors import OutOfResources

    from mhc_megatron.kernels import triton_pre_bwd
    from mhc_megatron.kernels.triton_common import plan

    p = plan(triton_pre_bwd._PreBackwardPlan, 64, 8, 32, torch.float32, None, True, True, False)
    old_meta = p.grads_meta
    tried = []

    class _Launcher:  # stands in for the kernel's Launcher
        def signed(self, plan, sig, grid, meta, *args):
            tried.append((meta.kwargs["LOOP_STAGES"], meta.kwargs["ACCUMULATE"]))
            if meta.kwargs["LOOP_STAGES"] > fits:
                raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(triton_pre_bwd, "_PARAM_GRADS", _Launcher())
    try:
        fits = 6
        triton_pre_bwd._launch_param_grads(p, None, None, "args")
        assert tried == [(8, False), (7, False), (6, False)], tried
        triton_pre_bwd._launch_param_grads(p, None, torch.bfloat16, "args")
        assert tried[3:] == [(6, True)], tried  # the fusion's meta follows the plan's stages
        assert p.accumulate_meta(torch.bfloat16).kwargs["GRAD_ROUND"] == 1
        fits = 0
        with pytest.raises(OutOfResources):
            triton_pre_bwd._launch_param_grads(p, None, None, "args")
    finally:
        p.grads_meta = old_meta
        p._accumulate_metas.clear()


def test_ops_without_autograd_skip_the_autograd_functions(monkeypatch):
    """Under no_grad (inference, evaluation), or where no input requires grad, pre and combine
    run their kernels without an autograd function around them, with the same bits as
    through it."""
    from mhc_megatron.kernels import triton_combine, triton_pre

    n, c, t = 4, 24, 5
    phi, alpha, bias = _params(n, c, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, n * c, generator=g).to(DEV, torch.bfloat16)
    f = torch.randn(t, c, generator=g).to(DEV, torch.bfloat16)

    def run(phi):
        y, h_pre, h_post, h_res = triton_pre.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
        return y, h_pre, h_post, h_res, triton_combine.combine(x, f, None, h_res, h_post, n=n)

    # through the autograd functions: an input requires grad
    want = [o.detach() for o in run(phi.clone().requires_grad_())]
    applied = []
    for fn in (triton_pre._PreFn, triton_combine._CombineFn):
        monkeypatch.setattr(fn, "apply", lambda *a, fn=fn: applied.append(fn) or 1 / 0)
    with torch.no_grad():
        got = run(phi)
    got_no_input_needs_grad = run(phi)
    assert not applied
    for w, a, b in zip(want, got, got_no_input_needs_grad):
        assert torch.equal(w, a) and torch.equal(w, b) and a.grad_fn is None


def test_ops_in_inference_mode_under_enable_grad_run_without_autograd():
    """Megatron runs bias-dropout-add under ``torch.enable_grad`` also inside its inference
    engines' ``torch.inference_mode``: there the combine gets inference tensors and a bias
    parameter that requires grad. Nothing can be saved for backward, so the ops run without
    autograd, with the bits of the same ops on inputs that do not require grad."""
    from mhc_megatron.kernels import triton_combine, triton_pre

    n, c, t = 4, 24, 5
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, n * c, generator=g).to(DEV, torch.bfloat16)
    f = torch.randn(t, c, generator=g).to(DEV, torch.bfloat16)
    params = (*_params(n, c, 3), torch.randn(c, generator=g).to(DEV, torch.bfloat16))

    def run(phi, alpha, bias, f_bias):
        y, h_pre, h_post, h_res = triton_pre.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
        with torch.enable_grad():  # as Megatron's bias_dropout_add_exec_handler
            out = triton_combine.combine(x, f, f_bias, h_res, h_post, n=n)
            x2, y2 = triton_combine.combine_aggregate(x, f, f_bias, h_res, h_post, h_pre, n=n)
            y3 = triton_pre.aggregate(x2, h_pre, n=n)
        return y, h_pre, h_post, h_res, out, x2, y2, y3

    want = run(*params)
    with torch.inference_mode():
        got = run(*(p.clone().requires_grad_() for p in params))
    for w, a in zip(want, got):
        assert torch.equal(w, a) and a.grad_fn is None and not a.requires_grad
