"""The ops' C++ autograd nodes (mhc_megatron.kernels.native_autograd).

CPU: without the extension the ops keep their Python autograd functions, and the dx hand-off
between combine and pre works through its Python half; tensor subclasses keep the Python
functions. CUDA: a sublayer whose op calls run through the C++ nodes (their forward replayed,
their backward first through the Python fallback, then replayed) gives the same bits as the
Python autograd functions, in every variant the ops have; gradients the recipes were not
recorded for (strided, undefined) take the fallback and still agree; saved-tensor hooks see
the nodes' saved tensors; a second backward through a freed graph fails as autograd's does;
an error raised in the fallback reaches the caller; replayed ops under a CUDA graph capture,
through the nodes and through the Python functions; a Megatron GPT's sublayers take the nodes.
The module's calls (one call into the extension a sublayer op, from the module's call site)
give the ops' bits, hand combine's dx to pre as the ops do, and leave bad input to the
module's errors; freed nodes' storage is reused. On the CPU, with a stand-in extension: which
calls they take (the site's arguments, ``main_grad`` buffers and plans, every switch on) and
which they leave to the op.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (SUBLAYER_VARIANTS, skip_without_host_replay, sublayer_inputs,
                     sublayer_ops_case)

from mhc_megatron.kernels import host_replay, native_autograd
from mhc_megatron.kernels.handoff import DxLink


def test_the_handoff_works_without_the_extension(monkeypatch):
    monkeypatch.setattr(host_replay, "_extension", None)
    x = torch.randn(3, 4, requires_grad=True)
    link = DxLink(x)
    assert link.native is None and link.take() is None
    g, h = torch.randn(3, 4), torch.randn(3, 2, 2)
    link.park(g, h)
    got = link.take()
    assert got[0] is g and got[1] is h and link.take() is None


def test_no_nodes_without_the_extension(monkeypatch):
    monkeypatch.setattr(host_replay, "_extension", None)
    monkeypatch.setattr(host_replay, "_unavailable", "no CUDA device")
    assert native_autograd.extension() is None
    native_autograd.set_enabled(False)
    try:
        assert not native_autograd.enabled()
    finally:
        native_autograd.set_enabled(True)


def test_only_plain_tensors_take_the_nodes():
    class Sub(torch.Tensor):
        pass

    t = torch.zeros(2)
    assert native_autograd.plain(t, torch.nn.Parameter(torch.zeros(2)), None)
    assert not native_autograd.plain(t, t.as_subclass(Sub))


# ---- CUDA: the nodes against the Python autograd functions, bit for bit

PYTHON_NODES = ("_PreFnBackward", "_CombineFnBackward")
NATIVE_NODES = ("MHCPreBackward", "MHCCombineBackward")


def _backward_recipes() -> int:
    from mhc_megatron.kernels.triton_common import PLANS

    return sum(r.table.backward_recipes() for p in PLANS.values()
               for r in getattr(p, "recipes", {}).values() if r and r.table is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SUBLAYER_VARIANTS)
def test_nodes_equal_the_python_functions(monkeypatch, variant):
    skip_without_host_replay()
    from mhc_megatron.kernels.triton_common import PLANS

    monkeypatch.setattr(native_autograd, "_ENABLED", False)
    PLANS.clear()
    want, names = sublayer_ops_case(variant)  # the Python functions (records the recipes)
    want_again, _ = sublayer_ops_case(variant, seed=1)
    assert names == PYTHON_NODES
    monkeypatch.setattr(native_autograd, "_ENABLED", True)
    PLANS.clear()
    first, names_first = sublayer_ops_case(variant)  # records (the Python functions)
    fallback, names_fallback = sublayer_ops_case(variant)  # nodes: forward replayed, backward in Python
    assert _backward_recipes() == 2  # pre's and combine's, recorded by the fallback
    replayed, names_replayed = sublayer_ops_case(variant)  # nodes: both replayed
    again, _ = sublayer_ops_case(variant, seed=1)
    assert names_first == PYTHON_NODES
    assert names_fallback == names_replayed == NATIVE_NODES
    assert _backward_recipes() == 2  # no other variant met
    for name, w, a, b, c in zip(range(99), want, first, fallback, replayed):
        assert torch.equal(w, a) and torch.equal(w, b) and torch.equal(w, c), name
    for w, a in zip(want_again, again):
        assert torch.equal(w, a)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fold", "no_fold"])
def test_gradients_the_recipes_were_not_recorded_for_take_the_fallback(monkeypatch, variant):
    """A strided upstream gradient: the nodes' backward runs the Python path (which makes it
    contiguous) and agrees with the Python functions given the same gradient."""
    skip_without_host_replay()
    monkeypatch.setattr(native_autograd, "_ENABLED", False)
    want, _ = sublayer_ops_case(variant, strided_grad=True)
    monkeypatch.setattr(native_autograd, "_ENABLED", True)
    for _ in range(3):
        got, names = sublayer_ops_case(variant, strided_grad=True)
        for w, a in zip(want, got):
            assert torch.equal(w, a)
    assert names == NATIVE_NODES


@pytest.mark.gpu
def test_saved_tensor_hooks_see_the_nodes_saved_tensors():
    """The nodes save through autograd's saved variables: a ``saved_tensors_hooks`` pair packs
    each saved tensor once in forward and unpacks it in backward (what mhc_recompute and
    activation offloading build on); results equal the run without hooks."""
    skip_without_host_replay()
    for _ in range(2):  # records, then the nodes with the backward fallback
        want, names = sublayer_ops_case("fold")
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        got, names = sublayer_ops_case("fold")
    assert names == NATIVE_NODES
    # pre: x, phi, alpha, bias, ht, rstd, h_pre; combine: x, f, f_bias (none), h_res, h_post;
    # and y * 1.25 saves nothing of a tensor
    assert len(packed) >= 11 and len(unpacked) == len(packed)
    for w, a in zip(want, got):
        assert torch.equal(w, a)


@pytest.mark.gpu
def test_a_second_backward_through_the_freed_graph_fails_as_autograds():
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_mhc

    n = 4
    x, phi, alpha, bias = sublayer_inputs(16, 64, n)
    for _ in range(3):
        y, _, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
        out = triton_mhc.combine(x, y, None, h_res, h_post, n=n)
        loss = out.float().sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        loss.backward()  # the retained graph runs again: the same gradient
        assert torch.equal(first, x.grad)
        x.grad = None
    assert y.grad_fn.name() == "MHCPreBackward"
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.gpu
def test_an_error_in_the_fallback_reaches_the_caller(monkeypatch):
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_pre

    for _ in range(2):
        sublayer_ops_case("fold", T=19)  # the forward recipes, and the fallback's backward recipes
    from mhc_megatron.kernels.triton_common import PLANS

    for p in PLANS.values():  # the nodes must fall back again: drop their backward recipes
        for r in getattr(p, "recipes", {}).values():
            if r:
                r.table = None

    def broken(*args, **kwargs):
        raise ValueError("the fallback's own error")

    monkeypatch.setattr(triton_pre, "_pre_backward", broken)
    with pytest.raises(RuntimeError, match="the fallback's own error"):
        sublayer_ops_case("fold", T=19)


@pytest.mark.gpu
@pytest.mark.parametrize("nodes", [True, False], ids=["C++ nodes", "Python functions"])
def test_replayed_ops_under_cuda_graph_capture(monkeypatch, nodes):
    """A replayed sublayer captured in a CUDA graph, through the C++ nodes (their backward
    falls back to the Python path while capturing, which takes fresh temporaries) or the
    Python functions: the graph's replay equals eager, bit for bit, and eager after the
    capture still replays."""
    skip_without_host_replay()
    monkeypatch.setattr(native_autograd, "_ENABLED", nodes)
    from mhc_megatron.kernels import triton_mhc

    T, C, n = 64, 128, 4
    m = 2 * n + n * n
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(T, n * C, device="cuda", dtype=torch.bfloat16, generator=g)
    phi = (0.02 * torch.randn(m, n * C, device="cuda", generator=g)).requires_grad_()
    alpha = torch.full((3,), 0.3, device="cuda", requires_grad=True)
    bias = torch.zeros(m, device="cuda", requires_grad=True)
    names = []

    def step():
        x_ = x.detach().requires_grad_()
        y, _, h_post, h_res = triton_mhc.pre(x_, phi, alpha, bias, 20, 1e-6, n=n)
        out = triton_mhc.combine(x_, y, None, h_res, h_post, n=n)
        names.append((y.grad_fn.name(), out.grad_fn.name()))
        grads = torch.autograd.grad(out.float().sum(), (x_, phi))
        return (out.detach(), *grads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    assert names[-1] == (NATIVE_NODES if nodes else PYTHON_NODES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured):
        assert torch.equal(e, c)
    with torch.cuda.stream(side):
        after = step()
    torch.cuda.synchronize()
    for e, a in zip(eager, after):
        assert torch.equal(e, a)


def _graph_node_names(root) -> list[str]:
    """The names of every autograd node reachable from ``root``."""
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(fn for fn, _ in node.next_functions)
    return names


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "mhc_recompute"])
def test_a_megatron_models_sublayers_run_through_the_nodes(megatron_single_rank, recompute):
    """In a Megatron GPT with mHC (the golden digest's model: 4 layers, local specs, Triton
    kernels; global layer 1 reads the embeddings as broadcast streams), every sublayer's ops
    take the C++ nodes once their forward is recorded, with and without ``mhc_recompute``."""
    skip_without_host_replay()
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "gpu_child" / "model_step_digest.py"
    spec = importlib.util.spec_from_file_location("model_step_digest", path)
    digest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digest)
    model = digest._model(recompute)
    seq, batch, vocab = digest.SEQ, digest.BATCH, digest.VOCAB
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), 1)[None, None]
    for _ in range(2):  # records the forward, then the nodes (their backward falls back once)
        loss = model(ids, pos, mask, labels=ids).float().mean()
        names = _graph_node_names(loss.grad_fn)
        loss.backward()
    sublayers = 2 * digest.LAYERS
    assert names.count("MHCPreBackward") == sublayers, names
    assert names.count("MHCCombineBackward") == sublayers, names
    assert not set(names) & set(PYTHON_NODES), names


def test_megatron_fsdp_parameters_keep_the_python_function_with_the_fusion(monkeypatch):
    """With gradient-accumulation fusion a Megatron-FSDP parameter (``__fsdp_param__``; its
    ``main_grad`` is allocated in backward) never takes the node, which would resolve the
    buffer at forward; without the fusion it does."""
    from types import SimpleNamespace

    from mhc_megatron.kernels import triton_pre

    applied = []
    ext = SimpleNamespace(pre_apply=lambda *args: applied.append(args) or (None,) * 4)
    monkeypatch.setattr(native_autograd, "extension", lambda: ext)
    plan = SimpleNamespace(scratch=SimpleNamespace(reuse=False))  # (fresh temporaries: no site)
    monkeypatch.setattr(triton_pre, "_pre_forward_call", lambda *args: (plan, None, ()))
    monkeypatch.setattr(host_replay, "recorded", lambda plan, key: SimpleNamespace(table=1))
    x, phi, alpha, bias = (torch.zeros(2, 4 * 8), torch.zeros(24, 32), torch.zeros(3),
                           torch.zeros(24))
    phi.__fsdp_param__ = True
    assert triton_pre._pre_native(x, phi, alpha, bias, 20, 1e-6, None, 4, triton_pre.PAPER,
                                  main_grads=True) is None and not applied
    assert triton_pre._pre_native(x, phi, alpha, bias, 20, 1e-6, None, 4, triton_pre.PAPER,
                                  main_grads=False) is not None and len(applied) == 1


# ---- CUDA: call sites (the forward of a call like the last one, checked in C++)

def _site_calls(params, seeds, T=37, C=96, n=4, layout="streams", bias=False):
    """pre and the combine of ``1.25 y`` (+ a bias) on ``params`` for fresh inputs of each seed,
    forward and backward: every output and gradient, cloned, per call."""
    from mhc_megatron.kernels import triton_mhc
    from mhc_megatron.layers.streams import broadcast_streams

    phi, alpha, bias_p = params
    results = []
    for seed in seeds:
        g = torch.Generator(device="cuda").manual_seed(seed)
        if layout == "broadcast":
            leaf = torch.randn(T, 1, C, device="cuda", dtype=torch.bfloat16,
                               generator=g).requires_grad_()
            x, n_arg = broadcast_streams(leaf, n).view(T, n, C), None
        else:
            leaf = torch.randn(T, n * C, device="cuda", dtype=torch.bfloat16,
                               generator=g).requires_grad_()
            x, n_arg = leaf, n
        f_bias = (0.1 * torch.randn(C, device="cuda", dtype=torch.bfloat16, generator=g)
                  ).requires_grad_() if bias else None
        y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias_p, 20, 1e-6, n=n_arg)
        out = triton_mhc.combine(x, 1.25 * y, f_bias, h_res, h_post, n=n_arg)
        out.backward(torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g))
        grads = [t.grad.clone() for t in (leaf, *params, *([f_bias] if bias else []))]
        results.append([out.detach().clone(), y.detach().clone(), *grads])
        for t in params:
            t.grad = None
    return results


def _site_params(n=4, C=96):
    m = 2 * n + n * n
    g = torch.Generator(device="cuda").manual_seed(7)
    return ((0.02 * torch.randn(m, n * C, device="cuda", generator=g)).requires_grad_(),
            torch.full((3,), 0.3, device="cuda", requires_grad=True),
            (0.1 * torch.randn(m, device="cuda", generator=g)).requires_grad_())


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bias", [("streams", False), ("broadcast", False),
                                         ("streams", True)])
def test_call_sites_replay_the_same_bits(monkeypatch, layout, bias):
    """Calls like the last one on the same parameters run from their call sites: pre's and
    the combine's Python checks and lookups are skipped (never called once the sites exist),
    and every output and gradient equals the Python functions' bit for bit."""
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_combine, triton_pre

    seeds = [0, 1, 2, 3]
    monkeypatch.setattr(native_autograd, "_ENABLED", False)
    want = _site_calls(_site_params(), seeds, layout=layout, bias=bias)
    monkeypatch.setattr(native_autograd, "_ENABLED", True)
    params = _site_params()
    _site_calls(params, [9, 9], layout=layout, bias=bias)  # records; the nodes make the sites
    assert native_autograd.site_of(params[0], (20, 1e-6, None if layout == "broadcast" else 4,
                                               triton_pre.PAPER)) is not None
    slow = []
    for module, name in ((triton_pre, "_pre_operands"), (triton_combine, "_combine_operands")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _o=original, _n=name: slow.append(_n) or _o(*a))
    got = _site_calls(params, seeds, layout=layout, bias=bias)
    assert slow == [], slow  # every call from its sites
    for w_call, g_call in zip(want, got):
        for i, (w, a) in enumerate(zip(w_call, g_call)):
            assert torch.equal(w, a), i


