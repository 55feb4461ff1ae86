"""Multi-rank equivalence tests of Megatron-Core's ``HybridModel`` with mHC: each launches
``tests/distributed/hybrid_equivalence.py`` on 2 ranks with some of its sections and checks
every section's PASS lines on both ranks. The reference of every parallel layout is the
single-rank hybrid model (and, for the GPT checkpoint conversion, the GPT mHC model).

Set-ups as ``tests/test_distributed.py``: ``cpu`` (2 CPU ranks over gloo with the reference
ops; CI), ``cuda-local`` / ``cuda-te`` (2 GPUs over NCCL with the Triton kernels, Megatron's
local modules / Transformer Engine's specs; skipped with fewer than 2 CUDA devices).
"""

from __future__ import annotations

import re

import pytest
from test_distributed import SETUPS, _expect, _torchrun

SCRIPT = "hybrid_equivalence.py"


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_hybrid_tensor_and_expert_parallel_match_single_rank(setup):
    """TP=2 == TP=1 (loss and every gradient): ``*-*-`` without and with sequence parallel,
    ``*E*E`` with it, both with mHC recompute and with Megatron's full recompute. EP=2 == EP=1
    for ``*E*E`` (per-rank loss, expert and dense gradients; alltoall on GPUs only)."""
    out = _torchrun(SCRIPT, setup, "tp,ep")
    _expect(out, [f"tp=2 pattern={re.escape(pattern)} sp={sp} recompute={rc} "
                  for pattern, sp, rc in (
                      ("*-*-", False, False), ("*-*-", True, False), ("*E*E", True, False),
                      ("*-*-", True, True), ("*E*E", True, True), ("*-*-", False, "full"),
                      ("*E*E", True, "full"))])
    dispatchers = ["allgather"] + (["alltoall"] if setup != "cpu" else [])
    _expect(out, [rf"ep=2 pattern={re.escape('*E*E')} dispatcher={d} recompute={rc} "
                  for d in dispatchers for rc in (False, True)])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_hybrid_pipeline_parallel_matches_single_rank(setup):
    """PP=2 with the pattern split by ``|`` == PP=1 through Megatron's schedules, 4
    micro-batches (every micro-batch loss, every gradient): ``*-|*-`` and ``*E|*E`` (1F1B),
    ``*-|*-|*-|*-`` and ``*E|*E|*E|*E`` over 2 virtual stages (interleaved), an MTP depth
    ``*-|*-/*-``, and with mHC recompute blocks counted per pipeline chunk."""
    out = _torchrun(SCRIPT, setup, "pp")
    _expect(out, [f"pp=2 vp={vp} pattern={re.escape(pattern)} recompute={rc} "
                  for pattern, vp, rc in (
                      ("*-|*-", None, False), ("*-|*-|*-|*-", 2, False), ("*E|*E", None, False),
                      ("*E|*E|*E|*E", 2, False), ("*-|*-/*-", None, False),
                      ("*-|*-", None, True), ("*-|*-|*-|*-", 2, True), ("*E|*E", None, True),
                      ("*-|*-/*-", None, True))])


@pytest.mark.distributed
@pytest.mark.parametrize("setup", SETUPS)
def test_hybrid_checkpoints_load_across_layouts(setup, tmp_path):
    """The hybrid model's distributed checkpoint: ``*-*-`` TP=2 -> TP=1 -> PP=2 (``*-|*-``),
    ``*E*E`` TP=2 -> TP=1; a GPT mHC checkpoint saved at TP=2 (dense, with an MTP depth, with
    ``non_homogeneous_layers`` metadata, MoE every other layer) into the hybrid model of
    ``gpt_hybrid_layer_pattern`` at TP=1 and PP=2. Bitwise weights, the saving model's logits."""
    out = _torchrun(SCRIPT, setup, "ckpt,gpt", str(tmp_path))
    _expect(out, [f"ckpt kind={kind} TP={a},PP={b}->TP={c},PP={d} " for kind, a, b, c, d in (
        ("dense", 2, 1, 1, 1), ("dense", 1, 1, 1, 2), ("moe", 2, 1, 1, 1))])
    _expect(out, [f"gpt->hybrid kind={kind} TP=2->TP=1,PP={pp} "
                  for kind in ("dense", "mtp", "dense_non_homogeneous", "moe_freq2")
                  for pp in (1, 2)])
