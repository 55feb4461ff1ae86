"""The ops' host work replayed from C++ (mhc_megatron.kernels.host_replay).

CPU: the recording of an op call against stand-in kernels: every kernel parameter resolved to
an input, a scratch tensor, an allocation or a constant, constexprs left out, the trailing
scratch pointers added; interpreting the recipe gives back the recorded launches' arguments;
anything the replay could not reproduce (an undeclared tensor, Triton's own launcher, a
returned input) registers no recipe; a failed build keeps the Python path and says why. CUDA: the four ops and a sublayer chained through
autograd give the same bits replayed as on the Python path, in every variant the ops have
(the combine's dx folded into pre's backward or not, ``dH_pre`` given, broadcast streams, a
sublayer bias, gradient-accumulation fusion), and the replay runs (recipes registered);
replayed ops under CUDA graph capture are tested in tests/test_native_autograd.py.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch
from helpers import (SUBLAYER_VARIANTS, skip_without_host_replay, sublayer_inputs,
                     sublayer_ops_case)

from mhc_megatron.kernels import host_replay, launch
from mhc_megatron.kernels.launch import Launcher

CUDA = torch.cuda.is_available()


class _FakeExtension:
    """Stands in for the built extension: keeps what add_recipe was given."""

    def __init__(self):
        self.recipes = []

    def add_recipe(self, *args):
        self.recipes.append(args)
        return len(self.recipes) - 1


def _stand_in_launch(monkeypatch, names, signature):
    """A launcher whose compiled kernel has ``signature`` ({name: type}), and its cache entry."""
    launcher = Launcher.__new__(Launcher)
    launcher.fn, launcher.param_names, launcher._cache = None, tuple(names), {}
    kernel = SimpleNamespace(
        function=0xABC, src=SimpleNamespace(signature=signature),
        metadata=SimpleNamespace(num_warps=4, shared=1024, num_ctas=1),
        run=SimpleNamespace(global_scratch_size=0, profile_scratch_size=0))
    entry = (None, (), (8,))  # (launch, prefix, the constexpr tail: BLOCK=8)
    monkeypatch.setitem(launch._KERNELS, id(entry), kernel)
    return launcher, entry


@pytest.fixture
def fake_extension(monkeypatch):
    ext = _FakeExtension()
    monkeypatch.setattr(host_replay, "_extension", ext)
    monkeypatch.setattr(launch, "_triton_version", lambda: (3, 6))
    monkeypatch.setattr(host_replay, "_param_count", lambda function: None)
    monkeypatch.setattr(host_replay, "_NATIVE", {})  # (stand-in entries' ids are reused)
    return ext


def _interpret(recipe, inputs, scratch, allocated):
    """The arguments each launch of ``recipe`` passes, as the C++ replay forms them."""
    _, _, sizes, dtypes, group, offset, group_bytes, returned, geometry, kinds, values = recipe
    out = []
    for k_list, v_list in zip(kinds, values):
        args = []
        for k, v in zip(k_list, v_list):
            args.append({host_replay.INPUT: lambda: inputs[v].data_ptr(),
                         host_replay.SCRATCH: lambda: scratch[v].data_ptr(),
                         host_replay.ALLOCATED: lambda: allocated[v].data_ptr(),
                         host_replay.I32: lambda: v, host_replay.I64: lambda: v,
                         host_replay.F32: lambda: struct.unpack("<f", struct.pack("<I", v))[0],
                         host_replay.NULLPTR: lambda: 0}[k]())
        out.append(args)
    return out


def test_recording_resolves_every_parameter(fake_extension, monkeypatch):
    names = ("x", "w", "part", "out", "tmp", "T", "eps", "n64", "BLOCK")
    sig = {"x": "*bf16", "w": "*fp32", "part": "*fp32", "out": "*bf16", "tmp": "*fp32",
           "T": "i32", "eps": "fp32", "n64": "i64", "BLOCK": "constexpr"}
    launcher, entry = _stand_in_launch(monkeypatch, names, sig)
    x, w = torch.randn(6, 4).bfloat16(), torch.randn(3)
    part = torch.empty(5)
    out, tmp = torch.empty(6, 4, dtype=torch.bfloat16), torch.empty(2, 3)
    recorder = host_replay._Recorder((x, w), (part,))
    with recorder.active():
        launch._report(launcher, entry, (3, 2), (x, w, part, out, tmp, 6, 1e-6, 2**40))
        launch._report(launcher, entry, (1,), (out, w, part, out, tmp, 1, 0.5, 7))
    recipe = recorder.register((out,), (tmp,), device=0)
    assert recipe is not None and recipe.rid == 0
    (n_in, n_scratch, sizes, dtypes, group, offset, group_bytes, returned, geometry, kinds,
     values) = fake_extension.recipes[0]
    assert (n_in, n_scratch) == (2, 1)
    assert sizes == [[6, 4], [2, 3]] and dtypes == [15, 6] and returned == [0]
    assert group == [-1, -1] and group_bytes == []  # each its own allocation
    assert geometry == [[0xABC, 3, 2, 1, 128, 1024], [0xABC, 1, 1, 1, 128, 1024]]
    # 8 runtime arguments (BLOCK is compiled in) and triton 3.6's two scratch pointers
    assert all(len(k) == 10 and k[-2:] == [host_replay.NULLPTR] * 2 for k in kinds)
    assert kinds[0][:8] == [host_replay.INPUT, host_replay.INPUT, host_replay.SCRATCH,
                            host_replay.ALLOCATED, host_replay.ALLOCATED, host_replay.I32,
                            host_replay.F32, host_replay.I64]
    # interpreted with other tensors of the same roles, the recipe passes those tensors
    x2, w2, part2 = x.clone(), w.clone(), part.clone()
    out2, tmp2 = torch.empty_like(out), torch.empty_like(tmp)
    got = _interpret(fake_extension.recipes[0], (x2, w2), (part2,), (out2, tmp2))
    f32 = struct.unpack("<f", struct.pack("<f", 1e-6))[0]
    assert got[0] == [x2.data_ptr(), w2.data_ptr(), part2.data_ptr(), out2.data_ptr(),
                      tmp2.data_ptr(), 6, f32, 2**40, 0, 0]
    assert got[1] == [out2.data_ptr(), w2.data_ptr(), part2.data_ptr(), out2.data_ptr(),
                      tmp2.data_ptr(), 1, 0.5, 7, 0, 0]


def test_shared_tensors_get_aligned_offsets_in_one_allocation(fake_extension, monkeypatch):
    """``shared`` returned tensors: one allocation, each at a 256-byte aligned offset that
    holds it whole; the others keep allocations of their own."""
    launcher, entry = _stand_in_launch(monkeypatch, ("a", "b", "c", "d"),
                                       {"a": "*fp32", "b": "*fp32", "c": "*bf16", "d": "*fp32"})
    a, b = torch.empty(5, 4), torch.empty(3)  # 80 and 12 bytes
    c, d = torch.empty(7, dtype=torch.bfloat16), torch.empty(100)  # 14 and 400 bytes
    recorder = host_replay._Recorder((), ())
    with recorder.active():
        launch._report(launcher, entry, (1,), (a, b, c, d))
    assert recorder.register((c, a, b, d), (), device=0, shared=(1, 2, 3)) is not None
    _, _, sizes, _, group, offset, group_bytes, returned, *_ = fake_extension.recipes[0]
    assert returned == [0, 1, 2, 3] and sizes == [[7], [5, 4], [3], [100]]
    assert group == [-1, 0, 0, 0] and offset == [0, 0, 256, 512] and group_bytes == [1024]


@pytest.mark.parametrize("case", ["undeclared tensor", "triton's launcher", "returned input",
                                  "no launch", "unknown type"])
def test_what_a_replay_could_not_reproduce_registers_nothing(fake_extension, monkeypatch, case):
    sig = {"x": "*fp32", "out": "*fp32", "T": "bf16" if case == "unknown type" else "i32"}
    launcher, entry = _stand_in_launch(monkeypatch, ("x", "out", "T"), sig)
    x, out, copy = torch.randn(4), torch.empty(4), torch.randn(4)
    recorder = host_replay._Recorder((x,), ())
    with recorder.active():
        if case == "undeclared tensor":  # e.g. a copy the op made of an input
            launch._report(launcher, entry, (1,), (copy, out, 4))
        elif case == "triton's launcher":
            launch._report(launcher, None, (1,), (x, out, 4))
        elif case != "no launch":
            launch._report(launcher, entry, (1,), (x, out, 4))
    returned = (x,) if case == "returned input" else (out,)
    assert recorder.register(returned, (), device=0) is None
    assert fake_extension.recipes == []


def test_a_recorder_hears_only_its_own_thread(fake_extension, monkeypatch):
    import threading

    launcher, entry = _stand_in_launch(monkeypatch, ("x", "out", "T"),
                                       {"x": "*fp32", "out": "*fp32", "T": "i32"})
    x, out, other = torch.randn(4), torch.empty(4), torch.empty(4)
    recorder = host_replay._Recorder((x,), ())
    with recorder.active():
        thread = threading.Thread(target=launch._report,
                                  args=(launcher, entry, (1,), (other, other, 9)))
        thread.start()
        thread.join()
        launch._report(launcher, entry, (1,), (x, out, 4))
    assert len(recorder.launches) == 1 and not launch._recorders
    assert recorder.register((out,), (), device=0) is not None


def test_run_takes_the_python_path_where_nothing_replays(monkeypatch):
    """No signature (the direct launch path off), or replay off: the Python call, no recipe."""
    plan = SimpleNamespace(recipes={})
    calls = []

    def python():
        calls.append(1)
        return ("returned",), ()

    assert host_replay.run(plan, (None,), (), (), python) == ("returned",)
    monkeypatch.setattr(host_replay, "_ENABLED", False)
    assert host_replay.run(plan, ((0, torch.float32),), (), (), python) == ("returned",)
    assert calls == [1, 1] and plan.recipes == {}


def test_a_failed_build_keeps_the_python_path_and_says_why(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\n(pages of output)")

    monkeypatch.setattr(host_replay, "_extension", None)
    monkeypatch.setattr(host_replay, "_unavailable", None)
    monkeypatch.setattr(launch, "fast_launch_supported", lambda: None)
    monkeypatch.setattr(launch, "_triton_version", lambda: (3, 6))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert host_replay.unavailable() == ("the extension did not build (RuntimeError: Ninja is "
                                         "required to load C++ extensions)")
    plan = SimpleNamespace(recipes={})
    assert host_replay.run(plan, ((0, torch.float32),), (), (), lambda: (("py",), ())) == ("py",)
    assert plan.recipes == {}
    monkeypatch.setattr(host_replay, "_unavailable", None)
    monkeypatch.setattr(host_replay, "_ENABLED", False)
    assert host_replay.unavailable() == "MHC_HOST_REPLAY=0"


def test_the_extension_sources_ship_with_the_package():
    """The replay's and the autograd nodes' C++ sources are package data."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["mhc_megatron.kernels"]
    csrc = Path(host_replay.__file__).parent / "csrc"
    for name in (*host_replay._SOURCES, "host_replay.h"):
        assert (csrc / name).is_file(), name
        assert any(fnmatch.fnmatch(f"csrc/{name}", p) for p in patterns), (name, patterns)