@pytest.mark.gpu
def test_calls_unlike_the_last_miss_their_call_site(monkeypatch):
    """Another token count, a strided x, the launch plans cleared (the kernels' tiles changed):
    the call misses its site and takes the op's Python path (with the same results as the
    Python functions), and a call like it afterwards runs from a new site."""
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_mhc, triton_pre
    from mhc_megatron.kernels.triton_common import PLANS

    params = _site_params()
    monkeypatch.setattr(native_autograd, "_ENABLED", False)
    want = {T: _site_calls(_site_params(), [5], T=T)[0] for T in (37, 40)}
    monkeypatch.setattr(native_autograd, "_ENABLED", True)
    _site_calls(params, [9, 9], T=37)
    slow = []
    original = triton_pre._pre_operands
    monkeypatch.setattr(triton_pre, "_pre_operands", lambda *a: slow.append(1) or original(*a))

    def python_calls(T):
        """pre's Python checks run by one call with T tokens; its results against want's."""
        before = len(slow)
        got = _site_calls(params, [5], T=T)[0]
        assert all(torch.equal(w, a) for w, a in zip(want[T], got))
        return len(slow) - before

    # (want's calls recorded both forward recipes: a miss takes the node path, a new site)
    assert python_calls(40) > 0 and python_calls(40) == 0  # a miss, then its new site
    assert python_calls(37) > 0 and python_calls(37) == 0  # a miss back, then its site
    PLANS.clear()  # (as a change of the kernels' tiles does): the recipes go too
    assert python_calls(37) > 0  # records (the Python function)
    assert python_calls(37) > 0 and python_calls(37) == 0  # the node path, then its site
    x = torch.randn(37, 2 * 4 * 96, device="cuda", dtype=torch.bfloat16)[:, ::2].detach()
    before = len(slow)
    y, *_ = triton_mhc.pre(x.requires_grad_(), *params, 20, 1e-6, n=4)
    assert len(slow) > before and y.grad_fn.name() == "_PreFnBackward"  # (a copy: the function)


