"""Fine-grained activation offloading with mHC layers (Megatron's ``offload_modules``).

* Config: ``fine_grained_activation_offloading`` is accepted with mHC; the combinations that
  are not supported are refused with a message naming the fields and the fix.
* CPU: Megatron's offload manager needs CUDA streams and events (it cannot even be built on
  CPU). The CPU tests run Megatron's own layer code and offload autograd functions against
  (1) :class:`StandInOffloadManager`, a minimal CPU stand-in for its manager/chunk handler that
  really "offloads" (replaces each group's saved tensors by copies at the commit) and really
  releases the ``forced_released_tensors`` (``untyped_storage().resize_(0)``), and (2)
  Megatron's real manager with its CUDA streams/events replaced by synchronous no-ops (its
  group bookkeeping: warmup, steady state, the last layer kept, the summary). Asserted: loss
  and every gradient bitwise equal to the same model without offloading over several steps
  (dense, MoE, reference and Triton ops), the streams are put into their own group exactly
  once per sublayer and their storage is freed after the combine.
* GPU: Megatron's real manager, driven as its schedules drive it (the model's forward opens a
  chunk, ``off_interface.reset()`` after each step's backward; the first step is the warmup
  that records the groups): same loss and gradients as without offloading for several steps,
  dense and MoE, with the expected bytes offloaded; lower peak GPU memory.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch
from helpers import (CONFIG_BASE, assert_refused, batch, build_gpt, lm_loss, moe_overrides,
                     needs_te, tiny_config)
from torch.autograd.graph import saved_tensors_hooks

from mhc_megatron.config import MHCTransformerConfig
from mhc_megatron.layers.stream_offload import STREAM_OFFLOAD_GROUPS, stream_offload_group
from mhc_testing.cpu import setup_cpu_megatron

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="Megatron's offload manager needs CUDA")
BASE = CONFIG_BASE
OFFLOAD = dict(fine_grained_activation_offloading=True)
STREAMS = ["attn_norm", "mlp_norm"]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("modules", [["attn_norm"], ["mlp_norm"], STREAMS, ["qkv_linear"],
                                     ["core_attn", "attn_proj"], STREAMS + ["core_attn"]])
def test_fine_grained_offloading_is_accepted(modules):
    cfg = MHCTransformerConfig(**BASE, **OFFLOAD, offload_modules=modules)
    assert cfg.fine_grained_activation_offloading and cfg.offload_modules == modules
    assert stream_offload_group(cfg, "attn_norm") == (
        "mhc_attn_streams" if "attn_norm" in modules else None)
    assert stream_offload_group(cfg, "mlp_norm") == (
        "mhc_mlp_streams" if "mlp_norm" in modules else None)


def test_no_stream_group_without_fine_grained_offloading():
    cfg = MHCTransformerConfig(**BASE)
    assert stream_offload_group(cfg, "attn_norm") is None
    assert stream_offload_group(cfg, "mlp_norm") is None


def test_mhc_recompute_is_accepted_with_offloading_inside_the_sublayers():
    cfg = MHCTransformerConfig(**BASE, **OFFLOAD, offload_modules=["qkv_linear"],
                               mhc_recompute=True)
    assert cfg.mhc_recompute and cfg.fine_grained_activation_offloading


REFUSED = {
    "cpu_offloading": (dict(cpu_offloading=True, cpu_offloading_num_layers=1), "cpu_offloading"),
    "mhc_recompute_attn_norm": (dict(**OFFLOAD, offload_modules=["attn_norm"],
                                     mhc_recompute=True), "mhc_recompute / offload_modules"),
    "mhc_recompute_mlp_norm": (dict(**OFFLOAD, offload_modules=["core_attn", "mlp_norm"],
                                    mhc_recompute=True), "mhc_recompute / offload_modules"),
    "full_recompute_streams": (
        dict(**OFFLOAD, offload_modules=["mlp_norm"], recompute_granularity="full",
             recompute_method="uniform", recompute_num_layers=1),
        "recompute_granularity / offload_modules"),
    "cuda_graphs": (dict(**OFFLOAD, offload_modules=["core_attn"],
                         cuda_graph_impl="transformer_engine"),
                    "fine_grained_activation_offloading / cuda_graph_impl"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(case):
    assert_refused(*REFUSED[case])


def test_refusals_name_the_fix():
    with pytest.raises(ValueError) as err:
        MHCTransformerConfig(**BASE, **OFFLOAD, offload_modules=["attn_norm"], mhc_recompute=True)
    assert "mhc_recompute=False" in str(err.value) and "['qkv_linear']" in str(err.value)
    with pytest.raises(ValueError) as err:
        MHCTransformerConfig(**BASE, cpu_offloading=True, cpu_offloading_num_layers=1)
    assert "fine_grained_activation_offloading=True" in str(err.value)


def test_offloading_settings_are_fine_when_mhc_is_off():
    cfg = MHCTransformerConfig(**{**BASE, "enable_hyper_connections": False}, **OFFLOAD,
                               offload_modules=["attn_norm"], mhc_recompute=True)
    assert not cfg.enable_hyper_connections


# --------------------------------------------------- CPU: Megatron's layer code, stand-in manager
class _Group:
    def __init__(self, name):
        self.name, self.tensors, self.count, self.committed = name, {}, 0, False
        self.offloaded = []  # shapes of the tensors copied at the commit


class StandInOffloadManager:
    """What Megatron's ``PipelineOffloadManager`` + ``ChunkOffloadHandler`` do for the layer's
    autograd functions, without CUDA: groups open at the group-start function, tensors saved
    inside an offload context go into the latest group, the commit replaces them by copies
    (the "CPU copies") and frees the storage of ``forced_released_tensors``; in backward a
    saved tensor is popped from its group (a copy of the copy: the "reload")."""

    def __init__(self, min_offloaded_tensor_size=0):
        self.min_size = min_offloaded_tensor_size
        self.groups: list[_Group] = []
        self.released: list[tuple[str, torch.Tensor]] = []
        self.inside_context = False
        self.do_offload = True
        self._hooks = saved_tensors_hooks(self.on_save_for_backward, self.on_get_saved_tensor)

    # PipelineOffloadManager
    def init_model_chunk_offload_handler(self, *args, **kwargs):
        self.groups, self.released = [], []

    def pop_forward_chunk(self, name=None):
        return self

    def cur_forward_chunk(self):
        return self

    def cur_backward_chunk(self):
        return self

    def mark_not_offload(self, tensor):
        tensor._do_not_offload = True

    def reset(self):
        pass

    def __enter__(self):
        self.inside_context = True
        self._hooks.__enter__()

    def __exit__(self, *args):
        self.inside_context = False
        self._hooks.__exit__(*args)

    def on_save_for_backward(self, t):
        assert self.inside_context
        if isinstance(t, torch.nn.Parameter):
            return t
        group = self.groups[-1]
        group.count += 1
        group.tensors[group.count] = t
        return group, group.count

    def on_get_saved_tensor(self, tag):
        if isinstance(tag, torch.Tensor):
            return tag
        group, key = tag
        t = group.tensors.pop(key)
        return t[1].clone() if isinstance(t, tuple) else t

    # ChunkOffloadHandler
    def on_group_start_forward(self, name):
        self.groups.append(_Group(name))

    def on_group_start_backward(self):
        pass

    def on_group_commit_forward(self, name, forced_released_tensors):
        group = next(g for g in self.groups if g.name == name and not g.committed)
        group.committed = True
        for key, t in list(group.tensors.items()):
            if t.numel() >= self.min_size and not getattr(t, "_do_not_offload", False):
                group.tensors[key] = ("copy", t.detach().clone())
                group.offloaded.append(tuple(t.shape))
        for t in forced_released_tensors:
            if t.numel() >= self.min_size:
                t.untyped_storage().resize_(0)
                self.released.append((name, t))

    def on_group_commit_backward(self, name):
        pass


@pytest.fixture
def stand_in(monkeypatch):
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as foa

    manager = StandInOffloadManager()
    monkeypatch.setattr(foa.PipelineOffloadManager, "get_instance", staticmethod(lambda: manager))
    return manager


def _cfg(offload_modules=None, **overrides):
    offload = dict(**OFFLOAD, offload_modules=offload_modules) if offload_modules else {}
    return tiny_config(**offload, **overrides)


def _train(cfg, device, steps=3, seed=7, te=False, spy=None, **batch_kw):
    """``steps`` forward/backward passes (new data each, no update), as Megatron's schedules
    drive the offloading: the model's forward opens a chunk, ``reset()`` after backward."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface,
    )

    setup_cpu_megatron(seed=seed)
    model = build_gpt(cfg, device, te=te)
    if cfg.params_dtype == torch.bfloat16:
        model = model.to(torch.bfloat16)
    runs = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, batch(device=device, seed=step, **batch_kw))
        if spy is not None:
            spy(step)
        loss.backward()
        if cfg.fine_grained_activation_offloading:
            off_interface.reset()
        runs.append((loss.detach().cpu(),
                     {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}))
    return runs


