"""Fused Triton kernels in DeepSeek-V4's form against the PyTorch reference: "pre" with
DeepSeek-V4's mappings (``h_pre + eps``, the linear-domain Sinkhorn, ``h_res`` transposed or
not) and the output head, forward and every gradient; determinism, the aggregate's replay,
T=0, the paper's form unchanged, and the dispatch.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py sets it before triton is
imported) on small odd shapes; on a CUDA machine the same tests run compiled, plus real sizes.
"""

from __future__ import annotations

import pytest
import torch

from mhc_megatron.kernels import REFERENCE_OPS, select_ops, triton_mhc
from mhc_megatron.kernels import reference as ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# fp32 activations: TF32 projection on GPU (~1e-3); bf16/fp16: rounding of x, y and x'.
TOL = {torch.float32: 2e-3 if CUDA else 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 4e-3}
DSV4 = ref.MappingForm("deepseek_v4", eps=1e-6, transposed=True)
DSV4_PLAIN = ref.MappingForm("deepseek_v4", eps=1e-6, transposed=False)

CPU_SHAPES = [(5, 1, 7), (19, 2, 33), (17, 4, 24), (3, 8, 5), (21, 4, 130)]
GPU_SHAPES = CPU_SHAPES + [(4097, 4, 1000), (8191, 8, 257), (1000, 4, 4096)]
SHAPES = GPU_SHAPES if CUDA else CPU_SHAPES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _skip_fp16(n, dtype):
    if not CUDA and dtype == torch.float16 and n != 4:
        pytest.skip("fp16 on the CPU interpreter: one shape is enough")


def _check(results, names, tol):
    for name, a, b in zip(names, *results):
        assert torch.isfinite(a).all(), name
        err = rel_err(a, b)
        assert err < tol, f"{name}: rel err {err:.2e} >= {tol}"


# -------------------------------------------------------------------------------------- pre
def _pre_case(t, n, c, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    phi = (torch.randn(m, n * c, generator=g) * 0.5 / (n * c) ** 0.5).to(DEV)
    alpha = (torch.rand(3, generator=g) + 0.5).to(DEV)
    bias = torch.randn(m, generator=g).to(DEV)
    grads = [torch.randn(t, c, generator=g).to(DEV, dtype), torch.randn(t, n, generator=g).to(DEV),
             torch.randn(t, n, generator=g).to(DEV), torch.randn(t, n, n, generator=g).to(DEV)]
    return x, phi, alpha, bias, grads


def _run_pre(fn, x, phi, alpha, bias, grads, iters=20, form=DSV4, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, alpha, bias)]
    outs = fn(*leaves, iters, 1e-6, form=form, **kw)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _flat_pre(*args):
    """:func:`_run_pre`'s outputs and gradients as one list (:data:`PRE_NAMES`)."""
    outs, grads = _run_pre(*args)
    return outs + grads


PRE_NAMES = ("y", "h_pre", "h_post", "h_res", "dx", "dphi", "dalpha", "dbias")