# ---- CUDA: the module's calls (pre and the combine in one call into the extension)

def _count_op_paths(monkeypatch) -> dict:
    """Counts of the calls that take the ops' own path (pre's and the combine's C++-node
    entries in Python), by op."""
    from mhc_megatron.kernels import triton_combine, triton_pre

    counts = {"pre": 0, "combine": 0}
    for module, name, op in ((triton_pre, "_pre_native", "pre"),
                             (triton_combine, "_combine_native", "combine")):
        original = getattr(module, name)

        def counted(*args, _original=original, _op=op):
            counts[_op] += 1
            return _original(*args)

        monkeypatch.setattr(module, name, counted)
    return counts


def _model_steps(model, steps: int) -> list:
    """``steps`` training steps of ``model`` on one batch, the default generators seeded the
    same before each (the same dropout masks): loss and every gradient, per step."""
    from helpers import batch, lm_loss

    data = batch(device="cuda", seed=1)
    results = []
    for _ in range(steps):
        torch.manual_seed(3)
        for p in model.parameters():
            p.grad = None
        loss = lm_loss(model, data)
        loss.backward()
        results.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("recompute,dropout,bias", [
    (False, 0.0, False), (True, 0.0, False), (False, 0.1, True), (True, 0.1, False)],
    ids=["plain", "mhc_recompute", "dropout+bias", "mhc_recompute+dropout"])
