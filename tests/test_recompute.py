"""MHCRecomputeManager: gradients with cross-layer mHC recompute equal those without; one
recompute hook per block; the block-internal streams are really freed after forward."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (batch, build_gpt, lm_loss, moe_overrides, needs_te,
                     skip_without_host_replay, tiny_config)

from mhc_megatron.recompute import MHCRecomputeManager, manager_for
from mhc_megatron.recompute.manager import _OutputView
from mhc_testing.cpu import setup_cpu_megatron

LAYERS = 4
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _use_hooks(monkeypatch, hooks: str) -> None:
    """The blocks' saved-tensor hooks: ``python`` (manager.py's) or ``native`` (the host
    replay extension's; the test is skipped where it is not built)."""
    from mhc_megatron.recompute import manager as rc

    if hooks == "native":
        skip_without_host_replay()
    monkeypatch.setattr(rc, "_NATIVE_HOOKS", hooks == "native")


def _grads(cfg, seed=7, data_seed=3, te=False):
    setup_cpu_megatron(seed=seed)
    model = build_gpt(cfg, DEV, te=te)
    loss = lm_loss(model, batch(device=DEV, seed=data_seed))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def _assert_same(run_a, run_b, exact=DEV == "cpu"):
    """Bitwise on CPU. On a GPU the two runs are separate model runs, and some CUDA kernels
    of the model (embedding / MoE scatter backward) are not deterministic run to run, so
    they are compared at a tight tolerance there."""
    (la, ga, _), (lb, gb, _) = run_a, run_b
    assert torch.equal(la, lb) if exact else torch.allclose(la, lb, rtol=1e-6)
    assert ga.keys() == gb.keys()
    for name in ga:
        if exact:
            assert torch.equal(ga[name], gb[name]), name
        else:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("block", [1, 2, 3, 4, None])  # 3: last block partial; None: eq. 20
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_grads_equal_with_and_without_recompute(megatron_single_rank, block, kind):
    extra = moe_overrides() if kind == "moe" else {}
    base = tiny_config(num_layers=LAYERS, **extra)
    rec = tiny_config(num_layers=LAYERS, mhc_recompute=True, mhc_recompute_layer_num=block,
                      **extra)
    plain, recomputed = _grads(base), _grads(rec)
    _assert_same(plain, recomputed)
    manager = manager_for(rec)
    blocks = math.ceil(LAYERS / rec.mhc_recompute_block_size)
    assert manager.blocks_recomputed == blocks, "the hook must fire exactly once per block"


def test_triton_backend_recompute_bitwise(megatron_single_rank, monkeypatch):
    """Deterministic Triton kernels (interpreter on CPU, compiled on GPU): bitwise equal.
    With and without recompute every combine hands its dx to pre's kernel (under recompute
    nothing but the streams' base keeps pre's input view alive: the link must not need it).
    The replay runs a combine and the next pre's aggregate of its output as one kernel
    wherever both are replayed: blocks of layers {1, 2} and {3}; the combines whose output
    the next aggregate reads inside the block are 3 and 1, less global layer 1's first (its
    streams are a broadcast view of the embeddings and its output is read reshaped): 3."""
    from mhc_megatron.kernels.handoff import DxLink

    claims = []
    claim = DxLink.claim
    monkeypatch.setattr(DxLink, "claim",
                        lambda self, x: claims.append(claim(self, x)) or claims[-1])
    device = DEV
    runs = []
    for recompute in (False, True):
        cfg = tiny_config(num_layers=3, mhc_kernel_backend="triton", mhc_recompute=recompute,
                          mhc_recompute_layer_num=2, add_bias_linear=True)
        setup_cpu_megatron(seed=5)
        model = build_gpt(cfg, device)
        loss = lm_loss(model, batch(device=device, seed=1))
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                     model))
        if recompute:
            assert manager_for(cfg).replays_fused == 3
    assert len(claims) == 2 * 2 * 3 and all(claims), claims  # runs x sublayers
    _assert_same(*runs)


def test_dropout_and_selective_core_attn_recompute(megatron_single_rank):
    """Sublayer dropout (its mask must not be redrawn by the recompute) and Megatron's
    selective recompute of core attention inside the blocks."""
    extra = dict(hidden_dropout=0.2, recompute_granularity="selective",
                 recompute_modules=["core_attn"], num_layers=LAYERS)
    plain = _grads(tiny_config(**extra))
    rec = _grads(tiny_config(mhc_recompute=True, mhc_recompute_layer_num=2, **extra))
    _assert_same(plain, rec)


