"""The direct launch path of the Triton kernels (mhc_megatron.kernels.launch).

CPU: the key, the host helpers, when the path is off, and the launcher's logic against a
stand-in kernel (first launch through Triton's launcher, later ones through the compiled
kernel's, arguments in order). CUDA: the real kernels give the same bits through either
path, and an argument that Triton specialises differently (a misaligned tensor) gets its own
compiled kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from mhc_megatron.kernels import launch
from mhc_megatron.kernels.launch import Launcher, Meta, cdiv, next_pow2

CUDA = torch.cuda.is_available()


def test_host_helpers_match_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 1000):
            assert cdiv(a, b) == math.ceil(a / b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n)


def _arg_key(a):
    """The launch key's part for one positional argument."""
    return launch._launch_key(0, None, (a,))[2]


def test_key_is_as_fine_as_tritons_specialisation():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) == (torch.float32, True)
    assert _arg_key(base[1:]) == (torch.float32, False)  # 4 bytes off: not 16-byte aligned
    assert _arg_key(base.to(torch.bfloat16)) != _arg_key(base)
    assert _arg_key(torch.nn.Parameter(base)) == _arg_key(base)  # a parameter is a tensor
    # every int Triton specialises apart (==1, divisible by 16 or not, i32 / i64 / u64) has
    # a key of its own: ints are keyed by value
    values = (0, 1, 2, 16, 17, 32, 2**31 - 16, 2**31, 2**63)
    assert len({_arg_key(v) for v in values}) == len(values)
    assert _arg_key(True) != _arg_key(1) and _arg_key(1.0) != _arg_key(1)  # equal, not alike
    assert _arg_key(1.5) == (float, 1.5) and _arg_key(None) == (type(None), None)
    key = launch._launch_key(0, Meta(N=4), (base, base[1:], 64, 1e-6, None))
    assert key == (0, Meta(N=4), (torch.float32, True), (torch.float32, False), (int, 64),
                   (float, 1e-6), (type(None), None))


def test_meta_hashes_by_value():
    a, b = Meta(N=4, BT=8, num_warps=4), Meta(N=4, BT=8, num_warps=4)
    assert a == b and hash(a) == hash(b) and a != Meta(N=4, BT=16, num_warps=4)
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("env,value,why", [
    ("MHC_TRITON_FAST_LAUNCH", "0", "MHC_TRITON_FAST_LAUNCH=0"),
    ("TRITON_INTERPRET", "1", "TRITON_INTERPRET=1"),
])
def test_fast_path_off_reasons(monkeypatch, env, value, why):
    monkeypatch.delenv("MHC_TRITON_FAST_LAUNCH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(env, value)
    assert launch.fast_launch_supported() == why


def test_fast_path_off_for_untested_triton(monkeypatch):
    monkeypatch.delenv("MHC_TRITON_FAST_LAUNCH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton, "__version__", "9.1.0")
    assert "triton 9.1.0" in launch.fast_launch_supported()


class _FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args):
        self.log.append(("direct", args))


class _FakeJit:
    """Stands in for a JITFunction: ``fn[grid](*args, **kw)`` records and returns a kernel."""

    arg_names = ["x_ptr", "T", "N", "BT"]
    pre_run_hooks = []

    def __init__(self):
        self.log = []
        self.compiled = _FakeCompiled(self.log)

    def __getitem__(self, grid):
        def launch_it(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            return self.compiled
        return launch_it


@pytest.fixture
def fast_path_on(monkeypatch):
    monkeypatch.setattr(Launcher, "_disabled", None)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 77, raising=False)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)