def test_module_calls_replay_the_same_bits(megatron_single_rank, monkeypatch, recompute,
                                           dropout, bias):
    """A Megatron GPT with mHC (Triton kernels): once a module's pre and combine have
    call sites, every sublayer but global layer 1's first (its streams are a broadcast view,
    which the module's calls leave to the ops) runs them in one call into the extension, the
    ops' Python never called; every loss and gradient equals the steps with the module's calls
    off bit for bit, with and without ``mhc_recompute``, sublayer dropout and linear biases."""
    skip_without_host_replay()
    from helpers import build_gpt, tiny_config

    from mhc_testing.cpu import setup_cpu_megatron

    setup_cpu_megatron(5)
    config = tiny_config(num_layers=3, hidden_size=128, mhc_kernel_backend="triton",
                         hidden_dropout=dropout, add_bias_linear=bias, mhc_recompute=recompute,
                         mhc_recompute_layer_num=2)
    model = build_gpt(config, "cuda")
    monkeypatch.setattr(native_autograd, "_MODULE_CALLS", False)
    want = _model_steps(model, 3)  # records, makes the sites, replays from them
    monkeypatch.setattr(native_autograd, "_MODULE_CALLS", True)
    counts = _count_op_paths(monkeypatch)
    got = _model_steps(model, 2)
    assert counts == {"pre": 2, "combine": 2}, counts  # global layer 1's first sublayer only
    for step in got:
        for i, (w, a) in enumerate(zip(want[-1], step)):
            assert torch.equal(w, a), i


