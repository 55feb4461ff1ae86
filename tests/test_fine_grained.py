"""mHC layers as Megatron's fine-grained schedule nodes (``overlap_moe_expert_parallel_comm``).

Each layer runs through Megatron's own ``TransformerLayerSchedulePlan`` (its nodes, their
detach-and-hand-back of tensors between nodes, its forward and backward order) with the
callables :mod:`mhc_megatron.layers.fine_grained` builds, on one CPU rank with the reference
ops and no CUDA streams: a stand-in event, Megatron's nodes run ``torch.cuda.stream(None)``
(a no-op) and ``record_stream`` is one here. No node frees its input after forward: Megatron
frees them assuming the alltoall or flex dispatcher and its permuted copies, and on CPU the
allgather dispatcher runs, whose dispatch and experts read their inputs again in backward.
The result must equal the layer's own forward and backward: output, input gradient and
every parameter gradient, bit for bit. The same for a whole model through Megatron's
``TransformerModelChunkSchedulePlan`` (embedding, every layer, the final norm, the loss;
with an MTP depth), the stand-ins extended to the chunk's event and streams. The overlap
itself (CUDA streams, EP=2) needs GPUs: ``tests/distributed/ep_overlap_equivalence.py``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import SEQ, batch, build_gpt, moe_overrides, tiny_config

pytestmark = pytest.mark.usefixtures("seeded")
# The schedules on one CPU rank: on a CUDA host Megatron's RoPE moves its frequencies to the
# GPU at its first forward, and its RNG tracker is CUDA's; there the overlap's GPU test runs.
cpu_rank_only = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CPU-rank test; on GPUs: tests/test_distributed.py's EP-overlap case")


class _Event:
    """Stands in for the chunk's ``torch.cuda.Event`` (one rank, one stream)."""

    def wait(self, stream=None):
        pass

    def record(self, stream=None):
        pass


def _chunk_state(model, mask, rope):
    from megatron.core.models.common.model_chunk_schedule_plan import ModelChunkState

    state = ModelChunkState()
    state.model, state.attention_mask, state.rotary_pos_emb = model, mask, rope
    state.rotary_pos_cos = state.rotary_pos_sin = None
    state.packed_seq_params = state.sequence_len_offset = None
    return state


def _layer_inputs(model, layer, seed):
    g = torch.Generator().manual_seed(seed)
    width = layer.config.hidden_size * (1 if layer.expands_streams else layer.n)
    x = torch.randn(SEQ, 2, width, generator=g)
    dout = torch.randn(SEQ, 2, layer.config.hidden_size * layer.n, generator=g)
    return x, dout


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _eager(layer, batches, mask, rope):
    """Each micro-batch's forward and backward in turn (gradients accumulate)."""
    layer.zero_grad(set_to_none=True)
    outs, dxs = [], []
    for x, dout in batches:
        x = x.clone().requires_grad_()
        out, _ = layer(x, attention_mask=mask, rotary_pos_emb=rope)
        out.backward(dout)
        outs.append(out.detach())
        dxs.append(x.grad)
    return outs, dxs, _grads(layer)


def _scheduled(model, layer, batches, mask, rope):
    """The micro-batches through Megatron's layer schedule plans as the combined 1F1B
    schedule runs them: the first forward alone, then each next forward interleaved with
    the previous micro-batch's backward, node by node, then the last backward alone."""
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerLayerSchedulePlan as Plan,
    )

    from mhc_megatron.layers import fine_grained

    fine_grained.install()
    layer.zero_grad(set_to_none=True)
    state = _chunk_state(model, mask, rope)
    plans = [Plan(layer, _Event(), state, None, None, extra_args={"is_last_layer": False})
             for _ in batches]
    xs = [x.clone().requires_grad_() for x, _ in batches]
    outs, dxs = [], []
    out, _ = Plan.run(plans[0], None, f_input=xs[0])
    outs.append(out.detach())
    for i in range(1, len(batches)):
        out, dx = Plan.run(plans[i], plans[i - 1], f_input=xs[i], b_grad=batches[i - 1][1])
        outs.append(out.detach())
        dxs.append(dx)
    _, dx = Plan.run(None, plans[-1], b_grad=batches[-1][1], is_last_layer_in_bwd=True)
    dxs.append(dx)
    return outs, dxs, _grads(layer)


@pytest.fixture
def cpu_nodes(monkeypatch):
    from megatron.core.models.common import utils

    monkeypatch.setattr(utils.TransformerLayerNode, "_resolve_free_input",
                        staticmethod(lambda *args: False))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)  # no streams


def _assert_same(eager, scheduled):
    (outs, dxs, grads), (outs2, dxs2, grads2) = eager, scheduled
    for a, b in zip(outs + dxs, outs2 + dxs2, strict=True):
        assert torch.equal(a, b)
    assert sorted(grads) == sorted(grads2)
    for n in grads:
        assert torch.equal(grads[n], grads2[n]), n


@cpu_rank_only
@pytest.mark.usefixtures("cpu_nodes")
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("layer_index", [0, 1], ids=["expanding_layer", "layer_2"])
@pytest.mark.parametrize("kind", ["moe", "moe_shared_expert", "dense"])
def test_layer_nodes_equal_the_layer(kind, layer_index, micro_batches):
    """A MoE mHC layer as nodes 1-4 (ours for 1 and 4), a dense one as Megatron's nodes: the
    same outputs, input gradients and parameter gradients, bit for bit, also with the
    second micro-batch's forward interleaved with the first's backward."""
    extra = {} if kind == "dense" else moe_overrides()
    if kind == "moe_shared_expert":
        extra.update(moe_shared_expert_intermediate_size=32)
    model = build_gpt(tiny_config(**extra))
    layer = model.decoder.layers[layer_index]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    rope = model.rotary_pos_emb(SEQ)
    batches = [_layer_inputs(model, layer, seed=10 * layer_index + i) for i in range(micro_batches)]
    eager = _eager(layer, batches, mask, rope)
    assert sum("hyper_connection" in n for n in eager[2]) == 6
    _assert_same(eager, _scheduled(model, layer, batches, mask, rope))


