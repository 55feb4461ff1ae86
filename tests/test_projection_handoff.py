"""The projection hand-off (``MHC_PROJECTION_HANDOFF=1``,
:class:`~mhc_megatron.kernels.handoff.ProjectionHandoff`): the combine of a sublayer forms the
next pre's projection of the streams it writes, and that pre uses it in place of its own pass
over them.

Held to independent references: the combine's partials against float64 ``x' @ phi^T`` of the
streams it stored; pre with the hand-off against pre without it (its own projection kernel);
a GPT model with the hand-offs against the same model without them, and with the recompute.
On CPU the kernels run in Triton's interpreter; on a GPU compiled, plus real sizes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import batch, build_gpt, lm_loss, moe_overrides, tiny_config

from mhc_megatron.kernels import reference as ref
from mhc_megatron.kernels import triton_combine, triton_mhc, triton_pre
from mhc_megatron.kernels.handoff import ProjectionHandoff
from mhc_megatron.kernels.triton_common import PROJECTION_STREAMS
from mhc_megatron.recompute import manager_for
from mhc_megatron.testing.cpu import setup_cpu_megatron

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CPU_SHAPES = [(5, 1, 7), (19, 2, 33), (17, 4, 24), (21, 4, 130), (3, 8, 5)]
GPU_SHAPES = CPU_SHAPES + [(4097, 4, 1000), (1000, 4, 4096), (4096, 4, 4096)]
SHAPES = GPU_SHAPES if CUDA else CPU_SHAPES
# The projection's partials against float64: bf16 x' against phi's hi + lo bf16 halves (~16
# bits, also in the interpreter), fp16 x' widened against TF32 phi (11 bits), fp32 x' with
# 3xTF32; the interpreter computes the other dots in fp32.
PROJ_TOL = {torch.float32: 1e-5 if CUDA else 1e-6, torch.bfloat16: 1e-4,
            torch.float16: 2e-3 if CUDA else 1e-6}
# pre with and without the hand-off: the same math but for the order of the projection's
# fp32 additions; y in 16 bits may round the other way where h_pre moved by an fp32 ulp.
SAME_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def handoff_on(monkeypatch):
    monkeypatch.setenv("MHC_PROJECTION_HANDOFF", "1")


def _combine_case(t, n, c, dtype, seed, x_layout="tokens"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, c, generator=g).to(DEV, dtype)
    if x_layout == "broadcast":  # global layer 1's first combine reads the embeddings so
        x = x[:, :1].expand(t, n, c)
    f = torch.randn(t, c, generator=g).to(DEV, dtype)
    fb = torch.randn(c, generator=g).to(DEV, dtype) if seed % 2 else None
    h_res = ref.sinkhorn(torch.randn(t, n, n, generator=g), 20).to(DEV)
    h_post = (2 * torch.rand(t, n, generator=g)).to(DEV)
    m = 2 * n + n * n
    phi = (torch.randn(m, n * c, generator=g) * 0.5 / (n * c) ** 0.5).to(DEV)
    alpha = (torch.rand(3, generator=g) + 0.5).to(DEV)
    bias = torch.randn(m, generator=g).to(DEV)
    kw = {}
    if x_layout == "streams":  # [s, b, n*C] as the layers carry them
        x, f, kw = x.reshape(t, 1, n * c), f.view(t, 1, c), {"n": n}
    return x, f, fb, h_res, h_post, (phi, alpha, bias), kw


@pytest.mark.parametrize("t,n,c", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_layout", ["tokens", "streams", "broadcast"])
def test_combine_forms_the_next_projection(handoff_on, t, n, c, dtype, x_layout):
    """With a hand-off the combine writes ``x'`` bit for bit as without one (the same helper
    forms it in both kernels), and its partials, summed over the channel splits, are
    ``x' @ phi^T`` and ``sum x'^2`` of the stored ``x'`` (float64 reference); the padding
    columns stay zero. n = 8 is not projected: the hand-off stays empty."""
    if not CUDA and dtype == torch.float16 and (n != 4 or x_layout != "tokens"):
        pytest.skip("fp16 on the CPU interpreter: one case is enough")
    x, f, fb, h_res, h_post, (phi, _, _), kw = _combine_case(t, n, c, dtype, t + n + c, x_layout)
    with torch.no_grad():
        plain = triton_mhc.combine(x, f, fb, h_res, h_post, **kw)
        handoff = ProjectionHandoff.request(phi, x)
        out = triton_mhc.combine(x, f, fb, h_res, h_post, **kw, projection=handoff)
    assert torch.equal(out, plain)
    if n not in PROJECTION_STREAMS:
        assert handoff.part is None and handoff.ss is None
        return
    m = 2 * n + n * n
    o = out.double().reshape(t, n * c)
    part, ss = handoff.part.double().sum(0), handoff.ss.double().sum(0)
    assert handoff.part.dtype == torch.float32 and handoff.part.shape[1] == t
    assert rel_err(part[:, :m], o @ phi.double().T) < PROJ_TOL[dtype]
    assert not part[:, m:].any()
    assert rel_err(ss, (o * o).sum(1)) < 1e-6


@pytest.mark.parametrize("t,n,c", [s for s in SHAPES if s[1] in PROJECTION_STREAMS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_with_the_handoff_equals_pre_without(handoff_on, monkeypatch, t, n, c, dtype):
    """pre on the combine's output, given the combine's hand-off, runs no projection of its
    own and returns what it returns forming the projection itself: ``y``, the mappings and
    every gradient (to the rounding of the projection's other order of fp32 additions); the
    hand-off is read once."""
    projections = _count_pre_projections(monkeypatch)
    x, f, fb, h_res, h_post, (phi, alpha, bias), _ = _combine_case(t, n, c, dtype, 3 * t + c)
    g = torch.Generator().manual_seed(t)
    grads = [torch.randn(t, c, generator=g).to(DEV, dtype), torch.randn(t, n, generator=g).to(DEV),
             torch.randn(t, n, generator=g).to(DEV), torch.randn(t, n, n, generator=g).to(DEV)]
    runs = []
    for with_handoff in (True, False):
        leaves = [v.detach().clone().requires_grad_() for v in (phi, alpha, bias)]
        handoff = ProjectionHandoff.request(leaves[0], x) if with_handoff else None
        with torch.no_grad():
            xs = triton_mhc.combine(x, f, fb, h_res, h_post, projection=handoff)
        xs.requires_grad_()
        taken = None
        if with_handoff:
            handoff.attach(xs)
            taken = ProjectionHandoff.take(xs, leaves[0])
            assert taken is handoff and ProjectionHandoff.take(xs, leaves[0]) is None
        projections.clear()
        outs = triton_mhc.pre(xs, *leaves, 20, 1e-6, projection=taken)
        assert len(projections) == (0 if with_handoff else 1)
        torch.autograd.backward(outs, grads)
        runs.append(([o.detach() for o in outs], [v.grad for v in [xs, *leaves]]))
    (outs_h, grads_h), (outs_p, grads_p) = runs
    for name, a, b in zip(("y", "h_pre", "h_post", "h_res", "dx", "dphi", "dalpha", "dbias"),
                          outs_h + grads_h, outs_p + grads_p):
        assert torch.isfinite(a).all(), name
        tol = SAME_TOL[dtype] if name in ("y", "dx") else SAME_TOL[torch.float32] * 10
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e}"


def test_handoff_needs_its_tensor_and_phi_unmodified(handoff_on, monkeypatch):
    """Taken only from the tensor it was attached to, with neither that tensor nor phi
    modified in place since; detached from the tensor either way; never with the switch off."""
    x, f, fb, h_res, h_post, (phi, _, _), _ = _combine_case(9, 4, 16, torch.float32, 5)

    def formed():
        handoff = ProjectionHandoff.request(phi, x)
        with torch.no_grad():
            out = triton_mhc.combine(x, f, fb, h_res, h_post, projection=handoff)
        handoff.attach(out)
        return out, handoff

    out, handoff = formed()
    assert ProjectionHandoff.take(out.clone(), phi) is None  # another tensor
    assert ProjectionHandoff.take(out, phi.clone()) is None  # another phi
    assert ProjectionHandoff.take(out, phi) is None  # detached by the failed take above
    out, handoff = formed()
    out.mul_(2)
    assert ProjectionHandoff.take(out, phi) is None
    out, handoff = formed()
    phi.mul_(1.0)
    assert ProjectionHandoff.take(out, phi) is None
    out, handoff = formed()
    assert ProjectionHandoff.take(out, phi) is handoff
    monkeypatch.setenv("MHC_PROJECTION_HANDOFF", "0")
    assert ProjectionHandoff.request(phi, x) is None


def _count_takes(monkeypatch):
    taken = []
    take = ProjectionHandoff.take
    monkeypatch.setattr(ProjectionHandoff, "take", staticmethod(
        lambda x, phi: taken.append(take(x, phi)) or taken[-1]))
    return taken


def _count_projecting_combines(monkeypatch):
    launches = []
    launch = triton_combine._launch_combine_projection
    monkeypatch.setattr(triton_combine, "_launch_combine_projection",
                        lambda *args: launches.append(1) or launch(*args))
    return launches


def _count_pre_projections(monkeypatch):
    """Launches of pre's own projection kernel (``_proj_partial``)."""
    launches = []
    launch = triton_pre._PROJ
    monkeypatch.setattr(triton_pre, "_PROJ",
                        lambda *args, **kw: launches.append(1) or launch(*args, **kw))
    return launches


def _run(cfg, seed=21, data_seed=2):
    setup_cpu_megatron(seed=seed)
    model = build_gpt(cfg, DEV)
    loss = lm_loss(model, batch(device=DEV, seed=data_seed))
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, model


def _assert_close(run_a, run_b, rtol):
    (la, ga, _), (lb, gb, _) = run_a, run_b
    assert rel_err(la, lb) < rtol
    assert ga.keys() == gb.keys()
    for name in ga:
        assert rel_err(ga[name], gb[name]) < rtol, name


LAYERS = 3


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gpt_takes_a_handoff_in_every_sublayer_but_the_first(seeded, monkeypatch, kind):
    """A GPT with the Triton backend: with the switch on, every pre but global layer 1's
    first (it reads the embeddings) gets its projection from the combine before it, within a
    layer and across layers, with grad and without; the loss and every gradient equal those
    of the same model without hand-offs (fp32 model: to the rounding of the projection's order
    of additions). Switch off: no combine projects."""
    extra = moe_overrides() if kind == "moe" else {"add_bias_linear": True}
    taken = _count_takes(monkeypatch)
    launches = _count_projecting_combines(monkeypatch)
    projections = _count_pre_projections(monkeypatch)
    cfg = tiny_config(num_layers=LAYERS, mhc_kernel_backend="triton", **extra)
    sublayers = 2 * LAYERS
    plain = _run(cfg)
    assert launches == [] and not any(taken) and len(projections) == sublayers
    monkeypatch.setenv("MHC_PROJECTION_HANDOFF", "1")
    taken.clear()
    projections.clear()
    handed = _run(cfg)
    assert len(taken) == sublayers and sum(t is not None for t in taken) == sublayers - 1
    assert len(launches) == sublayers - 1  # the last layer's MLP combine has no next pre
    assert len(projections) == 1  # global layer 1's first pre: the embeddings
    _assert_close(handed, plain, 1e-5)
    taken.clear()
    with torch.no_grad():  # inference: the same hand-offs
        handed[2](*batch(device=DEV, seed=2)[:3])
    assert sum(t is not None for t in taken) == sublayers - 1


def test_recompute_replays_the_combine_without_projecting(seeded, monkeypatch, handoff_on):
    """With ``mhc_recompute`` the forward's combines project as without it, the backward's
    replays never do (the recompute records the plain combine), and every gradient equals the
    run without recompute bit for bit on CPU (the replayed streams are the same bits)."""
    launches = _count_projecting_combines(monkeypatch)
    runs = []
    for recompute in (False, True):
        cfg = tiny_config(num_layers=LAYERS, mhc_kernel_backend="triton", add_bias_linear=True,
                          mhc_recompute=recompute, mhc_recompute_layer_num=2)
        launches.clear()
        runs.append(_run(cfg))
        assert len(launches) == 2 * LAYERS - 1
        if recompute:
            assert manager_for(cfg).blocks_recomputed == 2
    if CUDA:  # separate model runs: some CUDA kernels of the model are not deterministic
        _assert_close(*runs, 1e-5)
    else:
        (la, ga, _), (lb, gb, _) = runs
        assert torch.equal(la, lb) and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_with_handoffs(seeded, monkeypatch, handoff_on, method):
    """Megatron's full recompute re-runs checkpointed layers in backward from their saved
    (detached) inputs: the re-runs find no hand-off there and project themselves; loss and
    gradients equal the run without recompute."""
    taken = _count_takes(monkeypatch)
    base = tiny_config(num_layers=LAYERS, mhc_kernel_backend="triton")
    full = tiny_config(num_layers=LAYERS, mhc_kernel_backend="triton",
                       recompute_granularity="full", recompute_method=method,
                       recompute_num_layers=2)
    plain = _run(base)
    taken.clear()
    recomputed = _run(full)
    assert sum(t is not None for t in taken) >= 2 * LAYERS - 1  # the forward's, at least
    _assert_close(recomputed, plain, 1e-6)


def test_no_handoff_to_a_module_with_forward_pre_hooks(seeded, monkeypatch, handoff_on):
    """Megatron's DDP with ``overlap_param_gather`` hooks every module to wait for its
    parameters' all-gather before its forward: a combine must not read the next module's
    ``phi`` before that. No hand-off goes to a module with a forward pre-hook; the others
    still get theirs."""
    taken = _count_takes(monkeypatch)
    cfg = tiny_config(num_layers=LAYERS, mhc_kernel_backend="triton")
    setup_cpu_megatron(seed=21)
    model = build_gpt(cfg, DEV)
    hooked = model.decoder.layers[1].self_attention_hyper_connection
    hooked.register_forward_pre_hook(lambda *_: None)
    lm_loss(model, batch(device=DEV, seed=2)).backward()
    assert sum(t is not None for t in taken) == 2 * LAYERS - 2