# ---- CUDA: the replay against the Python path, bit for bit

@pytest.mark.gpu
@pytest.mark.parametrize("variant", SUBLAYER_VARIANTS)
def test_replay_equals_the_python_path(monkeypatch, variant):
    skip_without_host_replay()
    from mhc_megatron.kernels.triton_common import PLANS

    monkeypatch.setattr(host_replay, "_ENABLED", False)
    want = sublayer_ops_case(variant)[0]
    monkeypatch.setattr(host_replay, "_ENABLED", True)
    PLANS.clear()  # record afresh
    recorded = sublayer_ops_case(variant)[0]  # records (the Python path)
    replayed = sublayer_ops_case(variant)[0]  # replays
    again = sublayer_ops_case(variant, seed=1)[0]
    monkeypatch.setattr(host_replay, "_ENABLED", False)
    want_again = sublayer_ops_case(variant, seed=1)[0]
    for w, a, b in zip(want, recorded, replayed):
        assert torch.equal(w, a) and torch.equal(w, b)
    for w, b in zip(want_again, again):
        assert torch.equal(w, b)
    recipes = [r for p in PLANS.values() for r in getattr(p, "recipes", {}).values()]
    # pre forward, pre backward, combine forward, combine backward: all replayed
    assert len(recipes) == 4 and all(isinstance(r, host_replay.Recipe) for r in recipes), recipes


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["streams", "broadcast"])
def test_the_recompute_replays_equal_the_python_path(monkeypatch, layout):
    """mhc_recompute's two ops (the aggregate alone, and a combine fused with the next
    aggregate), replayed: the same bits as on the Python path, and their recipes registered."""
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_mhc
    from mhc_megatron.kernels.triton_common import PLANS
    from mhc_megatron.layers.streams import broadcast_streams

    T, C, n = 53, 80, 4

    def ops(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        h = torch.randn(T, 1, C, device="cuda", dtype=torch.bfloat16, generator=g)
        x, n_arg = ((broadcast_streams(h, n).view(T, n, C), None) if layout == "broadcast"
                    else (torch.randn(T, n * C, device="cuda", dtype=torch.bfloat16,
                                      generator=g), n))
        f = torch.randn(T, C, device="cuda", dtype=torch.bfloat16, generator=g)
        h_pre, h_post = (torch.rand(T, n, device="cuda", generator=g) for _ in range(2))
        h_res = torch.rand(T, n, n, device="cuda", generator=g)
        with torch.no_grad():
            y = triton_mhc.aggregate(x, h_pre, n=n_arg)
            out, y_next = triton_mhc.combine_aggregate(x, f, None, h_res, h_post, h_pre, n=n_arg)
        return [t.clone() for t in (y, out, y_next)]

    monkeypatch.setattr(host_replay, "_ENABLED", False)
    want = [ops(0), ops(1)]
    monkeypatch.setattr(host_replay, "_ENABLED", True)
    PLANS.clear()
    got = [ops(0), ops(0), ops(1)]  # records, then replays
    for w, g in zip([want[0], want[0], want[1]], got):
        assert all(torch.equal(a, b) for a, b in zip(w, g))
    recipes = [r for p in PLANS.values() for r in getattr(p, "recipes", {}).values()]
    assert len(recipes) == 2 and all(isinstance(r, host_replay.Recipe) for r in recipes)


@pytest.mark.gpu
def test_replayed_mappings_share_one_allocation():
    """pre's fp32 outputs replayed share one allocation and are tensors of their own (no view
    of each other), at offsets that do not overlap; the y they come with has its own."""
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_mhc

    n = 4
    x, phi, alpha, bias = sublayer_inputs(40, 64, n)
    for _ in range(3):  # records, then replays
        y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
        out = triton_mhc.combine(x, y, None, h_res, h_post, n=n)
    maps = (h_pre, h_post, h_res)
    base = h_pre.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base and t._base is None for t in maps)
    assert y.untyped_storage().data_ptr() != base
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in maps)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(t.data_ptr() % 256 == 0 and t.is_contiguous() for t in maps)
    out.float().sum().backward()  # the grads flow as from separate allocations
    assert all(torch.isfinite(t.grad).all() for t in (x, phi, alpha, bias))