@pytest.mark.parametrize("hooks", ["python", "native"])
def test_block_internal_streams_are_freed_after_forward(megatron_single_rank, monkeypatch,
                                                        hooks):
    """After forward, only block inputs keep their n-stream tensors: every other recorded
    output's storage is gone (not merely untouched) until backward recomputes it. With the
    saved-tensor hooks in Python and in C++ (the host replay extension's, where built)."""
    _use_hooks(monkeypatch, hooks)
    cfg = tiny_config(num_layers=LAYERS, mhc_recompute=True, mhc_recompute_layer_num=2)
    setup_cpu_megatron(seed=1)
    model = build_gpt(cfg, DEV)
    manager = manager_for(cfg)
    states = []
    orig = MHCRecomputeManager._state_for

    def spy(self, layer_number, chunk_offset=0):
        st = orig(self, layer_number, chunk_offset)
        if not states or states[-1] is not st:
            states.append(st)
        return st

    MHCRecomputeManager._state_for = spy
    try:
        loss = lm_loss(model, batch(device=DEV, seed=0))
    finally:
        MHCRecomputeManager._state_for = orig
    assert len(states) == 2
    for st in states:
        assert st.packed_ops, "no saved tensor was replaced by a placeholder"
        assert st.outputs is None  # nothing recomputed before backward
        # the ops that write streams (layer 1's expansion is a view: no op)
        streams = [op for op, (fn, *_) in enumerate(st.ranges.recorded_ops(_OutputView))
                   if fn.__name__ in ("_reference_combine", "combine")]
        last = max(streams)
        entries = st.ranges.entries()
        assert entries
        for op, index, expired in entries:
            if op in streams and op != last:
                assert expired, f"block {st.block_id}: streams of op {op} still stored"
            if op not in streams and index == 0:  # pre's y = the sublayer input
                assert expired, f"block {st.block_id}: y of op {op} still stored"
        # a block's last streams are the next block's input: stored (the last block's are
        # only summed by the final norm, which saves nothing of them)
        if st is not states[-1]:
            assert not [e for e in entries if e[0] == last][0][2]
    freed_before = manager.blocks_recomputed
    loss.backward()
    assert manager.blocks_recomputed == freed_before + 2


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_blocks_are_freed_by_reference_counting(megatron_single_rank, kind):
    """A block's state (its op records and recomputed tensors, streams among them) is freed
    as soon as backward has consumed it, without the cyclic garbage collector: a reference
    cycle through it would keep every block's recomputed streams alive until Python's gc
    happened to run (on a GPU: until then, memory the caching allocator cannot reuse). With
    gc off, after each step no block is alive, and the cyclic garbage is exactly that of the
    same model without mhc_recompute (Megatron's MoE layer leaves some of its own). Both
    models run twice and the second round is compared: the first can meet one-off work of
    the process (a kernel compiled for a new specialisation leaves cyclic garbage)."""
    import gc

    from mhc_megatron.recompute.manager import _BlockState, _Placeholder

    extra = moe_overrides() if kind == "moe" else {}
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    garbage = {}
    try:
        for recompute in (False, True, False, True):
            setup_cpu_megatron(seed=1)
            cfg = tiny_config(num_layers=LAYERS, mhc_recompute=recompute,
                              mhc_recompute_layer_num=2, **extra)
            model = build_gpt(cfg, DEV)
            data = batch(device=DEV, seed=0)
            lm_loss(model, data).backward()  # first step: lazily built state
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            for _ in range(2):
                lm_loss(model, data).backward()
                assert not [o for o in gc.get_objects() if isinstance(o, _BlockState)]
            gc.collect()
            gc.set_debug(0)
            found = [type(o).__name__ for o in gc.garbage]
            gc.garbage.clear()
            assert not [n for n in found if n in (_BlockState.__name__, _Placeholder.__name__)]
            garbage[recompute] = len(found)
            if recompute:
                assert manager_for(cfg).blocks_recomputed == 3 * 2
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert garbage[True] == garbage[False], garbage


def _count_hook_work(monkeypatch, **overrides) -> dict:
    """One model step's saved-tensor hook calls (after a first step): ``packs`` (tensors the
    pack hook saw), ``hits`` (placeholders), ``inside`` (lookups, by the pack hook or of the
    recorded ops' arguments, of a tensor whose address lies in a registered output's range,
    found by a linear scan) and ``full_lookups`` (lookups past the ranges' own bisect). The
    Python hooks (the C++ ones make the same decisions:
    test_native_ranges_look_up_as_python's)."""
    from mhc_megatron.recompute import manager as rc

    _use_hooks(monkeypatch, "python")
    counts = {"packs": 0, "hits": 0, "inside": 0}
    states = []
    pack, record, lookup = rc._AddressRanges.pack, rc._BlockState.record, rc._AddressRanges.lookup

    def scanning_lookup(self, t):
        ptr = t.data_ptr()
        counts["inside"] += any(start <= ptr < end for start, end, *_ in self._ranges)
        return lookup(self, t)

    def counting_pack(self, t):
        out = pack(self, t)
        counts["packs"] += 1
        counts["hits"] += out is not t
        return out

    def counting_record(self, fn, args, kwargs, outputs):
        if self not in states:
            states.append(self)
        return record(self, fn, args, kwargs, outputs)

    monkeypatch.setattr(rc._AddressRanges, "pack", counting_pack)
    monkeypatch.setattr(rc._BlockState, "record", counting_record)
    monkeypatch.setattr(rc._AddressRanges, "lookup", scanning_lookup)
    setup_cpu_megatron(seed=1)
    cfg = tiny_config(num_layers=LAYERS, mhc_recompute=True, mhc_recompute_layer_num=2,
                      **overrides)
    model = build_gpt(cfg, DEV)
    data = batch(device=DEV, seed=0)
    lm_loss(model, data).backward()
    states.clear()
    counts.update(packs=0, hits=0, inside=0)
    lm_loss(model, data).backward()
    counts["full_lookups"] = sum(st.ranges.full_lookups for st in states)
    monkeypatch.undo()
    return counts


def test_hooks_see_only_the_saves_of_mhc_outputs(megatron_single_rank, monkeypatch):
    """The blocks' pack hook runs only where mHC outputs can be saved (pre, the sublayer's
    input norm, the combine), not for the rest of a sublayer's body: an MoE layer with 64
    experts makes it no more calls than one with 4, and an attention layer's calls are those
    of the MLP's (the same pre, norm and combine). A lookup takes the costly path (a storage
    weakref) exactly when the tensor's address lies in a registered output's range (the
    ranges' bisect against a linear scan of them)."""
    moe = {**moe_overrides(), "moe_router_topk": 2}
    few = _count_hook_work(monkeypatch, **{**moe, "num_moe_experts": 4})
    many = _count_hook_work(monkeypatch, **{**moe, "num_moe_experts": 64})
    dense = _count_hook_work(monkeypatch)
    for counts in (few, many, dense):
        assert counts["hits"] > 0, counts
        assert counts["full_lookups"] == counts["inside"] >= counts["hits"], counts
    assert many["packs"] == few["packs"] == dense["packs"], (few, many, dense)
    assert many["hits"] == few["hits"] == dense["hits"]