def _assert_same(runs_a, runs_b, exact):
    assert len(runs_a) == len(runs_b)
    for step, ((la, ga), (lb, gb)) in enumerate(zip(runs_a, runs_b)):
        assert ga.keys() == gb.keys()
        if exact:
            assert torch.equal(la, lb), (step, la, lb)
            for name in ga:
                assert torch.equal(ga[name], gb[name]), (step, name)
        else:
            torch.testing.assert_close(la, lb, rtol=1e-6, atol=0, msg=f"loss, step {step}")
            for name in ga:
                torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7,
                                           msg=f"{name}, step {step}")


@pytest.mark.parametrize("kind,backend", [("dense", "reference"), ("moe", "reference"),
                                          ("dense", "triton")])
def test_stand_in_offload_grads_bitwise_and_streams_released(megatron_single_rank, stand_in,
                                                             monkeypatch, kind, backend):
    """Loss and gradients bitwise equal over 3 steps; per layer and step, each streams group
    holds exactly one copy of the streams [s, b, n*C] (pre and combine both save them), their
    storage is freed after the combine, and (Triton) every combine still hands its dx to the
    pre of the same streams."""
    if CUDA:
        pytest.skip("CPU stand-in for the offload manager (GPU: the tests below)")
    from mhc_megatron.kernels.handoff import DxLink

    claims = []
    claim = DxLink.claim
    monkeypatch.setattr(DxLink, "claim",
                        lambda self, x: claims.append(claim(self, x)) or claims[-1])
    extra = dict(moe_overrides() if kind == "moe" else {}, mhc_kernel_backend=backend,
                 num_layers=3)
    plain = _train(_cfg(**extra), "cpu")
    seen = []

    def spy(step):  # after forward, before backward: what went where
        groups = {name: [g for g in stand_in.groups if g.name == name]
                  for name in ("attn_norm", "mlp_norm", *STREAM_OFFLOAD_GROUPS.values())}
        assert all(len(gs) == 3 for gs in groups.values()), {k: len(v) for k, v in groups.items()}
        streams_shape = (16, 2, 4 * 32)  # [s, b, n*C]
        for name in STREAM_OFFLOAD_GROUPS.values():
            for g in groups[name]:
                assert g.committed and g.offloaded == [streams_shape], g.offloaded
        released = [t for name, t in stand_in.released if name in STREAM_OFFLOAD_GROUPS.values()]
        assert len(released) == 6 and all(t.untyped_storage().nbytes() == 0 for t in released)
        seen.append(step)

    offloaded = _train(_cfg(STREAMS, **extra), "cpu", spy=spy)
    assert seen == [0, 1, 2]
    _assert_same(plain, offloaded, exact=True)
    if backend == "triton":  # 2 runs x 3 steps x 3 layers x 2 sublayers
        assert len(claims) == 36 and all(claims)