def _module_and_streams(T=24, C=128, n=4):
    from helpers import tiny_config

    from mhc_megatron.layers.hyper_connection import HyperConnectionModule

    config = tiny_config(hidden_size=C, mhc_kernel_backend="triton",
                         params_dtype=torch.bfloat16, bf16=True)
    hc = HyperConnectionModule(config).cuda()
    g = torch.Generator(device="cuda").manual_seed(11)
    streams = torch.randn(T, 1, n * C, device="cuda", dtype=torch.bfloat16, generator=g)
    return hc, streams.requires_grad_()


def _module_sublayer(hc, streams, other=None):
    """The module's pre on ``streams`` and its combine of ``1.25 y`` on ``streams`` (or on
    ``other``, another tensor of the same values), forward and backward: ``(h_res, claimed,
    out, grads)``, ``h_res`` as pre returned it, ``claimed`` whether the combine took the link
    of h_res's C++ pre node (None: no such node), ``grads`` those of the streams, ``other``
    and ``phi``."""
    y, maps = hc.pre(streams)
    x = streams if other is None else other
    out = hc.combine(x, (1.25 * y, None), maps, 0.0, True)
    link = native_autograd.node_link(maps.h_res)
    claimed = None if link is None else link.claimed
    out.backward(torch.ones_like(out))
    grads = [t.grad.clone() for t in (streams, other, hc.phi) if t is not None]
    for t in (streams, other, hc.phi, hc.alpha, hc.bias):
        if t is not None:
            t.grad = None
    return maps.h_res, claimed, out.detach(), grads


@pytest.mark.gpu
@pytest.mark.parametrize("same_x", [True, False], ids=["pre's x", "another x"])
def test_the_module_calls_hand_combines_dx_to_pre_as_the_ops_do(monkeypatch, same_x):
    """The combine called from the module takes the link of the pre node its ``h_res`` comes
    from where its ``x`` is that pre's (the C++ claim, as the ops' DxLink claims); on another
    tensor of the same values it forms its own ``dx``. Either way the results equal the ops'
    path (module calls off) bit for bit."""
    skip_without_host_replay()
    hc, streams = _module_and_streams()
    other = None if same_x else streams.detach().clone().requires_grad_()
    monkeypatch.setattr(native_autograd, "_MODULE_CALLS", False)
    for _ in range(3):
        h_res, claimed, *want = _module_sublayer(hc, streams, other)
    assert getattr(h_res, "_mhc_dx_link", None) is not None and claimed == same_x
    monkeypatch.setattr(native_autograd, "_MODULE_CALLS", True)
    h_res, claimed, *got = _module_sublayer(hc, streams, other)
    assert getattr(h_res, "_mhc_dx_link", None) is None  # (the module's call: no DxLink)
    assert claimed == same_x
    assert torch.equal(want[0], got[0])
    assert len(want[1]) == len(got[1]) and all(torch.equal(w, a)
                                               for w, a in zip(want[1], got[1]))