@pytest.mark.gpu
def test_replayed_parameter_gradients_share_one_allocation(monkeypatch):
    """pre backward's parameter gradients replayed share one allocation, each a tensor of its
    own at a 256-byte aligned offset that does not overlap the others, apart from dx's; bit
    for bit the gradients of the Python path (the replay off: each its own allocation), and
    accumulated in ``.grad`` as separate gradients."""
    skip_without_host_replay()
    from mhc_megatron.kernels import triton_mhc

    n = 4
    x, phi, alpha, bias = sublayer_inputs(40, 64, n)

    def step():
        for t in (x, phi, alpha, bias):
            t.grad = None
        y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
        triton_mhc.combine(x, y, None, h_res, h_post, n=n).float().square().sum().backward()
        return tuple(t.grad for t in (x, phi, alpha, bias))

    monkeypatch.setattr(host_replay, "_ENABLED", False)
    python = step()
    assert len({t.untyped_storage().data_ptr() for t in python}) == 4
    monkeypatch.setattr(host_replay, "_ENABLED", True)
    for _ in range(3):  # records the forward and backward, then replays them
        replayed = step()
        assert all(torch.equal(a, b) for a, b in zip(replayed, python))
    dx, dphi, dalpha, dbias = replayed
    params = (dphi, dalpha, dbias)
    base = dphi.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base and t._base is None for t in params)
    assert dx.untyped_storage().data_ptr() != base
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in params)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(t.data_ptr() % 256 == 0 and t.is_contiguous() for t in params)
    # a second backward accumulates into them: each its own sum
    y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
    triton_mhc.combine(x, y, None, h_res, h_post, n=n).float().square().sum().backward()
    for t, first in zip((phi, alpha, bias), python[1:]):
        assert torch.equal(t.grad, first + first)