def test_stand_in_only_attn_norm_and_small_tensors_kept(megatron_single_rank, stand_in):
    """Only the attention sublayers' streams have a group with ["attn_norm"]; with a minimum
    size above the streams' nothing is copied or released, and values are still exact."""
    if CUDA:
        pytest.skip("CPU stand-in for the offload manager")
    plain = _train(_cfg(), "cpu", steps=2)
    names = []
    offloaded = _train(_cfg(["attn_norm"]), "cpu", steps=2,
                       spy=lambda step: names.append([g.name for g in stand_in.groups]))
    _assert_same(plain, offloaded, exact=True)
    assert names[0] == ["mhc_attn_streams", "attn_norm"] * 2
    stand_in.min_size = 10**9
    kept = _train(_cfg(["attn_norm", "mlp_norm"]), "cpu", steps=2,
                  spy=lambda step: names.append(stand_in.released))
    assert names[-1] == []
    _assert_same(plain, kept, exact=True)


def test_stand_in_offload_with_dropout_and_selective_recompute(megatron_single_rank, stand_in):
    """Sublayer dropout inside the combine (its mask is saved as usual) and Megatron's
    core_attn selective recompute next to the offloaded groups ('layernorm' recompute needs
    Transformer Engine, whose fp8 state Megatron's CheckpointWithoutOutput reads)."""
    if CUDA:
        pytest.skip("CPU stand-in for the offload manager")
    extra = dict(hidden_dropout=0.2, recompute_granularity="selective",
                 recompute_modules=["core_attn"])
    modules = STREAMS + ["qkv_linear", "core_attn", "attn_proj"]
    _assert_same(_train(_cfg(**extra), "cpu", steps=2),
                 _train(_cfg(modules, **extra), "cpu", steps=2), exact=True)