def _hooks_on_as_they_begin(model, top, modules) -> dict[str, list[bool]]:
    """One model step: per label of ``modules`` (``(label, module)`` pairs), whether
    saved-tensor hooks were on as each of its modules began (``top``: torch's
    ``_top_saved_tensors_default_hooks``), in call order. None are on after the step."""
    seen = {}
    handles = [module.register_forward_pre_hook(
        lambda m, a, label=label: seen.setdefault(label, []).append(top(True) is not None))
        for label, module in modules]
    lm_loss(model, batch(device=DEV, seed=0)).backward()
    for handle in handles:
        handle.remove()
    assert top(True) is None
    return seen


def _hooks_on_in_bodies(model, top) -> list[bool]:
    """Whether the hooks were on as each attention and MLP module began, in call order."""
    bodies = [("body", body) for layer in model.decoder.layers
              for body in (layer.self_attention, layer.mlp)]
    return _hooks_on_as_they_begin(model, top, bodies).get("body", [])


def _spec_of(cfg, family: str) -> tuple:
    """``build_gpt``'s ``(spec, te)`` for a spec family: ``local`` (Megatron's local modules),
    ``te`` (Transformer Engine's: the input norms of the attention and a dense MLP fused into
    ``linear_qkv`` / ``linear_fc1``, the layer's norm ``IdentityOp``), ``no_norm_module``
    (the local modules with both norms ``IdentityOp``: ``linear_qkv`` / ``linear_fc1``, an
    MoE layer's router and experts read ``y`` themselves, as with TE's fused norms)."""
    if family != "no_norm_module":
        return None, family == "te"
    from megatron.core.transformer.identity_op import IdentityOp

    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec

    spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    for layer in spec.layer_specs:
        layer.submodules.input_layernorm = IdentityOp
        layer.submodules.pre_mlp_layernorm = IdentityOp
    return spec, False


@pytest.mark.parametrize("family", ["no_norm_module", pytest.param("te", marks=needs_te)])
def test_hooks_turn_off_after_the_first_linear_without_a_norm_module(megatron_single_rank,
                                                                     monkeypatch, family):
    """Where the layer's input norm is ``IdentityOp`` (TE's norm fused into ``linear_qkv`` /
    ``linear_fc1``, or no norm), that linear reads ``y``: the hooks are on as it begins and
    off past it (as the attention's ``linear_proj`` and the MLP's ``linear_fc2`` begin); with
    ``set_narrow_hooks(False)`` they are on in both."""
    from mhc_megatron.recompute import manager as rc

    for narrow in (True, False):
        monkeypatch.setattr(rc, "_NARROW_HOOKS", narrow)
        setup_cpu_megatron(seed=1)
        cfg = tiny_config(num_layers=2, mhc_recompute=True, mhc_recompute_layer_num=2)
        model = build_gpt(cfg, DEV, *_spec_of(cfg, family))
        assert all(type(layer.input_layernorm).__name__ == "IdentityOp"
                   for layer in model.decoder.layers)
        linears = [pair for layer in model.decoder.layers for pair in (
            ("first", layer.self_attention.linear_qkv), ("past", layer.self_attention.linear_proj),
            ("first", layer.mlp.linear_fc1), ("past", layer.mlp.linear_fc2))]
        seen = _hooks_on_as_they_begin(model, rc._top_hooks, linears)
        assert seen == {"first": [True] * 4, "past": [not narrow] * 4}, (narrow, seen)


@pytest.mark.parametrize("reader", ["rmsnorm_bf16", "layernorm_fp32", "no_norm_module"])
def test_hooks_skip_a_reader_seen_not_to_save_y(megatron_single_rank, monkeypatch, reader):
    """The hooks are on over the module that reads ``y`` in its first call; where that call
    saved no ``y`` itself (Megatron's torch RMSNorm on a bf16 ``y`` saves the fp32 copy it
    makes) they are off over it from the next call on, and stay on where it did (torch's
    LayerNorm on an fp32 ``y``; the first linear where the layer has no norm module), and the
    former runs without the layer's forward hook. Each step makes the same placeholders, loss
    and gradients as the hooks on over each whole sublayer."""
    from mhc_megatron.recompute import manager as rc

    # (the Triton ops: the reference ops save fp32 copies of a bf16 x, not x)
    extra = dict(normalization="RMSNorm", params_dtype=torch.bfloat16, bf16=True,
                 mhc_kernel_backend="triton") if reader == "rmsnorm_bf16" else {}
    family = "no_norm_module" if reader == "no_norm_module" else "local"
    saves_y = reader != "rmsnorm_bf16"
    states = []
    _collect_block_states(monkeypatch, states)
    runs = {}
    for narrow in (False, True):
        monkeypatch.setattr(rc, "_NARROW_HOOKS", narrow)
        setup_cpu_megatron(seed=1)
        cfg = tiny_config(num_layers=2, mhc_recompute=True, mhc_recompute_layer_num=2, **extra)
        model = build_gpt(cfg, DEV, *_spec_of(cfg, family))
        layers = model.decoder.layers
        readers = [("reader", m) for layer in layers for m in (
            (layer.input_layernorm, layer.pre_mlp_layernorm) if family == "local"
            else (layer.self_attention.linear_qkv, layer.mlp.linear_fc1))]
        steps = []
        for _ in range(2):
            states.clear()
            model.zero_grad(set_to_none=True)
            seen = _hooks_on_as_they_begin(model, rc._top_hooks, readers)["reader"]
            blocks = [(st.block_id, sorted(st.packed_ops)) for st in states]
            steps.append((seen, blocks, {n: p.grad.clone() for n, p in model.named_parameters()}))
        learned = [v for layer in layers for bda in (layer.self_attn_bda, layer.mlp_bda)
                   for v in bda.reader.saves.values()]
        hooked = [bool(m._forward_hooks) for _, m in readers]
        runs[narrow] = steps, learned, hooked
    (whole, _, _), (narrow, learned, hooked) = runs[False], runs[True]
    assert [s[0] for s in whole] == [[True] * 4] * 2
    assert [s[0] for s in narrow] == [[True] * 4, [saves_y] * 4]
    assert learned == [saves_y] * 4
    assert hooked == [saves_y] * 4  # (a reader that saves no y runs without its forward hook)
    for (_, whole_blocks, whole_grads), (_, narrow_blocks, narrow_grads) in zip(whole, narrow):
        assert narrow_blocks == whole_blocks and all(b[1] for b in whole_blocks)
        for name, grad in whole_grads.items():
            assert torch.equal(narrow_grads[name], grad), name