def test_launcher_first_launch_then_direct(fast_path_on):
    fn = _FakeJit()
    run = Launcher(fn)
    meta = Meta(N=4, BT=8, num_warps=4)
    x = torch.zeros(32)
    run((3, 2), meta, x, 64)
    assert fn.log[-1] == ("triton", (3, 2), (x, 64), {"N": 4, "BT": 8, "num_warps": 4})
    run((5,), meta, x, 64)
    kind, args = fn.log[-1]
    # grid padded to 3 dims, current stream, no launch metadata or hooks, then every
    # parameter in order: the positional ones and the constexprs named in meta
    assert kind == "direct" and args == (5, 1, 1, 77, "fn", "meta", None, None, None, x, 64, 4, 8)
    run((5,), meta, x[1:], 64)  # misaligned: a key of its own, Triton's launcher first
    assert fn.log[-1][0] == "triton"
    run((5,), meta, x, 63)  # 63 is not divisible by 16: another key
    assert fn.log[-1][0] == "triton"
    run((5,), Meta(N=4, BT=16, num_warps=4), x, 64)  # other constexprs: another key
    assert fn.log[-1][0] == "triton"
    assert run.cached_kernels() == 4


def test_launcher_keeps_tritons_path_for_hooks_and_defaults(fast_path_on, monkeypatch):
    fn = _FakeJit()
    run = Launcher(fn)
    x = torch.zeros(32)
    run((1,), Meta(N=4, num_warps=4), x, 64)  # BT left to its default: never cached
    run((1,), Meta(N=4, num_warps=4), x, 64)
    assert [e[0] for e in fn.log] == ["triton", "triton"] and run.cached_kernels() == 0
    meta = Meta(N=4, BT=8)
    run((1,), meta, x, 64)
    run((1,), meta, x, 64)
    assert fn.log[-1][0] == "direct"
    chain = triton.knobs.HookChain()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    run((1,), meta, x, 64)  # triton's default: an empty chain, nothing to call
    assert fn.log[-1][0] == "direct"
    chain.add(lambda md: None)  # a profiler's hook: Triton's launcher calls it
    run((1,), meta, x, 64)
    assert fn.log[-1][0] == "triton"
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", lambda md: None)
    chain.calls.clear()
    run((1,), meta, x, 64)
    assert fn.log[-1][0] == "triton"


def test_unhashable_argument_takes_tritons_launcher(fast_path_on):
    fn = _FakeJit()
    run = Launcher(fn)
    meta = Meta(N=4, BT=8)
    for _ in range(2):
        run((1,), meta, torch.zeros(4), [3])
    assert [e[0] for e in fn.log] == ["triton", "triton"] and run.cached_kernels() == 0