def test_install_routes_mhc_layers_only():
    """After :func:`install` Megatron's ``build_layer_callables`` builds an mHC MoE layer's
    nodes with ours and leaves a layer with mHC off to Megatron's builder."""
    from megatron.core.models.common import fine_grained_callables as fgc

    from mhc_megatron.layers import fine_grained

    fine_grained.install()
    fine_grained.install()  # idempotent: one wrapper
    assert fgc.build_layer_callables.mhc_wraps.__module__ == fgc.__name__
    mhc = build_gpt(tiny_config(**moe_overrides())).decoder.layers[1]
    funcs, _ = fgc.build_layer_callables(mhc)
    assert funcs[0].func is fine_grained._pre_dispatch and funcs[3].func is fine_grained._combine
    plain = build_gpt(tiny_config(**moe_overrides(), enable_hyper_connections=False))
    funcs, _ = fgc.build_layer_callables(plain.decoder.layers[1])
    assert funcs[0].__module__ == "megatron.core.models.gpt.fine_grained_callables"


def _gpt(kind: str):
    """A 2-layer mHC GPT: MoE layers, a dense then a MoE layer (the schedule applies the final
    norm after a MoE last layer only: the config refuses a dense one), or MoE layers with one
    MTP depth."""
    extra = dict(moe_overrides())
    if kind == "mix":
        extra["moe_layer_freq"] = [0, 1]
    if kind == "mtp":
        extra["mtp_num_layers"] = 1
    return build_gpt(tiny_config(**extra))


@cpu_rank_only
@pytest.mark.usefixtures("cpu_nodes")
@pytest.mark.parametrize("kind", ["moe", "mix", "mtp"])
def test_model_schedule_plan_equals_the_model(kind, monkeypatch):
    """Two micro-batches through Megatron's model-chunk schedule plans, the second's forward
    interleaved with the first's backward (``TransformerModelChunkSchedulePlan.run``, as the
    combined 1F1B schedule calls it): per-token losses and every parameter gradient bit for
    bit those of the model's forward and backward, micro-batch after micro-batch (the tied
    embedding to float rounding: its contributions add up in another order)."""
    from megatron.core.models.common import model_chunk_schedule_plan as plans

    from mhc_megatron.layers import fine_grained

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(plans, "get_comp_stream", lambda: None)
    monkeypatch.setattr(plans, "get_comm_stream", lambda: None)
    fine_grained.install()
    model = _gpt(kind)
    data = [batch(batch_size=2, seed=50 + i) for i in range(2)]
    eager = []
    for ids, pos, mask, labels in data:
        out = model(ids, pos, mask, labels=labels)
        out.float().mean().backward()
        eager.append(out.detach())
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    run = plans.TransformerModelChunkSchedulePlan.run
    chunk = [model.build_schedule_plan(ids, pos, mask, labels=labels)
             for ids, pos, mask, labels in data]
    outs = [run(chunk[0], None)]
    outs.append(run(chunk[1], chunk[0], b_grad=torch.full_like(outs[0], 1 / outs[0].numel())))
    run(None, chunk[1], b_grad=torch.full_like(outs[1], 1 / outs[1].numel()))
    for a, b in zip(eager, outs, strict=True):
        assert torch.equal(a, b.detach())
    grads2 = _grads(model)
    assert sorted(grads) == sorted(grads2)
    assert sum("hyper_connection" in n for n in grads) == (18 if kind == "mtp" else 12)
    for n in grads:
        if n == "embedding.word_embeddings.weight":
            # the input embedding and the output layer share it: the schedule adds the four
            # contributions of the two micro-batches in another order than eager backward
            torch.testing.assert_close(grads[n], grads2[n], rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(grads[n], grads2[n]), n


def test_combined_1f1b_schedules_equal_the_plain_schedules():
    """Megatron's combined 1F1B schedules themselves, 4 micro-batches, with mHC models and the
    baselines: without pipelining (MoE, dense then MoE, with an MTP depth) and interleaved
    at PP=2 x 2 virtual stages (MoE): every loss and gradient equals the plain schedule's
    (two CPU ranks, stand-ins for CUDA's streams and events:
    tests/distributed/combined_1f1b_cpu.py)."""
    import os

    from helpers import child_env, run_ranks

    script = os.path.join(os.path.dirname(__file__), "distributed", "combined_1f1b_cpu.py")
    run = run_ranks(2, script, env=child_env(cpu_only=True, MHC_DIST_DEVICE="cpu"), timeout=600)
    assert run.returncode == 0, run.stdout[-6000:]
    expected = [f"combined_1f1b kind={kind} mhc={mhc} " for kind in ("moe", "mix", "mtp")
                for mhc in (True, False)]
    expected += [f"combined_1f1b pp=2 vp=2 kind=moe mhc={mhc} " for mhc in (True, False)]
    for rank in (0, 1):
        for line in expected:
            assert f"PASS rank={rank} {line}" in run.stdout, (line, run.stdout[-3000:])