def test_stand_in_mhc_recompute_with_sublayer_offloading(megatron_single_rank, stand_in):
    """mhc_recompute next to the offload of a module inside the sublayer (qkv_linear)."""
    if CUDA:
        pytest.skip("CPU stand-in for the offload manager")
    extra = dict(mhc_recompute=True, mhc_recompute_layer_num=2, num_layers=3)
    _assert_same(_train(_cfg(**extra), "cpu", steps=2),
                 _train(_cfg(["qkv_linear"], **extra), "cpu", steps=2), exact=True)


@pytest.fixture
def megatron_manager_on_cpu(monkeypatch):
    """Megatron's real PipelineOffloadManager / ChunkOffloadHandler bookkeeping on CPU: CUDA
    streams and events become no-ops (every copy is synchronous), CPU tensors count as
    offloadable, the CPU pool is not pinned. What this checks is Megatron's group logic with
    the streams' groups (warmup then steady state, the last layer kept, the summary, the
    forced release policy), not the stream synchronisation (the GPU tests below)."""
    import contextlib

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as foa

    class _NoStream:
        def wait_stream(self, *args):
            pass

        def wait_event(self, *args):
            pass

        def record_event(self, *args):
            pass

    class _NoEvent:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", _NoStream)
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: _NoStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args: False)
    monkeypatch.setattr(foa.ChunkOffloadHandler, "_can_manage_tensor_for_offload",
                        staticmethod(lambda t: not isinstance(t, torch.nn.Parameter)))
    pool_init = foa.OffloadTensorPool.__init__
    monkeypatch.setattr(foa.OffloadTensorPool, "__init__",
                        lambda self, device="cpu", pin_memory=False: pool_init(self, device, False))
    monkeypatch.setattr(te_ext, "cpu_offload", types.SimpleNamespace(CPUOffloadEnabled=False))
    monkeypatch.setattr(foa.PipelineOffloadManager, "OFFLOAD_MGR", None)
    released = []
    bulk_offload = foa.ChunkOffloadHandler.bulk_offload

    def spy(self, name, forced_released_tensors):
        bulk_offload(self, name, forced_released_tensors)
        released.extend((name, t) for t in forced_released_tensors)

    monkeypatch.setattr(foa.ChunkOffloadHandler, "bulk_offload", spy)
    foa.FineGrainedActivationOffloadingInterface.reset_instance()
    yield foa.PipelineOffloadManager, released


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_manager_logic_on_cpu(megatron_single_rank, megatron_manager_on_cpu, kind):
    """Megatron's own offload bookkeeping with the streams' groups: 4 steps (warmup, then its
    steady-state policy) bitwise equal to no offloading; the summary counts the streams of
    all but the last layer, once per sublayer; in steady state exactly those are released."""
    if CUDA:
        pytest.skip("CPU stand-ins for CUDA streams (GPU: the tests below)")
    manager, released = megatron_manager_on_cpu
    layers = 4
    extra = dict(moe_overrides() if kind == "moe" else {}, num_layers=layers)
    freed = []

    def spy(step):
        freed.append(sorted(name for name, t in released
                            if name in STREAM_OFFLOAD_GROUPS.values()
                            and t.untyped_storage().nbytes() == 0))
        released.clear()

    plain = _train(_cfg(**extra), "cpu", steps=4)
    offloaded = _train(_cfg(STREAMS, min_offloaded_tensor_size=1024, **extra), "cpu", steps=4,
                       spy=spy)
    _assert_same(plain, offloaded, exact=True)
    streams = 16 * 2 * 4 * 32 * 4  # [s, b, n*C] fp32
    summary = manager.get_instance().offload_summary_bytes
    assert summary["mhc_attn_streams"] == summary["mhc_mlp_streams"] == (layers - 1) * streams
    assert freed[0] == sorted([*STREAM_OFFLOAD_GROUPS.values()] * layers)  # warmup: all
    for step in (1, 2, 3):  # Megatron keeps each group's last instance on the GPU
        assert freed[step] == sorted([*STREAM_OFFLOAD_GROUPS.values()] * (layers - 1))