class _Triton36Run:
    """Stands in for triton 3.6's CudaLauncher: the compiled module's C ``launch`` and the
    attributes its ``__call__`` passes on."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, log, scratch=0):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, scratch, 0

    def launch(self, *args):
        self.log.append(("c", args))

    def __call__(self, *args):
        self.log.append(("wrapper", args))


@pytest.mark.parametrize("scratch", [0, 256])
def test_direct_c_launch_on_triton_3_6(fast_path_on, monkeypatch, scratch):
    """triton 3.6, a kernel without scratch memory: its C launcher with what triton's wrapper
    would pass (cooperative grid, PDL, no scratch, the packed metadata, no launch metadata,
    no hooks); with scratch memory to allocate: the wrapper."""
    fn = _FakeJit()
    fn.compiled.run = _Triton36Run(fn.log, scratch)
    monkeypatch.setattr(launch, "_triton_version", lambda: (3, 6))
    run = Launcher(fn)
    meta, x = Meta(N=4, BT=8), torch.zeros(32)
    run((2,), meta, x, 64)
    run((2,), meta, x, 64)
    if scratch:
        assert fn.log[-1] == ("wrapper", (2, 1, 1, 77, "fn", "meta", None, None, None, x, 64,
                                          4, 8))
    else:
        assert fn.log[-1] == ("c", (2, 1, 1, 77, "fn", False, True, None, None, "meta", None,
                                    None, None, x, 64, 4, 8))


def test_signed_launch_keys_by_the_plan_and_signature(fast_path_on, monkeypatch):
    """A launch by signature takes Triton's launcher the first time, then the compiled
    kernel from the plan's table, without building the per-argument key; a signature names
    one entry per (launcher, meta)."""
    monkeypatch.setattr(launch, "CHECK_SIGNATURES", False)
    fn = _FakeJit()
    run = Launcher(fn)
    plan, meta, x = launch.LaunchPlan(), Meta(N=4, BT=8, num_warps=4), torch.zeros(32)
    sig = launch.signature(x, extra=(20,))
    assert sig == (0, torch.float32, 20)
    run.signed(plan, sig, (3,), meta, x, 64)
    assert fn.log[-1][0] == "triton" and list(plan.launches) == [(run, meta, sig)]

    def no_key(*args):
        raise AssertionError("the per-argument key was built")

    monkeypatch.setattr(launch, "_launch_key", no_key)
    run.signed(plan, sig, (5,), meta, x, 64)
    assert fn.log[-1] == ("direct", (5, 1, 1, 77, "fn", "meta", None, None, None, x, 64, 4, 8))
    with pytest.raises(AssertionError, match="per-argument key"):
        run.signed(plan, None, (5,), meta, x, 64)  # no signature: keyed by argument


def test_signature_is_none_where_arguments_must_be_keyed(fast_path_on, monkeypatch):
    """No signature for a misaligned tensor, with the direct path off, under torch.compile's
    tracing or with a launch hook set: those launches go through the per-argument key or
    Triton's own launcher."""
    x = torch.zeros(64)
    assert launch.signature(x, x.to(torch.bfloat16)) == (0, torch.float32, torch.bfloat16)
    assert launch.signature(x, x[1:]) is None  # 4 bytes off a 16-byte boundary
    monkeypatch.setattr(launch, "_compiling", lambda: True)
    assert launch.signature(x) is None
    monkeypatch.setattr(launch, "_compiling", lambda: False)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert launch.signature(x) is None
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(Launcher, "_disabled", "off for this test")
    assert launch.signature(x) is None


def test_signature_check_catches_a_signature_that_misses_an_argument(fast_path_on,
                                                                      monkeypatch):
    """With MHC_CHECK_LAUNCH_SIGNATURES=1 (the tests' setting) every signed launch also takes
    the per-argument key: a signature that maps arguments Triton specialises apart (here 64
    and 63, divisible by 16 or not) to one kernel raises instead of launching the wrong one."""
    monkeypatch.setattr(launch, "CHECK_SIGNATURES", True)
    fn = _FakeJit()
    run = Launcher(fn)
    plan, meta, x = launch.LaunchPlan(), Meta(N=4, BT=8), torch.zeros(32)
    run.signed(plan, ("sig",), (1,), meta, x, 64)
    run.signed(plan, ("sig",), (1,), meta, x, 64)  # the same kernel either way
    with pytest.raises(AssertionError, match="misses an argument"):
        run.signed(plan, ("sig",), (1,), meta, x, 63)


def test_launcher_off_delegates(monkeypatch):
    monkeypatch.setattr(Launcher, "_disabled", "off for this test")
    fn = _FakeJit()
    Launcher(fn)((2,), Meta(N=4, BT=8), torch.zeros(4), 3)
    assert fn.log == [("triton", (2,), (fn.log[0][2][0], 3), {"N": 4, "BT": 8})]


