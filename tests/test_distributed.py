"""Multi-rank tests: launched with torchrun as 2 CPU ranks over gloo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(script: str, timeout: int = 600) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--standalone", os.path.join(HERE, "distributed", script)]
    # Two CPU ranks over gloo, also on a GPU host (which may have a single GPU).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed (rc={proc.returncode}):\n{out[-6000:]}"
    return out


@pytest.mark.distributed
def test_tensor_parallel_matches_single_rank():
    out = _torchrun("tp_equivalence.py")
    for kind, sp, recompute in (("dense", False, False), ("dense", True, False),
                                ("moe", True, False), ("dense", True, True), ("moe", True, True)):
        for rank in (0, 1):
            assert f"PASS rank={rank} kind={kind} sp={sp} recompute={recompute}" in out, \
                out[-3000:]