def test_hooks_are_off_in_the_sublayer_body(megatron_single_rank, monkeypatch):
    """Inside a recompute block the hooks are off in the attention and MLP modules (their
    input norm has saved ``y``), and on there with Megatron's ``layernorm`` selective recompute
    (its checkpoint saves ``y`` after the norm returns) or with ``set_narrow_hooks(False)``;
    after the forward, and after a sublayer that raised, no hooks are left on."""
    from megatron.core import tensor_parallel

    from mhc_megatron.recompute import manager as rc

    init = tensor_parallel.CheckpointWithoutOutput.__init__
    monkeypatch.setattr(tensor_parallel.CheckpointWithoutOutput, "__init__",
                        lambda self, fp8=None: init(self, fp8=fp8))  # 0.19: fp8=None is off
    layernorm = dict(recompute_granularity="selective", recompute_modules=["layernorm"])
    for extra, narrow, on_in_body in (({}, True, False), ({}, False, True),
                                      (layernorm, True, True)):
        monkeypatch.setattr(rc, "_NARROW_HOOKS", narrow)
        setup_cpu_megatron(seed=1)
        cfg = tiny_config(num_layers=2, mhc_recompute=True, mhc_recompute_layer_num=2, **extra)
        model = build_gpt(cfg, DEV)
        assert _hooks_on_in_bodies(model, rc._top_hooks) == [on_in_body] * 4, extra

        def fail(m, a):
            raise RuntimeError("sublayer failed")

        handle = model.decoder.layers[1].mlp.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="sublayer failed"):
            lm_loss(model, batch(device=DEV, seed=0))
        handle.remove()
        assert rc._top_hooks(True) is None
        lm_loss(model, batch(device=DEV, seed=0)).backward()  # runs on after the failure


def test_torch_without_the_hook_stack_top_keeps_hooks_over_the_sublayer(megatron_single_rank,
                                                                       monkeypatch):
    """A torch that cannot show the top of its saved-tensor hook stack: the hooks stay on over
    each sublayer (on in the attention and MLP), none is left after the forward, and the step's
    loss and gradients are those of the narrow scope."""
    from mhc_megatron.recompute import manager as rc

    narrow = _step_blocks(monkeypatch, "dense")
    top = rc._top_hooks
    monkeypatch.setattr(rc, "_top_hooks", None)
    setup_cpu_megatron(seed=1)
    model = build_gpt(tiny_config(num_layers=2, mhc_recompute=True, mhc_recompute_layer_num=2),
                      DEV)
    assert _hooks_on_in_bodies(model, top) == [True] * 4
    whole = _step_blocks(monkeypatch, "dense")
    assert whole[1] == narrow[1]
    _assert_same(narrow[0], whole[0])


def test_hooks_left_on_by_a_sublayer_are_an_error(megatron_single_rank):
    """Hooks pushed inside a sublayer while the block's are on (here before its input norm)
    and not popped: the block's own cannot be popped, which is said with the fix, not
    silently."""
    setup_cpu_megatron(seed=1)
    cfg = tiny_config(num_layers=2, mhc_recompute=True, mhc_recompute_layer_num=2)
    model = build_gpt(cfg, DEV)
    leak = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    handle = model.decoder.layers[0].input_layernorm.register_forward_pre_hook(
        lambda m, a: leak.__enter__())
    try:
        with pytest.raises(RuntimeError, match="still on when the sublayer returned"):
            lm_loss(model, batch(device=DEV, seed=0))
    finally:
        handle.remove()
        leak.__exit__()
    from mhc_megatron.recompute import manager as rc

    # the block's hooks are left under the leaked ones (a stack: they cannot be taken out)
    assert rc._top_hooks(True)[0].__self__.__class__.__name__ in ("_AddressRanges",
                                                                  "SavedRanges")
    rc._pop_hooks()
    assert rc._top_hooks(True) is None