@pytest.mark.parametrize("t,n,c", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", [DSV4, DSV4_PLAIN], ids=["transposed", "plain"])
@pytest.mark.parametrize("iters", [1, 20])
def test_pre_dsv4_matches_reference(t, n, c, dtype, form, iters):
    _skip_fp16(n, dtype)
    x, phi, alpha, bias, grads = _pre_case(t, n, c, dtype, seed=t + 10 * n + c)
    outs, grads_t = _run_pre(triton_mhc.pre, x, phi, alpha, bias, grads, iters, form)
    outs0, grads0 = _run_pre(ref.pre, x, phi, alpha, bias, grads, iters, form)
    assert outs[0].dtype == dtype and outs[3].dtype == torch.float32
    _check((outs + grads_t, outs0 + grads0), PRE_NAMES, TOL[dtype])


@pytest.mark.parametrize("t,n,c", [(19, 2, 33), (17, 4, 24), (3, 8, 5)])
def test_pre_paper_form_transposed_matches_reference(t, n, c):
    """``transposed`` applies to the paper's Sinkhorn too (``h_res = M^T``)."""
    form = ref.MappingForm(transposed=True)
    x, phi, alpha, bias, grads = _pre_case(t, n, c, torch.float32, seed=t + n)
    outs, grads_t = _run_pre(triton_mhc.pre, x, phi, alpha, bias, grads, 20, form)
    outs0, grads0 = _run_pre(ref.pre, x, phi, alpha, bias, grads, 20, form)
    _check((outs + grads_t, outs0 + grads0), PRE_NAMES, TOL[torch.float32])


@pytest.mark.parametrize("t,n,c", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paper_form_bits_unchanged(t, n, c, dtype):
    """``form=PAPER`` is the default: the same launches, the same bits, forward and backward."""
    x, phi, alpha, bias, grads = _pre_case(t, n, c, dtype, seed=t * n + c)
    leaves = [v.detach().clone().requires_grad_() for v in (x, phi, alpha, bias)]
    outs = triton_mhc.pre(*leaves, 20, 1e-6)
    torch.autograd.backward(outs, grads)
    default = [o.detach() for o in outs] + [leaf.grad for leaf in leaves]
    explicit = _flat_pre(triton_mhc.pre, x, phi, alpha, bias, grads, 20, ref.PAPER)
    for name, a, b in zip(PRE_NAMES, default, explicit):
        assert torch.equal(a, b), name
    paper0 = _flat_pre(ref.pre, x, phi, alpha, bias, grads, 20, ref.PAPER)
    _check((default, paper0), PRE_NAMES, TOL[dtype])


def test_forms_never_share_a_launch_plan():
    from mhc_megatron.kernels.triton_common import plan
    from mhc_megatron.kernels.triton_pre_bwd import _PreBackwardPlan
    from mhc_megatron.kernels.triton_pre_fwd import _PreForwardPlan

    key = (64, 4, 32, torch.float32, None)
    fwd = {flags: plan(_PreForwardPlan, *key, False, *flags)
           for flags in ((False, False), (True, False), (True, True), (False, True))}
    bwd = {flags: plan(_PreBackwardPlan, *key, True, False, False, *flags) for flags in fwd}
    for plans in (fwd, bwd):
        assert len({id(p) for p in plans.values()}) == 4
        assert len({p.map_meta for p in plans.values()}) == 4
        assert plans[(True, True)].map_meta.kwargs["DSV4"]
        assert plans[(True, True)].map_meta.kwargs["TRANSPOSED"]
        assert not plans[(False, False)].map_meta.kwargs["DSV4"]


def test_unknown_form_is_refused():
    x, phi, alpha, bias, _ = _pre_case(4, 4, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"mhc_mapping_form='deepseek_v3' is unknown.*Fix: "):
        triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, form=ref.MappingForm("deepseek_v3"))


@pytest.mark.parametrize("t,n,c", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aggregate_replays_dsv4_pre_bitwise(t, n, c, dtype):
    """``aggregate(x, h_pre)`` (what mhc_recompute replays) gives the DeepSeek-V4 pre's ``y``
    bit for bit (its ``h_pre`` carries the ``+ eps``)."""
    x, phi, alpha, bias, _ = _pre_case(t, n, c, dtype, seed=t + n + c)
    with torch.no_grad():
        y, h_pre, _, _ = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, form=DSV4)
        again = triton_mhc.aggregate(x, h_pre)
    assert again.dtype == dtype and torch.equal(again, y)
    assert rel_err(again, ref.aggregate(x, h_pre)) < TOL[dtype]


def test_dsv4_sublayer_hands_dx_to_pre():
    """pre (DeepSeek-V4, ``h_res = M^T``) then combine on the same x: combine's dx is formed
    in pre's kernel from the transposed ``h_res`` it was given, as the reference computes."""
    t, n, c = 23, 4, 40
    x, phi, alpha, bias, _ = _pre_case(t, n, c, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    w = torch.randn(c, generator=g).to(DEV)
    up = torch.randn(t, n, c, generator=g).to(DEV)
    results = []
    for ops_pre, ops_combine in ((triton_mhc.pre, triton_mhc.combine),
                                 (ref.pre, ref.expand_combine)):
        leaves = [v.detach().clone().requires_grad_() for v in (x, phi, alpha, bias, w)]
        y, _, h_post, h_res = ops_pre(*leaves[:4], 20, 1e-6, form=DSV4)
        out = ops_combine(leaves[0], y * leaves[4], None, h_res, h_post)
        if ops_pre is triton_mhc.pre:
            assert h_res._mhc_dx_link.claimed, "combine did not hand its dx to pre"
        out.backward(up)
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    _check(results, ("out", "dx", "dphi", "dalpha", "dbias", "dw"), TOL[torch.float32])


# ---------------------------------------------------------------------------- output head
def _head_case(t, n, c, dtype, seed, params_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    phi = (torch.randn(n, n * c, generator=g) * 2.0 / (n * c) ** 0.5).to(DEV, params_dtype)
    alpha = (torch.rand(1, generator=g) + 0.5).to(DEV, params_dtype)
    bias = torch.randn(n, generator=g).to(DEV, params_dtype)
    up = torch.randn(t, c, generator=g).to(DEV, dtype)
    return x, phi, alpha, bias, up


def _run_head(fn, x, phi, alpha, bias, up, **kw):
    leaves = [v.detach().clone().requires_grad_() for v in (x, phi, alpha, bias)]
    y = fn(*leaves, 1e-6, 1e-6, **kw)
    y.backward(up)
    return [y.detach()] + [leaf.grad for leaf in leaves]


HEAD_NAMES = ("y", "dx", "dphi", "dalpha", "dbias")


def _dalpha_scale(x, phi, alpha, bias, up):
    """``sum_t,i |dz_ti Ht_ti|`` (fp64), the size of the terms whose sum is the head's
    ``dalpha``: one scalar of random-signed terms, whose fp32 sum (the reference's too) is
    good to that scale times ~1e-7, not to its own size."""
    x, phi, alpha, bias, up = (v.double() for v in (x, phi, alpha, bias, up))
    ht, _ = ref.project_and_rms(x, phi, 1e-6)
    s = torch.sigmoid(alpha * ht + bias)
    dz = torch.einsum("tc,tnc->tn", up, x) * s * (1 - s)
    return (dz * ht).abs().sum().item()


def _check_head(out, out0, case, tol):
    """``out`` to ``out0`` (:data:`HEAD_NAMES`) by relative error, ``dalpha`` relative to the
    size of its terms (:func:`_dalpha_scale`)."""
    _check((out[:3] + out[4:], out0[:3] + out0[4:]), HEAD_NAMES[:3] + HEAD_NAMES[4:], tol)
    err = (out[3].double() - out0[3].double()).abs().item() / _dalpha_scale(*case)
    assert torch.isfinite(out[3]).all() and err < tol, f"dalpha: err {err:.2e} >= {tol}"


@pytest.mark.parametrize("t,n,c", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_head_matches_reference(t, n, c, dtype):
    _skip_fp16(n, dtype)
    case = _head_case(t, n, c, dtype, seed=t + 10 * n + c)
    out = _run_head(triton_mhc.output_head, *case)
    out0 = _run_head(ref.output_head, *case)
    assert out[0].dtype == dtype and out[0].shape == (t, c)
    _check_head(out, out0, case, TOL[dtype])


@pytest.mark.parametrize("t,n,c,streams", [(17, 4, 24, 4), (9, 8, 40, 8), (19, 2, 33, 2)]
                         + ([(4097, 4, 1000, 4)] if CUDA else []))
def test_output_head_dx_pass_over_several_streams_a_program(monkeypatch, t, n, c, streams):
    """The head's backward runs pre's dx pass (``M = n`` rows): with ``TILES.dx_streams``
    programs covering several streams, the same ``dx`` bits as one stream a program, the
    other gradients to fp32 rounding, and the reference to the usual tolerance."""
    from mhc_megatron.kernels.triton_common import TILES

    dtype = torch.bfloat16
    case = _head_case(t, n, c, dtype, seed=t + n)
    monkeypatch.setattr(TILES, "dx_streams", 1)
    one = _run_head(triton_mhc.output_head, *case)
    monkeypatch.setattr(TILES, "dx_streams", streams)
    several = _run_head(triton_mhc.output_head, *case)
    assert torch.equal(several[0], one[0]) and torch.equal(several[1], one[1])  # y, dx
    for name, a, b in zip(HEAD_NAMES[2:], several[2:], one[2:]):
        assert ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) < 1e-5, name
    _check_head(several, _run_head(ref.output_head, *case), case, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_head_streams_layout(dtype):
    """On the streams ``[s, b, n*C]`` (``n`` given): ``y [s, b, C]``, bit for bit the token
    layout's, and no view node in the graph."""
    s, b, n, c = 7, 3, 4, 24
    x, phi, alpha, bias, up = _head_case(s * b, n, c, dtype, seed=5)
    tokens = _run_head(triton_mhc.output_head, x, phi, alpha, bias, up)
    streams = _run_head(triton_mhc.output_head, x.reshape(s, b, n * c), phi, alpha, bias,
                        up.view(s, b, c), n=n)
    y = triton_mhc.output_head(x.reshape(s, b, n * c).requires_grad_(), phi, alpha, bias, 1e-6,
                               1e-6, n=n)
    assert y.shape == (s, b, c) and type(y.grad_fn).__name__ == "_HeadFnBackward"
    assert streams[0].shape == (s, b, c) and streams[1].shape == (s, b, n * c)
    for name, a, bb in zip(HEAD_NAMES, tokens, streams):
        assert torch.equal(a.reshape(-1), bb.reshape(-1)), name
    # the dispatch's reference wrapper takes the same layout
    refs = _run_head(REFERENCE_OPS.output_head, x.reshape(s, b, n * c), phi, alpha, bias,
                     up.view(s, b, c), n=n)
    assert refs[0].shape == (s, b, c)
    _check_head(streams, refs, (x, phi, alpha, bias, up), TOL[dtype])


def test_output_head_broadcast_streams_equal_their_copy():
    """n equal streams as a view (stream stride 0) give what their materialised copy gives."""
    t, n, c = 13, 4, 32
    x, phi, alpha, bias, up = _head_case(t, n, c, torch.float32, seed=9)
    h = x[:, 0].contiguous()
    runs = []
    for materialise in (False, True):
        hl = h.clone().requires_grad_()
        params = [p.detach().clone().requires_grad_() for p in (phi, alpha, bias)]
        xs = hl.view(t, 1, c).expand(t, n, c)
        y = triton_mhc.output_head(xs.contiguous() if materialise else xs, *params, 1e-6, 1e-6)
        y.backward(up)
        runs.append([y.detach(), hl.grad] + [p.grad for p in params])
    for name, a, b in zip(HEAD_NAMES, *runs):
        assert torch.equal(a, b), name


def test_output_head_params_in_low_precision_get_grads_in_their_dtype():
    case = _head_case(17, 4, 24, torch.bfloat16, seed=3, params_dtype=torch.bfloat16)
    out = _run_head(triton_mhc.output_head, *case)
    assert [g.dtype for g in out[2:]] == [torch.bfloat16] * 3
    _check_head(out, _run_head(ref.output_head, *case), case, TOL[torch.bfloat16])


def test_output_head_refuses_a_sublayers_parameters():
    x, phi, alpha, bias, _ = _pre_case(4, 4, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"output head needs phi \[n, n\*C\] = \[4, 32\]"):
        triton_mhc.output_head(x, phi, alpha, bias, 1e-6, 1e-6)


# ------------------------------------------------------------------ determinism, T=0, dispatch
@pytest.mark.parametrize("t,n,c", [(37, 4, 48)] + ([(16384, 4, 2048)] if CUDA else []))
def test_deterministic_bitwise(t, n, c):
    """Run to run bitwise equality of the DeepSeek-V4 pre and of the head; on the GPU also at
    a real size (hundreds of programs writing split partials summed in a fixed order)."""
    x, phi, alpha, bias, grads = _pre_case(t, n, c, torch.bfloat16, seed=3)
    head_case = _head_case(t, n, c, torch.bfloat16, seed=4)
    first = _flat_pre(triton_mhc.pre, x, phi, alpha, bias, grads)
    first_head = _run_head(triton_mhc.output_head, *head_case)
    for _ in range(2):
        again = _flat_pre(triton_mhc.pre, x, phi, alpha, bias, grads)
        again_head = _run_head(triton_mhc.output_head, *head_case)
        for a, b in zip(first + first_head, again + again_head):
            assert torch.equal(a, b)


def test_empty_token_count():
    x, phi, alpha, bias, grads = _pre_case(0, 4, 8, torch.float32, seed=1)
    outs, grads_t = _run_pre(triton_mhc.pre, x, phi, alpha, bias, grads)
    assert outs[0].shape == (0, 8) and outs[3].shape == (0, 4, 4)
    assert grads_t[0].shape == (0, 4, 8) and not grads_t[1].any() and not grads_t[2].any()
    out = _run_head(triton_mhc.output_head, *_head_case(0, 4, 8, torch.float32, seed=1))
    assert out[0].shape == (0, 8) and out[1].shape == (0, 4, 8)
    assert out[2].shape == (4, 32) and not any(g.any() for g in out[2:])


def test_select_ops_runs_triton_for_deepseek_v4(monkeypatch):
    """'triton' takes DeepSeek-V4's form (and the head) where it runs at all; on CPU under the
    interpreter here, compiled on a GPU. The ops equal the reference's."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    s, b, n, c = 5, 2, 4, 16
    x, phi, alpha, bias, _ = _pre_case(s * b, n, c, torch.float32, seed=8)
    streams = x.reshape(s, b, n * c)
    for form in (DSV4, DSV4_PLAIN, ref.MappingForm(transposed=True)):
        ops = select_ops("triton", streams, n, form=form)
        assert ops.name == "triton" and ops.output_head is triton_mhc.output_head
        with torch.no_grad():
            got = ops.pre(streams, phi, alpha, bias, 20, 1e-6, n=n, form=form)
            want = REFERENCE_OPS.pre(streams, phi, alpha, bias, 20, 1e-6, n=n, form=form)
        _check((got, want), PRE_NAMES[:4], TOL[torch.float32])
    head = _head_case(s * b, n, c, torch.float32, seed=8)[1:4]
    with torch.no_grad():
        got = select_ops("triton", streams, n, form=DSV4).output_head(streams, *head, 1e-6, 1e-6,
                                                                      n=n)
        want = REFERENCE_OPS.output_head(streams, *head, 1e-6, 1e-6, n=n)
    assert got.shape == want.shape == (s, b, c)
    _check(([got], [want]), ("y",), TOL[torch.float32])


def test_reference_backend_output_head_is_the_reference():
    x, phi, alpha, bias, _ = _head_case(9, 4, 8, torch.float32, seed=2)
    assert select_ops("reference", x, form=DSV4) is REFERENCE_OPS
    want = ref.output_head(x, phi, alpha, bias, 1e-6, 1e-6)
    assert torch.equal(REFERENCE_OPS.output_head(x, phi, alpha, bias, 1e-6, 1e-6), want)
    got = REFERENCE_OPS.output_head(x.reshape(3, 3, 32), phi, alpha, bias, 1e-6, 1e-6, n=4)
    assert got.shape == (3, 3, 8) and torch.equal(got.reshape(9, 8), want)