@pytest.mark.gpu
def test_the_module_calls_record_what_the_ops_path_records(monkeypatch):
    """Inside an ``mhc_recompute`` block (the extension's ranges), a module's pre and combine
    at their site record, in the call, what the ops' path records after its calls: the same
    ops (the aggregate, the combine) with the same keywords, dependencies and arguments (the
    second pre's streams as the block's view of the combine's output; the others kept as
    tensors of the same geometry), and no ``record_as`` call after them."""
    skip_without_host_replay()
    from mhc_megatron.layers import hyper_connection
    from mhc_megatron.recompute import manager as rm

    hc, streams = _module_and_streams()
    for _ in range(3):  # (the sites)
        _module_sublayer(hc, streams)
    after = []
    record_as = hyper_connection.record_as
    monkeypatch.setattr(hyper_connection, "record_as",
                        lambda *a, **k: (after.append(a[1]), record_as(*a, **k)))

    def describe(a):
        if isinstance(a, torch.Tensor):
            return "tensor", tuple(a.shape), a.stride(), a.dtype, a.requires_grad
        return a  # (an _OutputView, None)

    recorded = {}
    for calls in (False, True):
        monkeypatch.setattr(native_autograd, "_MODULE_CALLS", calls)
        after.clear()
        with torch.enable_grad(), rm.MHCRecomputeManager(1).layer_scope(1) as block:
            y, maps = hc.pre(streams)
            out = hc.combine(streams, (1.25 * y, None), maps, 0.0, True)
            hc.pre(out)
        assert block.native and len(after) == (0 if calls else 2), (calls, after)
        recorded[calls] = [(fn, [describe(a) for a in args], kwargs, deps)
                           for fn, args, kwargs, deps in block.ranges.recorded_ops(rm._OutputView)]
    assert len(recorded[True]) == 3 and recorded[True] == recorded[False]
    assert isinstance(recorded[True][2][1][0], rm._OutputView)  # (the combine's output)


@pytest.mark.gpu
def test_the_nodes_storage_is_reused():
    """A freed node's storage goes onto its type's free list (the extension's
    ``NodeStorage``) and the next node of that type takes it: a sublayer's forward takes one
    block from each list, and once its graph is freed the lists hold what they held before."""
    skip_without_host_replay()
    ext = host_replay.extension()
    hc, streams = _module_and_streams()
    for _ in range(3):  # the sites and recipes; nodes made and freed
        _module_sublayer(hc, streams)
    before = ext.node_storage()
    assert min(before) >= 1
    y, maps = hc.pre(streams)
    out = hc.combine(streams, (1.25 * y, None), maps, 0.0, True)
    assert out.grad_fn.name() == "MHCCombineBackward"
    assert maps.h_res.grad_fn.name() == "MHCPreBackward"
    assert ext.node_storage() == (before[0] - 1, before[1] - 1)
    out.backward(torch.ones_like(out))
    del y, maps, out
    assert ext.node_storage() == before


@pytest.mark.gpu
def test_the_module_calls_keep_the_clear_errors():
    """With the call sites made, wrong streams or a wrong sublayer output still get the
    module's errors (the module's call misses its site and the module checks them)."""
    skip_without_host_replay()
    hc, streams = _module_and_streams()
    for _ in range(3):
        _module_sublayer(hc, streams)
    with pytest.raises(ValueError, match=r"residual streams \[s, b, n\*C\].*Fix:"):
        hc.pre(streams[..., :-128])
    y, maps = hc.pre(streams)
    with pytest.raises(ValueError, match=r"sublayer output .* does not match the streams.*Fix:"):
        hc.combine(streams, (y[..., :-1], None), maps, 0.0, True)


# ---- CPU: which calls the module's calls take (a stand-in extension records them)

class _StandInExtension:
    """Records the module's calls into the extension; returns what a replay would."""

    def __init__(self):
        self.calls = []
        self.records = []  # what each call was handed to record in a recompute block

    def pre_fast(self, capsule, x, phi, alpha, bias, mains, params, record):
        self.calls.append(("pre", capsule, mains, params))
        self.records.append(record)
        return ("y", "h_pre", "h_post", "h_res")

    def combine_fast(self, capsule, x, f, f_bias, h_res, h_post, record):
        self.calls.append(("combine", capsule))
        self.records.append(record)
        return "out"