@pytest.mark.gpu
def test_one_stream_as_tokens_and_as_streams_keeps_each_layout():
    """At n=1 the tokens ``[T, 1, C]`` and the streams ``[T, 1, 1*C]`` (``n=1`` given) have one
    shape but y's differ (``[T, C]`` and ``[T, 1, C]``): each replays its own recipe, for pre,
    the aggregate and the recompute's combine + aggregate, with the values of the reference."""
    skip_without_host_replay()
    from mhc_megatron.kernels import reference, triton_mhc

    T, C = 24, 64
    x, phi, alpha, bias = sublayer_inputs(T, C, 1)
    x = x.detach().view(T, 1, C).requires_grad_()
    f = torch.randn(T, 1, C, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # records, then replays, alternating the layouts
        for n, y_shape in ((None, (T, C)), (1, (T, 1, C))):
            y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
            want = reference.pre(x.detach().float(), phi, alpha, bias, 20, 1e-6)[0]
            assert y.shape == y_shape
            torch.testing.assert_close(y.float().view(T, C), want, atol=2e-2, rtol=2e-2)
            with torch.no_grad():
                assert triton_mhc.aggregate(x, h_pre, n=n).shape == y_shape
                f_n = f.view(T, C) if n is None else f
                out, y_next = triton_mhc.combine_aggregate(x, f_n, None, h_res, h_post, h_pre,
                                                           n=n)
            assert out.shape == x.shape and y_next.shape == y_shape