def test_native_ranges_look_up_as_python():
    """The C++ saved-tensor hooks (the host replay extension's ``SavedRanges``) against the
    Python ones (manager.py's ``_AddressRanges``, the reference) on the same tensors: an
    output and views of it (offset, strided, reshaped), another dtype on its storage, a tensor
    elsewhere, a CPU tensor, a tensor subclass, an output freed and its address reused, a
    registration over a freed range; lookups, pack (the tensor itself, or a placeholder of
    the block with the output's view, its op among the packed ops), unpack, and the ranges
    held; a recorded op's arguments packed (views of outputs as views, other tensors,
    parameters and subclasses detached, other values as they are) and its outputs registered
    where they own their storage."""
    skip_without_host_replay()
    import weakref

    from mhc_megatron.kernels import host_replay
    from mhc_megatron.kernels.reference import PAPER
    from mhc_megatron.recompute import manager as rc

    ext = host_replay.extension()

    class Block:  # (a weak reference target)
        pass

    block = Block()

    def pack_result(p, t):  # a pack result: ("placeholder", op, index, size, stride, offset)
        if isinstance(p, torch.Tensor):
            return p is t
        assert p.block is block
        return ("placeholder", *p.view)

    class Sub(torch.Tensor):  # (no Python dispatch: a view of its storage like any other)
        pass

    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass

    def run(cls):
        ranges = cls(weakref.ref(block))
        a = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(64, 16, device="cuda", dtype=torch.float32)
        ranges.add(a, 0, 0)
        ranges.add(b, 3, 2)
        elsewhere = torch.empty(100, device="cuda", dtype=torch.bfloat16)
        queries = [a, a[17:], a.view(64, 64)[:, 5], a.view(2, 2048).t(), a.view(torch.float16),
                   b, b.t(), b[3], elsewhere, torch.empty(8), a.as_subclass(Sub),
                   TwoTensor(a, a)]
        looked = [ranges.lookup(t) for t in queries]
        packed = [pack_result(ranges.pack(t), t) for t in queries]
        packed_ops = sorted(ranges.packed_ops)
        a_address = a.data_ptr()
        del a, queries
        reused = torch.empty(4096, device="cuda", dtype=torch.bfloat16)  # (the cached block)
        after_free = (reused.data_ptr() == a_address, ranges.lookup(reused))
        entries_freed = sorted(ranges.entries())
        ranges.add(reused, 5, 1)
        entries = sorted(ranges.entries())
        # a recorded op's arguments: outputs' views as views, other tensors detached
        grad = torch.ones(8, device="cuda", requires_grad=True) * 2  # (has a grad_fn)
        param = torch.nn.Parameter(torch.ones(3, device="cuda"))
        sub = torch.ones(5, device="cuda").as_subclass(Sub)
        args = (reused, reused[8:].view(-1, 8), b.t(), grad, param, sub, 3, None, PAPER)
        ranges.record(rc.record_as, args, {"n": 4}, None)
        fn, packed_args, kwargs, deps = ranges.recorded_ops(rc._OutputView)[-1]
        assert fn is rc.record_as and kwargs == {"n": 4}
        described = [tuple(p) if isinstance(p, rc._OutputView) else
                     (type(p).__name__, p.data_ptr() == a.data_ptr(), tuple(p.shape),
                      p.requires_grad, p.grad_fn, p is a) if isinstance(p, torch.Tensor) else p
                     for p, a in zip(packed_args, args)]
        # a recorded op's outputs: those that own their storage are registered
        c = torch.empty(32, device="cuda")
        d = torch.empty(4, 8, device="cuda")
        ranges.add_outputs((c, d.t(), d[1:], 4, None), 7)
        e = torch.empty(6, device="cuda", dtype=torch.float16)
        ranges.add_outputs(e, 8)
        ranges.add_outputs(torch.empty(16, device="cuda")[4:], 9)
        registered = [ranges.lookup(t) for t in (c, d, e)]
        return (looked, packed, packed_ops, after_free, entries_freed, entries,
                ranges.lookup(reused), (type(packed_args).__name__, described, list(deps)),
                registered)

    results = [run(rc._AddressRanges), run(ext.SavedRanges)]
    for result in results:
        (looked, packed, packed_ops, (same_address, freed_lookup), entries_freed, entries,
         reused, recorded, registered) = result
        assert looked == [(0, 0)] * 4 + [None] + [(3, 2)] * 3 + [None, None, (0, 0), None]
        assert [p[:3] if isinstance(p, tuple) else p for p in packed] == \
            [("placeholder", 0, 0)] * 4 + [True] + [("placeholder", 3, 2)] * 3 \
            + [True, True, ("placeholder", 0, 0), True]
        assert packed[1] == ("placeholder", 0, 0, (4079,), (1,), 17)
        assert packed_ops == [0, 3]
        assert freed_lookup is None  # the freed output's range: expired, whatever the address
        assert entries_freed == [(0, 0, True), (3, 2, False)]
        # the new output replaces the expired range where it took its address
        assert entries == ([] if same_address else [(0, 0, True)]) + [(3, 2, False),
                                                                       (5, 1, False)]
        assert reused == (5, 1)
        kind, described, deps = recorded
        assert kind == "tuple" and deps == [3, 5], recorded
        assert described[0] == (5, 1, (4096,), (1,), 0)
        assert described[1] == (5, 1, (511, 8), (8, 1), 8)
        assert described[2] == (3, 2, (16, 64), (1, 16), 0)
        assert [d[0] for d in described[3:6]] == ["Tensor", "Tensor", "Sub"]
        assert all(d[1] and d[3:] == (False, None, False) for d in described[3:6]), described
        assert described[6:] == [3, None, PAPER]
        assert registered == [(7, 0), None, (8, 0)], registered
    # the same placeholders, packed arguments and registrations from both
    assert results[0][1] == results[1][1]
    assert results[0][7:] == results[1][7:]
    assert rc._unpack_saved(packed) is packed and ext.unpack_saved(b := torch.ones(1)) is b


def _collect_block_states(monkeypatch, states: list):
    """Append every recompute block made from now on to ``states`` (a spy on
    ``_BlockState.__init__``, until ``monkeypatch`` undoes it); returns the original
    ``__init__``."""
    from mhc_megatron.recompute import manager as rc

    init = rc._BlockState.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        states.append(self)

    monkeypatch.setattr(rc._BlockState, "__init__", spy)
    return init