class _StandInSite:
    def capsule(self):
        return "site capsule"


def _stand_in_site(monkeypatch, phi, args, mains=None):
    ext = _StandInExtension()
    monkeypatch.setattr(host_replay, "_extension", ext)
    monkeypatch.setattr(host_replay, "_ENABLED", True)
    monkeypatch.setattr(native_autograd, "_signing_off", lambda: False)  # (as on a GPU host)
    monkeypatch.setattr(native_autograd, "_launch_path_off", lambda: False)
    monkeypatch.setattr(native_autograd, "_SITES", {})
    site = native_autograd._SITES[id(phi)] = native_autograd.CallSite(phi, args, _StandInSite(),
                                                                      mains)
    return ext, site


def test_the_module_calls_take_only_what_their_site_replays(monkeypatch):
    """pre_at_site / combine_at_site call the extension only for a call like the site's: the
    same scalar arguments, no ``main_grad`` buffers on either side, the combine's ``n``, every
    switch on (the module's calls, the nodes, the sites, the replay), no launch hook, trace or
    functorch transform, and the launch plans the site was made from, on the site's ``phi``;
    else None (the module then calls the op)."""
    from mhc_megatron.kernels.triton_common import PLANS

    phi, alpha, bias = (torch.zeros(24, 32, requires_grad=True),
                        torch.zeros(3, requires_grad=True), torch.zeros(24, requires_grad=True))
    x = torch.zeros(2, 32)
    args = (20, 1e-6, 4, "form")
    ext, site = _stand_in_site(monkeypatch, phi, args)

    def pre(a=args, main_grads=False):
        return native_autograd.pre_at_site(x, phi, alpha, bias, a, main_grads)

    assert pre() == ("y", "h_pre", "h_post", "h_res")
    assert ext.calls[-1] == ("pre", "site capsule", None, None)
    assert pre((20, 1e-6, 8, "form")) is None and pre((10, 1e-6, 4, "form")) is None
    assert pre(main_grads=True) is None  # (the site was made without main_grad buffers)
    for switch in ("_MODULE_CALLS", "_ENABLED", "_SITES_ENABLED"):
        monkeypatch.setattr(native_autograd, switch, False)
        assert pre() is None, switch
        monkeypatch.setattr(native_autograd, switch, True)
    monkeypatch.setattr(host_replay, "_ENABLED", False)
    assert pre() is None
    monkeypatch.setattr(host_replay, "_ENABLED", True)
    for name in ("_launch_path_off", "_transforms_active", "_compiling"):  # (hooks, vmap, compile)
        monkeypatch.setattr(native_autograd, name, lambda: True)
        assert pre() is None, name
        monkeypatch.setattr(native_autograd, name, lambda: False)
    assert native_autograd.combine_at_site(x, x, None, x, x, phi, 4) is None  # (no combine yet)
    site.combine_capsule, site.combine_n = "combine capsule", 4
    assert native_autograd.combine_at_site(x, x, None, x, x, phi, 4) == "out"
    assert ext.calls[-1] == ("combine", "combine capsule")
    assert native_autograd.combine_at_site(x, x, None, x, x, phi, None) is None
    monkeypatch.setattr(PLANS, "generation", PLANS.generation + 1)  # (the kernels' tiles moved)
    assert pre() is None and native_autograd.combine_at_site(x, x, None, x, x, phi, 4) is None
    calls = len(ext.calls)
    assert native_autograd.pre_at_site(x, torch.zeros(24, 32), alpha, bias, args, False) is None
    assert len(ext.calls) == calls


def test_the_module_calls_add_to_the_sites_main_grad_buffers_only(monkeypatch):
    """With gradient-accumulation fusion a module's call hands the extension the ``main_grad``
    buffers the site was made with, and the parameters to flag, while they are still the
    parameters' buffers and every parameter needs a gradient; a site made without buffers
    takes no call with the fusion on, and one made with them none with it off."""
    params = (torch.zeros(24, 32, requires_grad=True), torch.zeros(3, requires_grad=True),
              torch.zeros(24, requires_grad=True))
    mains = tuple(torch.zeros(p.shape) for p in params)
    for p, m in zip(params, mains):
        p.main_grad = m
    x, args = torch.zeros(2, 32), (20, 1e-6, 4, "form")
    ext, site = _stand_in_site(monkeypatch, params[0], args, mains)

    def pre(main_grads=True):
        return native_autograd.pre_at_site(x, *params, args, main_grads)

    assert pre() is not None
    _, _, handed, flagged = ext.calls[-1]
    assert all(a is b for a, b in zip(handed, mains)) and len(handed) == 3
    assert flagged == params
    assert pre(main_grads=False) is None
    params[1].requires_grad_(False)
    assert pre() is None
    params[1].requires_grad_(True)
    params[2].main_grad = torch.zeros(24)  # (a new buffer: the site's is not the parameter's)
    assert pre() is None
    params[2].main_grad = mains[2]
    assert pre() is not None