def _sublayer(seed, x_offset=0, n=4, c=96, t=37):
    """pre + combine forward and backward on CUDA: outputs and every gradient."""
    from mhc_megatron.kernels import triton_mhc

    g = torch.Generator(device="cuda").manual_seed(seed)
    m = 2 * n + n * n
    data = torch.randn(t * n * c, device="cuda", dtype=torch.bfloat16, generator=g)
    buffer = torch.empty(t * n * c + x_offset, device="cuda", dtype=torch.bfloat16)
    buffer[x_offset:].copy_(data)
    x = buffer[x_offset:].view(t, n, c).requires_grad_()
    phi = (0.02 * torch.randn(m, n * c, device="cuda", generator=g)).requires_grad_()
    alpha = torch.full((3,), 0.5, device="cuda", requires_grad=True)
    bias = (0.1 * torch.randn(m, device="cuda", generator=g)).requires_grad_()
    y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6)
    out = triton_mhc.combine(x, y * 1.5, None, h_res, h_post)
    out.float().square().sum().backward()
    with torch.no_grad():  # the aggregate's own kernel (pre forms y in its mapping kernel here)
        again = triton_mhc.aggregate(x, h_pre)
    return [t.detach().clone() for t in (y, h_pre, h_post, h_res, out, x.grad, phi.grad,
                                         alpha.grad, bias.grad, again)]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled Triton kernels)")
def test_direct_launch_equals_tritons_launcher(monkeypatch):
    from mhc_megatron.kernels import triton_combine, triton_pre_bwd, triton_pre_fwd

    if launch.fast_launch_supported() is not None:
        pytest.skip(f"direct launch is off here: {launch.fast_launch_supported()}")
    monkeypatch.setattr(Launcher, "_disabled", "Triton's launcher for the reference run")
    want = _sublayer(0)
    monkeypatch.setattr(Launcher, "_disabled", None)
    first = _sublayer(0)  # may compile / fill the cache
    again = _sublayer(0)  # through the compiled kernels' launchers
    monkeypatch.setattr(launch, "CHECK_SIGNATURES", False)
    signed = _sublayer(0)  # the launches by signature, as outside the tests
    for w, a, b, s in zip(want, first, again, signed):
        assert torch.equal(w, a) and torch.equal(w, b) and torch.equal(w, s)
    launchers = [v for mod in (triton_pre_fwd, triton_pre_bwd, triton_combine)
                 for v in vars(mod).values() if isinstance(v, Launcher)]
    assert len(launchers) == 9 and all(r.cached_kernels() > 0 for r in launchers)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled Triton kernels)")
def test_misaligned_input_gets_its_own_kernel(monkeypatch):
    """A misaligned x is specialised differently by Triton; the direct path must not reuse
    the aligned kernel for it: its results equal Triton's own launcher's, bit for bit (the
    two specialisations may differ from each other in the last bit)."""
    from mhc_megatron.kernels import triton_pre_fwd

    if launch.fast_launch_supported() is not None:
        pytest.skip(f"direct launch is off here: {launch.fast_launch_supported()}")
    monkeypatch.setattr(Launcher, "_disabled", "Triton's launcher for the reference run")
    want = _sublayer(1, x_offset=1)  # x's address 2 bytes past a 16-byte boundary
    monkeypatch.setattr(Launcher, "_disabled", None)
    aligned = _sublayer(1)
    _sublayer(1)  # the aligned key cached and used
    cached = triton_pre_fwd._PROJ.cached_kernels()
    first = _sublayer(1, x_offset=1)
    assert triton_pre_fwd._PROJ.cached_kernels() == cached + 1
    again = _sublayer(1, x_offset=1)
    for w, a, b, c in zip(want, first, again, aligned):
        assert torch.equal(w, a) and torch.equal(w, b)
        torch.testing.assert_close(c.float(), w.float(), rtol=1e-2, atol=1e-4)


def test_launch_plans_are_cached_and_follow_the_tiles():
    """Launch shapes are computed once per shape; setting a ``TILES`` field (the tuner does)
    drops them, so the next call uses the new tiles."""
    from mhc_megatron.kernels import triton_common
    from mhc_megatron.kernels.triton_pre_fwd import _AggregatePlan

    first = triton_common.plan(_AggregatePlan, 64, 4, 1024, False)
    assert triton_common.plan(_AggregatePlan, 64, 4, 1024, False) is first
    old = triton_common.TILES.sweep
    try:
        triton_common.TILES.sweep = (16, 512, 4)
        again = triton_common.plan(_AggregatePlan, 64, 4, 1024, False)
        assert again is not first and again.meta.kwargs["BT"] == 16
        assert again.grid == (cdiv(64, 16) * cdiv(1024, 128),)
    finally:
        triton_common.TILES.sweep = old
    assert triton_common.plan(_AggregatePlan, 64, 4, 1024, False).meta == first.meta


