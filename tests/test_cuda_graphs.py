"""CUDA graphs with mHC layers (GPU only; the config side is in tests/test_config.py).

Megatron's local per-layer graphs (``cuda_graph_impl="local"``) capture and replay every
``HyperConnectionTransformerLayer``: layer 1 on ``[s, b, C]`` (it expands the embeddings),
the others on ``[s, b, n*C]``, with the Triton kernels inside the graphs. A trained model
with graphs must give the eager model's losses and every gradient (mHC mappings included)
for several optimizer steps. The reference is the eager run of the same model and weights;
the baseline (mHC off) runs through the same check, so a difference that Megatron's graphs
make for any model would show there too.

Each case runs in its own process (tests/gpu_child/cuda_graph_equivalence.py): the graph
record, memory pool and stream of Megatron's local graphs are process-global.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import HAVE_TE, ROOT, child_env, run_child

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
STEPS = 4
LAYERS = 3


def _run_case(mhc: bool, kind: str, dtype: str = "bf16") -> dict:
    cmd = [sys.executable, str(ROOT / "tests/gpu_child/cuda_graph_equivalence.py"),
           "--mhc", str(int(mhc)), "--kind", kind, "--steps", str(STEPS),
           "--layers", str(LAYERS), "--dtype", dtype]
    run = run_child(cmd, child_env(), timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-6000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"\n[cuda graphs] mhc={mhc} {kind} {dtype}: losses eager {result['loss_eager']} "
          f"graph {result['loss_graph']}; max |grad diff| per step "
          f"{[g['max_abs_diff'] for g in result['grads']]}")
    return result


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("mhc", [True, False], ids=["mhc", "baseline"])
def test_local_graphs_equal_eager(kind, mhc):
    """Per-step losses and every gradient bitwise equal to eager, over STEPS steps (graphs
    replayed from step 2 on), every layer graphed."""
    r = _run_case(mhc, kind)
    assert r["graphed_layers"] == LAYERS, "every layer must run from a created CUDA graph"
    assert r["loss_graph"] == r["loss_eager"]
    for step, g in enumerate(r["grads"]):
        if mhc:
            assert g["mhc_params"] == 2 * LAYERS * 3, "phi, alpha, bias of every sublayer"
        assert g["differing"] == [] and g["max_abs_diff"] == 0.0, (step, g)


# ------------------------------------------------------------ Megatron's own training loop
from test_pretrain_example import LOCAL, MHC, corpus, pretrain, shared_run  # noqa: E402,F401,F811

needs_te_graphs = pytest.mark.skipif(
    not HAVE_TE, reason="cuda_graph_impl='transformer_engine' needs Transformer Engine")
GRAPH_IMPLS = [pytest.param("local", id="local"),
               pytest.param("transformer_engine", marks=needs_te_graphs, id="te"),
               pytest.param("full_iteration", id="full_iteration")]
# Megatron refuses full-iteration graphs with its NaN check (a host sync); off in both runs.
IMPL_FLAGS = {"full_iteration": ("--no-check-for-nan-in-loss-and-grad",)}


@pytest.mark.parametrize("impl", GRAPH_IMPLS)
def test_pretrain_with_cuda_graphs_equals_eager(corpus, impl):
    """examples/pretrain_gpt_mhc.py (mHC n=4) with ``--cuda-graph-impl``: every micro-batch
    loss of the graphed run equals the eager run's, bitwise (one GPU; TE's modules for TE's
    graphs, Megatron's local modules otherwise). Megatron captures after its first step(s),
    so the later steps run from the graphs with the weights the optimizer updated."""
    flags = (*MHC, *(() if impl == "transformer_engine" else LOCAL), *IMPL_FLAGS.get(impl, ()))
    eager = shared_run(corpus, *flags, device="cuda")
    graphed = pretrain(corpus, *flags, "--cuda-graph-impl", impl, device="cuda").ok()
    print(f"\n[pretrain cuda graphs {impl}] eager {eager.train}\n graph {graphed.train}")
    assert len(graphed.train) == len(eager.train) > 0
    assert graphed.train == eager.train