def test_a_module_on_the_reference_backend_never_takes_the_module_calls(monkeypatch):
    """A module whose config says ``mhc_kernel_backend="reference"`` runs the reference even
    where its ``phi`` has a call site (a backend changed after Triton calls)."""
    from helpers import tiny_config

    from mhc_megatron.kernels import dispatch
    from mhc_megatron.layers.hyper_connection import HyperConnectionModule

    hc = HyperConnectionModule(tiny_config(mhc_kernel_backend="reference"))
    n, C = hc.n, hc.hidden_size
    ext, site = _stand_in_site(monkeypatch, hc.phi, (hc.config.mhc_sinkhorn_iterations,
                                                     hc.config.mhc_rms_eps, n, hc.mapping))
    site.combine_capsule, site.combine_n = "combine capsule", n
    monkeypatch.setattr(dispatch, "_triton_ops", dispatch._load_triton_ops())
    streams = torch.randn(3, 2, n * C, requires_grad=True)
    y, maps = hc.pre(streams)
    out = hc.combine(streams, (y, None), maps, 0.0, True)
    assert ext.calls == [] and out.shape == streams.shape
    hc.config.mhc_kernel_backend = "auto"  # (on the CPU: the stand-in's site takes the calls)
    assert hc.pre(streams)[0] == "y" and ext.calls[-1][0] == "pre"


def test_the_module_calls_record_in_the_open_recompute_block(monkeypatch):
    """Inside an ``mhc_recompute`` block with C++ ranges, a module's pre and combine at their
    site hand the extension the block's ranges and the op to record the call as (pre: the
    aggregate; the combine: the combine; with the module's ``n``), recorded in that call, and
    record nothing after it; with the Python ranges they hand none and ``record_as`` records
    each call after it returns; outside a block, nothing is recorded."""
    from helpers import tiny_config

    from mhc_megatron.kernels import dispatch
    from mhc_megatron.layers import hyper_connection
    from mhc_megatron.layers.hyper_connection import HyperConnectionModule
    from mhc_megatron.recompute import manager as rm

    hc = HyperConnectionModule(tiny_config(mhc_kernel_backend="auto"))  # (the stand-in's site)
    n, C = hc.n, hc.hidden_size
    ext, site = _stand_in_site(monkeypatch, hc.phi, (hc.config.mhc_sinkhorn_iterations,
                                                     hc.config.mhc_rms_eps, n, hc.mapping))
    site.combine_capsule, site.combine_n = "combine capsule", n
    monkeypatch.setattr(dispatch, "_triton_ops", dispatch._load_triton_ops())
    ops = dispatch._triton_ops
    after = []
    monkeypatch.setattr(hyper_connection, "record_as", lambda out, fn, *a, **k: after.append(fn))
    streams = torch.randn(3, 2, n * C, requires_grad=True)

    def sublayer():
        y, maps = hc.pre(streams)
        hc.combine(streams, (torch.zeros(3, 2, C), None), maps, 0.0, True)

    sublayer()  # (no block)
    assert ext.records == [None, None] and after == []

    class CppRanges:  # (a stand-in for the extension's SavedRanges: not the Python ranges)
        def __init__(self, block_ref):
            self.pack = None

    manager = rm.MHCRecomputeManager(1)
    for ranges, native in ((CppRanges, True), (rm._AddressRanges, False)):
        monkeypatch.setattr(rm, "_hooks", lambda ranges=ranges: (ranges, lambda obj: obj))
        ext.records.clear()
        manager.reset()
        with torch.enable_grad(), manager.layer_scope(1) as block:
            sublayer()
        assert block.native is native
        if native:
            assert [(r[0], r[1], r[2]) for r in ext.records] == [
                (block.ranges, ops.aggregate, {"n": n}), (block.ranges, ops.combine, {"n": n})]
            assert after == []
        else:
            assert ext.records == [None, None] and after == [ops.aggregate, ops.combine]