def test_launcher_leaves_tracing_to_tritons_launch_form(fast_path_on, monkeypatch):
    """Under torch.compile's tracing the launch keeps Triton's ``kernel[grid](...)`` form,
    which dynamo understands."""
    fn = _FakeJit()
    run = Launcher(fn)
    meta, x = Meta(N=4, BT=8), torch.zeros(32)
    run((1,), meta, x, 64)
    monkeypatch.setattr(launch, "_compiling", lambda: True)
    run((1,), meta, x, 64)
    assert [e[0] for e in fn.log] == ["triton", "triton"]
    monkeypatch.setattr(launch, "_compiling", lambda: False)
    run((1,), meta, x, 64)
    assert fn.log[-1][0] == "direct"


@pytest.mark.parametrize("small", [True, False], ids=["small", "large"])
def test_kernel_launches_per_sublayer(monkeypatch, small):
    """The host cost of a sublayer scales with its launches: pre forward 3 (projection,
    mappings, aggregate; 2 for small inputs, whose mapping kernel forms the aggregate too,
    ``TILES.maps_agg``), combine forward 1, combine backward 1, pre backward 4 (dH_pre,
    mappings, dx + dphi, the parameter-gradient sums), all through ``Launcher``."""
    from mhc_megatron.kernels import triton_mhc
    from mhc_megatron.kernels.triton_common import TILES

    if not small:  # every input counts as large
        monkeypatch.setattr(TILES, "maps_agg", (0, *TILES.maps_agg[1:]))
    calls = []
    original, original_signed = Launcher.__call__, Launcher.signed

    def counted(self, grid, meta, *args):
        calls.append(self.fn.__name__ if hasattr(self.fn, "__name__") else repr(self.fn))
        return original(self, grid, meta, *args)

    def counted_signed(self, plan, sig, grid, meta, *args):
        calls.append(self.fn.__name__ if hasattr(self.fn, "__name__") else repr(self.fn))
        return original_signed(self, plan, sig, grid, meta, *args)

    monkeypatch.setattr(Launcher, "__call__", counted)
    monkeypatch.setattr(Launcher, "signed", counted_signed)
    dev = "cuda" if CUDA else "cpu"
    n, c = 4, 16
    m = 2 * n + n * n
    x = torch.randn(3, 3, n * c, device=dev).requires_grad_()  # streams [s, b, n*C]
    phi = (0.05 * torch.randn(m, n * c, device=dev)).requires_grad_()
    alpha = torch.full((3,), 0.5, device=dev, requires_grad=True)
    bias = torch.zeros(m, device=dev, requires_grad=True)
    y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n)
    pre_launches = 2 if small else 3
    assert len(calls) == pre_launches, calls
    out = triton_mhc.combine(x, y * 2.0, None, h_res, h_post, n=n)
    assert len(calls) == pre_launches + 1
    out.square().sum().backward()
    assert len(calls) == pre_launches + 6, calls


@pytest.mark.skipif(CUDA, reason="CPU (interpreter) form of the check; on GPUs every launch "
                                 "of the suite is checked (MHC_CHECK_LAUNCH_SIGNATURES=1)")