# ------------------------------------------------------------- GPU: Megatron's real manager
@pytest.fixture
def real_manager(monkeypatch):
    """A fresh PipelineOffloadManager. Its offload context only flips Transformer Engine's
    ``cpu_offload.CPUOffloadEnabled`` (and raises when TE is absent): without TE, a stand-in
    namespace holds that flag (TE's modules are the only readers)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface,
    )
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    if te_ext.cpu_offload is None:
        monkeypatch.setattr(te_ext, "cpu_offload", types.SimpleNamespace(CPUOffloadEnabled=False))
    off_interface.reset_instance()
    yield PipelineOffloadManager
    off_interface.reset_instance()
    gc.collect()
    torch.cuda.empty_cache()


GPU = dict(mhc_kernel_backend="triton", num_layers=4, hidden_size=64, num_attention_heads=4,
           ffn_hidden_size=128)


@needs_cuda
@pytest.mark.parametrize("kind,modules,dtype,spec", [
    ("dense", STREAMS, torch.float32, "local"),
    ("dense", ["attn_norm"], torch.bfloat16, "local"),
    ("dense", STREAMS + ["qkv_linear", "core_attn", "attn_proj"], torch.float32, "local"),
    ("moe", STREAMS, torch.float32, "local"),
    # TE's specs fuse the norms into the linears: Megatron opens no norm group, ours remain
    pytest.param("dense", STREAMS, torch.float32, "te", marks=needs_te),
    pytest.param("moe", STREAMS + ["qkv_linear"], torch.float32, "te", marks=needs_te),
])
def test_gpu_offload_same_loss_and_grads(megatron_single_rank, real_manager, kind, modules,
                                         dtype, spec):
    """Same loss and every gradient as without offloading, over 4 steps (the first is
    Megatron's warmup step, the others run its steady-state policy). The offload path runs the
    same kernels on the same values; on a GPU the two runs are separate model runs, and some
    CUDA kernels (embedding / MoE scatter backward) are not deterministic run to run, and
    Megatron's own reload returns contiguous copies of strided saved tensors (q/k/v of the
    qkv_linear / core_attn / attn_proj groups: the same values, other GEMM layouts), so fp32
    is compared at rtol 1e-5 / atol 1e-7 (as tests/test_recompute.py) and bf16 at about one
    bf16 ulp (rtol 1e-2); the CPU tests above assert bitwise equality of the same code paths
    (the streams keep their layout: they are reloaded whole and viewed as saved)."""
    extra = dict(GPU, **(moe_overrides() if kind == "moe" else {}))
    if dtype == torch.bfloat16:
        extra.update(bf16=True, params_dtype=torch.bfloat16)
    te = spec == "te"
    plain = _train(_cfg(**extra), "cuda", steps=4, te=te)
    offloaded = _train(_cfg(modules, min_offloaded_tensor_size=1024, **extra), "cuda", steps=4,
                       te=te)
    if dtype == torch.float32:
        _assert_same(plain, offloaded, exact=False)
    else:
        for (la, ga), (lb, gb) in zip(plain, offloaded):
            torch.testing.assert_close(la, lb, rtol=1e-2, atol=0)
            for name in ga:
                torch.testing.assert_close(ga[name].float(), gb[name].float(), rtol=1e-2,
                                           atol=1e-5, msg=name)
    summary = real_manager.get_instance().offload_summary_bytes
    streams = 16 * 2 * 4 * 64 * torch.tensor([], dtype=dtype).element_size()
    layers = extra["num_layers"]
    for module in modules:
        group = STREAM_OFFLOAD_GROUPS.get(module)
        if group is not None:  # the last layer's groups stay on the GPU (Megatron's margin)
            assert summary.get(group) == (layers - 1) * streams, (group, summary)


@needs_cuda
def test_gpu_offload_with_mhc_recompute_and_qkv_linear(megatron_single_rank, real_manager):
    extra = dict(GPU, mhc_recompute=True, mhc_recompute_layer_num=2)
    _assert_same(_train(_cfg(**extra), "cuda", steps=3),
                 _train(_cfg(["qkv_linear"], min_offloaded_tensor_size=1024, **extra), "cuda",
                        steps=3), exact=False)


@needs_cuda
@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
def test_gpu_offload_lowers_peak_memory(megatron_single_rank, real_manager, spec):
    """Peak GPU memory of a steady-state step (after the warmup step), with and without
    offloading the streams ('attn_norm', 'mlp_norm'): lower by about the streams of all but
    the last layer. With TE's specs the norms are fused into the linears (Megatron has no norm
    group then): only the streams' groups offload."""
    layers, seq, mbs, hidden, n = 6, 512, 2, 256, 4
    dims = dict(mhc_kernel_backend="triton", num_layers=layers, hidden_size=hidden,
                num_attention_heads=4, ffn_hidden_size=4 * hidden, num_residual_streams=n)
    data = batch(batch_size=mbs, seq=seq, device="cuda", seed=0)

    def peak(cfg):
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            FineGrainedActivationOffloadingInterface as off_interface,
        )

        setup_cpu_megatron(seed=3)
        model = build_gpt(cfg, "cuda", te=spec == "te")
        peaks, losses = [], []
        for _ in range(2):  # warmup step (offload bookkeeping, kernels), measured step
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loss = lm_loss(model, data)
            loss.backward()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            losses.append(loss.item())
            if cfg.fine_grained_activation_offloading:
                off_interface.reset()
        del model, loss
        gc.collect()
        torch.cuda.empty_cache()
        return peaks[-1], losses[-1]

    base, base_loss = peak(_cfg(**dims))
    off, off_loss = peak(_cfg(STREAMS, min_offloaded_tensor_size=1024, **dims))
    stream_mib = seq * mbs * n * hidden * 4 / 2**20
    print(f"\n[{spec}] peak GPU memory of a step: {base / 2**20:.1f} MiB without offloading, "
          f"{off / 2**20:.1f} MiB with 'attn_norm'+'mlp_norm' offloading (saved "
          f"{(base - off) / 2**20:.1f} MiB; one stream tensor = {stream_mib:.1f} MiB, "
          f"{2 * (layers - 1)} offloaded)")
    assert off_loss == pytest.approx(base_loss, rel=1e-6)
    assert off < base
    # at least half of the offloaded streams of all but the last layer come off the peak
    assert base - off > (layers - 1) * stream_mib * 2**20