def _step_blocks(monkeypatch, kind: str, family: str = "local", states: list | None = None,
                 **overrides) -> tuple:
    """One model step's ``(loss, grads, model)`` and per block ``(block id, ops whose outputs
    became placeholders, outputs still held after forward, the ranges' type)``, with the
    hooks as the caller set them; ``family``: the layer specs (:func:`_spec_of`); ``states``:
    a list the step's blocks are appended to; ``overrides``: of the config."""
    from mhc_megatron.recompute import manager as rc

    extra = {**(moe_overrides() if kind == "moe" else {}), **overrides}
    states = [] if states is None else states
    init = _collect_block_states(monkeypatch, states)
    setup_cpu_megatron(seed=7)
    cfg = tiny_config(num_layers=LAYERS, mhc_recompute=True, mhc_recompute_layer_num=2, **extra)
    model = build_gpt(cfg, DEV, *_spec_of(cfg, family))
    loss = lm_loss(model, batch(device=DEV, seed=3))
    blocks = [(st.block_id, sorted(st.packed_ops),
               sorted((op, index) for op, index, expired in st.ranges.entries() if not expired),
               type(st.ranges).__name__) for st in states]
    loss.backward()
    monkeypatch.setattr(rc._BlockState, "__init__", init)
    assert blocks and all(b[1] for b in blocks)
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model), \
        blocks


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_native_hooks_decide_as_python(megatron_single_rank, monkeypatch, kind):
    """A model step with the C++ saved-tensor hooks against the same step with the Python
    ones: per block, the same ops' outputs become placeholders and the same outputs are held
    after forward; the same loss and gradients."""
    skip_without_host_replay()
    _use_hooks(monkeypatch, "python")
    python, python_blocks = _step_blocks(monkeypatch, kind)
    _use_hooks(monkeypatch, "native")
    native, native_blocks = _step_blocks(monkeypatch, kind)
    assert {b[3] for b in python_blocks} == {"_AddressRanges"}
    assert {b[3] for b in native_blocks} == {"SavedRanges"}
    assert [b[:3] for b in native_blocks] == [b[:3] for b in python_blocks]
    _assert_same(python, native)


def _native_nodes(kind: str) -> dict:
    """Config overrides for the ops' C++ nodes: the Triton backend; the dense model with
    sublayer biases, so that the combine saves ``f_bias`` too (Megatron's MoE experts refuse
    the bias: their in-place bias add on a view)."""
    return {"mhc_kernel_backend": "triton", "add_bias_linear": kind == "dense"}