def test_op_signatures_determine_the_argument_keys(monkeypatch):
    """Every launch of pre, combine, the aggregate and the fused replay, forward and backward,
    in each layout (streams, tokens, broadcast streams), with and without a bias, the fold or
    not, fp32 and bf16, several token counts and Sinkhorn iterations, misaligned inputs,
    the gradient-accumulation fusion into fp32 and bf16 ``main_grad`` views (some misaligned):
    wherever two launches share (launcher, meta, signature) they share the per-argument key
    too (the key is at least as fine as Triton's specialisation), so the kernel a signature
    names is the one Triton would pick. The kernels run in the interpreter; the check mode
    compares the keys."""
    from mhc_megatron.kernels import triton_common, triton_mhc

    interned: dict = {}

    def keyed_launch(self, grid, meta, args):  # Launcher._launch, keys as the entries
        self.fn[grid](*args, **meta.kwargs)
        key = launch._launch_key(0, meta, args)
        return interned.setdefault(key, key)

    monkeypatch.setattr(Launcher, "_launch", keyed_launch)
    monkeypatch.setattr(Launcher, "_disabled", None)
    monkeypatch.setattr(launch, "CHECK_SIGNATURES", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(triton_common, "PLANS", {})  # these plans' tables hold keys

    g = torch.Generator().manual_seed(0)
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [(f32, 16, 32, 20, layout, with_bias)
             for layout in ("streams", "tokens", "broadcast", "misaligned")
             for with_bias in (False, True)]
    cases += [(bf16, 16, 32, 20, "streams", True), (f32, 7, 24, 1, "streams", False),
              (f32, 16, 32, 3, "streams", False), (bf16, 16, 32, 3, "broadcast", False)]
    # the gradient-accumulation fusion: main_grad buffers of fp32 or bf16, aligned or not
    cases += [(f32, 16, 32, 20, "streams", False, main) for main in
              ("fp32", "bf16", "fp32 misaligned")]
    n = 4
    m = 2 * n + n * n
    for dtype, t, c, iters, layout, with_bias, *main_grad in cases:
        rows = torch.randn(t, c, generator=g).to(dtype)
        if layout == "broadcast":
            x, n_arg = rows.view(t, 1, c).expand(t, n, c), None
        elif layout == "misaligned":
            buf = torch.randn(t * n * c + 1, generator=g).to(dtype)
            x, n_arg = buf[1:].view(t, n * c), n
        else:
            x = torch.randn(t, n, c, generator=g).to(dtype)
            x, n_arg = (x.view(t, n * c), n) if layout == "streams" else (x, None)
        x.requires_grad_()
        phi = (0.05 * torch.randn(m, n * c, generator=g)).requires_grad_()
        alpha = torch.full((3,), 0.5, requires_grad=True)
        bias = torch.zeros(m, requires_grad=True)
        f_bias = torch.randn(c, generator=g).to(dtype) if with_bias else None
        if main_grad:  # as Megatron's DDP: views into one buffer, flagged
            main_dtype = bf16 if "bf16" in main_grad[0] else f32
            skip = 1 if "misaligned" in main_grad[0] else 0
            buffer = torch.zeros(skip + sum(p.numel() for p in (phi, alpha, bias)),
                                 dtype=main_dtype)
            start = skip
            for p in (alpha, phi, bias):  # alpha's 3 elements first: the next start unaligned
                p.main_grad = buffer[start:start + p.numel()].view(p.shape)
                p.grad_added_to_main_grad = False
                start += p.numel()
        y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, iters, 1e-6, n=n_arg,
                                                 main_grads=bool(main_grad))
        out = triton_mhc.combine(x, y * 1.5, f_bias, h_res, h_post, n=n_arg)
        (out.float().square().sum() + y.float().sum()).backward()
        assert all(getattr(p, "grad_added_to_main_grad", False) == bool(main_grad)
                   for p in (phi, alpha, bias))
        with torch.no_grad():
            triton_mhc.aggregate(x, h_pre, n=n_arg)
            triton_mhc.combine_aggregate(x, y, f_bias, h_res, h_post, h_pre, n=n_arg)
    signed = [k for p in triton_common.PLANS.values() for k in p.launches]
    assert len(signed) > 20  # the signed launches ran (and were checked)