def _pack_calls_and_skips(monkeypatch, kind: str) -> tuple:
    """One model step (:func:`_step_blocks`) with the hooks as the caller set them:
    ``(result, blocks, pack hook calls, skips)``, ``skips`` the tensors the ops' C++ nodes may
    save past the block's hooks: per node made while the block's pack hook is on top of
    autograd's hook stack, its saved tensors that are defined (pre: x, phi, alpha, bias and
    its own ht, rstd, h_pre; the combine: x, f, f_bias, h_res, h_post)."""
    from mhc_megatron.kernels import triton_combine, triton_pre
    from mhc_megatron.recompute import manager as rc

    counts = {"packs": 0, "skips": 0}
    py_pack = rc._AddressRanges.pack
    pre_native, combine_native = triton_pre._pre_native, triton_combine._combine_native

    def counting_pack(self, t):
        counts["packs"] += 1
        return py_pack(self, t)

    def skips(saved, own: int) -> int:
        state = rc._ACTIVE_BLOCK.get()
        top = rc._top_hooks(True)
        if state is None or top is None or top[0] is not state.pack_hook:
            return 0
        return own + sum(t is not None for t in saved)

    def counted_pre(x, phi, alpha, bias, *args):
        out = pre_native(x, phi, alpha, bias, *args)
        if out is not None:
            counts["skips"] += skips((x, phi, alpha, bias), 3)
        return out

    def counted_combine(x, f, f_bias, h_res, h_post, *args):
        out = combine_native(x, f, f_bias, h_res, h_post, *args)
        if out is not None:
            counts["skips"] += skips((x, f, f_bias, h_res, h_post), 0)
        return out

    monkeypatch.setattr(rc._AddressRanges, "pack", counting_pack)
    monkeypatch.setattr(triton_pre, "_pre_native", counted_pre)
    monkeypatch.setattr(triton_combine, "_combine_native", counted_combine)
    states = []
    result, blocks = _step_blocks(monkeypatch, kind, states=states, **_native_nodes(kind))
    monkeypatch.setattr(rc._AddressRanges, "pack", py_pack)
    monkeypatch.setattr(triton_pre, "_pre_native", pre_native)
    monkeypatch.setattr(triton_combine, "_combine_native", combine_native)
    if blocks[0][3] == "SavedRanges":  # (its calls counted in C++)
        counts["packs"] = sum(st.ranges.packs for st in states)
    return result, blocks, counts["packs"], counts["skips"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_native_nodes_save_past_the_block_hooks(megatron_single_rank, monkeypatch, kind):
    """The ops' C++ nodes save every tensor past the block's Python pack hook: one that is no
    block output as autograd saves it without hooks (the pack hook would keep it as it is), a
    block output (the streams) with the block's placeholder as C++ saved-tensor hooks. The
    block's pack hook is called exactly that many times fewer than the Python hooks, which
    see every save, and the same ops' outputs become placeholders, with the same loss and
    gradients."""
    skip_without_host_replay()
    _step_blocks(monkeypatch, kind, **_native_nodes(kind))  # the forward recipes recorded
    _use_hooks(monkeypatch, "python")
    python, python_blocks, python_packs, python_skips = _pack_calls_and_skips(monkeypatch, kind)
    _use_hooks(monkeypatch, "native")
    native, native_blocks, native_packs, native_skips = _pack_calls_and_skips(monkeypatch, kind)
    assert native_skips == python_skips > 0
    assert python_packs - native_packs == native_skips, (python_packs, native_packs,
                                                          native_skips)
    assert [b[:3] for b in native_blocks] == [b[:3] for b in python_blocks]
    _assert_same(python, native)


def _replayed_steps(monkeypatch, kind: str, steps: int, between=None) -> tuple:
    """``steps`` model steps of one model with the C++ hooks and the ops' C++ nodes (the
    Triton backend): per step, the blocks replayed in all and from C++, every block's
    recomputed outputs (cloned, in recompute order), and every tensor a placeholder of the
    Python hook calls (the input norm's saves; the ops' too where they ran as Python
    functions) was unpacked to, cloned, with its view and its block's place in that order;
    then the last step's ``(loss, grads, model)``. ``between(step)`` runs before each step."""
    from mhc_megatron.kernels import host_replay
    from mhc_megatron.recompute import manager as rc

    ext = host_replay.extension()
    unpacked: list = []
    recomputed: dict = {}  # id(block) -> its recomputed outputs (blocks all live till backward)
    recompute = rc._BlockState.recompute

    def recording_unpack(obj):
        out = ext.unpack_saved(obj)
        if isinstance(obj, ext.Placeholder):
            unpacked.append((id(obj.block), obj.view, out.clone()))
        return out

    def recording_recompute(self):
        out = recompute(self)
        if id(self) not in recomputed:
            recomputed[id(self)] = [tuple(None if t is None else t.clone() for t in op)
                                    for op in self.ranges.recomputed_outputs]
        return out

    setup_cpu_megatron(seed=7)
    cfg = tiny_config(num_layers=LAYERS, mhc_recompute=True, mhc_recompute_layer_num=2,
                      **{**(moe_overrides() if kind == "moe" else {}), **_native_nodes(kind)})
    model = build_gpt(cfg, DEV)
    manager = manager_for(cfg)
    data = batch(device=DEV, seed=3)
    per_step = []
    with monkeypatch.context() as patch:
        patch.setattr(rc, "_hooks", lambda: (ext.SavedRanges, recording_unpack))
        patch.setattr(rc._BlockState, "recompute", recording_recompute)
        for step in range(steps):
            if between is not None:
                between(step)
            unpacked.clear()
            recomputed.clear()
            before = manager.blocks_recomputed, manager.blocks_replayed_natively
            model.zero_grad(set_to_none=True)
            loss = lm_loss(model, data)
            loss.backward()
            order = list(recomputed)
            per_step.append((manager.blocks_recomputed - before[0],
                             manager.blocks_replayed_natively - before[1],
                             [(order.index(block), view, t) for block, view, t in unpacked],
                             list(recomputed.values())))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return per_step, (loss.detach(), grads, model)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_native_replay_gives_the_python_replays_bits(megatron_single_rank, monkeypatch, kind):
    """A block's replay from C++ by its ops' replay sites, learned from the Python replay of
    the step before: from the second step on every block replays from C++, every recomputed
    output has the same bits as with the Python replay (the replay from C++ off, the same
    model and data), and the placeholders unpack to their views of those outputs; a change of
    the launch plans (their generation; also before the first step, so that no earlier test's
    sites are used) ends the sites, so that step replays in Python and teaches them again.
    The same loss and gradients."""
    skip_without_host_replay()
    from mhc_megatron.kernels.triton_common import PLANS
    from mhc_megatron.recompute import manager as rc

    monkeypatch.setattr(rc, "_NATIVE_REPLAY", False)
    python_steps, python = _replayed_steps(monkeypatch, kind, 2)
    monkeypatch.setattr(rc, "_NATIVE_REPLAY", True)
    native_steps, native = _replayed_steps(
        monkeypatch, kind, 4, between=lambda step: PLANS.clear() if step in (0, 2) else None)
    blocks = python_steps[0][0]
    assert blocks >= 2 and all(s[:2] == (blocks, 0) for s in python_steps), python_steps
    assert [s[:2] for s in native_steps] == [(blocks, 0), (blocks, blocks), (blocks, 0),
                                            (blocks, blocks)], [s[:2] for s in native_steps]
    reference_outputs = python_steps[1][3]
    assert len(reference_outputs) == blocks
    for _, _, unpacked, recomputed in python_steps + native_steps:
        assert unpacked  # (the input norms' saves of y)
        for block, (op, index, size, stride, offset), got in unpacked:
            want = recomputed[block][op][index].as_strided(size, stride, offset)
            assert got.dtype == want.dtype and torch.equal(got, want), (block, op, index)
    for _, _, _, recomputed in native_steps:
        assert len(recomputed) == blocks
        for block, (got_ops, want_ops) in enumerate(zip(recomputed, reference_outputs)):
            assert [[t is None for t in op] for op in got_ops] == \
                [[t is None for t in op] for op in want_ops], block
            assert any(t is not None for op in got_ops for t in op), block
            for op, (got, want) in enumerate(zip(got_ops, want_ops)):
                for got_t, want_t in zip(got, want):
                    if got_t is not None:
                        assert got_t.dtype == want_t.dtype and torch.equal(got_t, want_t), \
                            (block, op)
    _assert_same(python, native)


@pytest.mark.parametrize("kind,family", [("dense", "local"), ("moe", "local"),
                                         ("dense", "no_norm_module"), ("moe", "no_norm_module"),
                                         pytest.param("dense", "te", marks=needs_te),
                                         pytest.param("moe", "te", marks=needs_te)])
def test_narrow_hooks_replace_what_whole_sublayer_hooks_do(megatron_single_rank, monkeypatch,
                                                           kind, family):
    """The hooks on only where mHC outputs are saved (pre, the module that reads ``y``: the
    input norm, or the first linear where the layer has no norm module of its own, as with
    Transformer Engine's fused norms; the combine) against the hooks on over each whole
    sublayer (``set_narrow_hooks(False)``): per block, the same ops' outputs become
    placeholders and the same are held after forward; the same loss and gradients."""
    from mhc_megatron.recompute import manager as rc

    monkeypatch.setattr(rc, "_NARROW_HOOKS", False)
    whole, whole_blocks = _step_blocks(monkeypatch, kind, family)
    monkeypatch.setattr(rc, "_NARROW_HOOKS", True)
    narrow, narrow_blocks = _step_blocks(monkeypatch, kind, family)
    assert narrow_blocks == whole_blocks
    _assert_same(whole, narrow)


def test_manager_is_shared_per_config_and_validates():
    cfg = tiny_config(num_layers=LAYERS, mhc_recompute=True)
    assert manager_for(cfg) is manager_for(cfg)
    assert manager_for(tiny_config(num_layers=LAYERS)) is None
    assert manager_for(cfg).block_size == cfg.mhc_recompute_block_size == round(
        math.sqrt(4 * LAYERS / 6))
    with pytest.raises(ValueError, match="block_size"):
        MHCRecomputeManager(0)


def test_with_megatron_layernorm_recompute(megatron_single_rank, monkeypatch):
    """Megatron's selective "layernorm" recompute (CheckpointWithoutOutput) inside our blocks:
    its saved input is the aggregated y, which our recompute restores first."""
    from megatron.core import tensor_parallel

    init = tensor_parallel.CheckpointWithoutOutput.__init__
    # Megatron 0.19 pitfall: the default fp8=False means "fp8 on" and needs TE; None = off.
    monkeypatch.setattr(tensor_parallel.CheckpointWithoutOutput, "__init__",
                        lambda self, fp8=None: init(self, fp8=fp8))
    extra = dict(recompute_granularity="selective", recompute_modules=["layernorm", "core_attn"],
                 num_layers=3)
    plain = _grads(tiny_config(**extra))
    rec = _grads(tiny_config(mhc_recompute=True, mhc_recompute_layer_num=2, **extra))
    _assert_same(plain, rec)


def test_with_megatron_moe_recompute(megatron_single_rank):
    extra = dict(recompute_granularity="selective", recompute_modules=["moe", "core_attn"],
                 num_layers=3, **moe_overrides())
    _assert_same(_grads(tiny_config(**extra)),
                 _grads(tiny_config(mhc_recompute=True, mhc_recompute_layer_num=2, **extra)))


@needs_te
@pytest.mark.parametrize("mhc_recompute", [False, True])
def test_te_layernorm_recompute(megatron_single_rank, mhc_recompute):
    """TE spec, MoE layers (whose pre-MLP norm is a standalone TENorm, so Megatron's
    "layernorm" recompute applies to it; the attention norm is fused into linear_qkv), with
    and without our cross-layer recompute: gradients equal the run without any recompute."""
    extra = dict(num_layers=3, **moe_overrides())
    plain = _grads(tiny_config(**extra), te=True)
    cfg = tiny_config(recompute_granularity="selective", recompute_modules=["layernorm"],
                      mhc_recompute=mhc_recompute, mhc_recompute_layer_num=2, **extra)
    recomputed = _grads(cfg, te=True)
    layers = recomputed[2].decoder.layers
    assert all(layer.recompute_pre_mlp_layernorm for layer in layers)
    _assert_same(plain, recomputed)


def _count_layer_forwards(model) -> list[int]:
    counts = [0] * len(model.decoder.layers)
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("method,layers", [("uniform", 1), ("uniform", 3), ("block", 1),
                                           ("block", 4)])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_full_recompute_equals_no_recompute(megatron_single_rank, method, layers, kind):
    """Megatron's full recompute (``recompute_granularity="full"``, its reentrant checkpoint
    of whole layers, the n-stream state crossing each chunk boundary): the same loss and
    every gradient as no recompute, over two steps on the same model (nothing stale between
    steps), and the checkpointed layers really ran twice per step. (With ``mhc_recompute``
    it is refused: tests/test_config.py.)"""
    extra = moe_overrides() if kind == "moe" else {}
    base = tiny_config(num_layers=LAYERS, **extra)
    full = tiny_config(num_layers=LAYERS, recompute_granularity="full", recompute_method=method,
                       recompute_num_layers=layers, **extra)
    runs = []
    for cfg in (base, full):
        setup_cpu_megatron(seed=7)
        model = build_gpt(cfg, DEV)
        counts = _count_layer_forwards(model)
        steps = []
        for data_seed in (3, 4):
            model.zero_grad(set_to_none=True)
            loss = lm_loss(model, batch(device=DEV, seed=data_seed))
            loss.backward()
            steps.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                          model))
        runs.append((steps, counts))
    (plain_steps, plain_counts), (full_steps, full_counts) = runs
    for plain, recomputed in zip(plain_steps, full_steps):
        _assert_same(plain, recomputed)
    assert plain_counts == [2] * LAYERS
    checkpointed = set(range(LAYERS)) if method == "uniform" else set(range(layers))
    assert full_counts == [4 if i in checkpointed else 2 for i in range(LAYERS)], full_counts


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_recompute_replays_the_aggregate_not_the_projection(megatron_single_rank, monkeypatch,
                                                             kind):
    """The replay of pre recomputes ``y`` by the aggregate alone, from the per-token mappings
    kept in forward: the projection over the streams (and Sinkhorn after it) runs as often with
    ``mhc_recompute`` as without, while the aggregate runs once more per sublayer whose ``y``
    is saved (every one here: Megatron's norm saves its input), and gradients stay equal."""
    from mhc_megatron.kernels import dispatch, reference

    calls = {"project_and_rms": 0, "aggregate": 0}
    for name in calls:
        original = getattr(reference, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(reference, name, counted)
    # REFERENCE_OPS' functions look the reference's up at call time: they count too
    assert dispatch.REFERENCE_OPS.aggregate is not reference.aggregate
    extra = moe_overrides() if kind == "moe" else {}
    runs = {}
    for recompute in (False, True):
        calls.update(project_and_rms=0, aggregate=0)
        cfg = tiny_config(num_layers=LAYERS, mhc_recompute=recompute, mhc_recompute_layer_num=2,
                          **extra)
        runs[recompute] = (_grads(cfg), dict(calls))
    (plain, plain_calls), (rec, rec_calls) = runs[False], runs[True]
    _assert_same(plain, rec)
    sublayers = 2 * LAYERS
    assert plain_calls == {"project_and_rms": sublayers, "aggregate": sublayers}, plain_calls
    assert rec_calls == {"project_and_rms": sublayers, "aggregate": 2 * sublayers}, rec_calls
