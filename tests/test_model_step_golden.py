"""The host path of the mHC ops changes no bit of a model step (GPU).

``tests/gpu_child/model_step_digest.py`` runs one forward and backward of a 4-layer mHC GPT
(Triton kernels, bf16, with and without ``mhc_recompute``) and digests the loss's bits and
every parameter gradient's bytes. ``tests/golden/model_step_digest.json`` holds the digests of
the code before its host path was made faster (launch keys, the direct C launch, cached
dispatch), computed on the GPU and with the torch and triton versions named in it (an H200,
where the code after the change gave the same digests in the same run): the current code must
give the same bits there. Elsewhere the test is skipped (Triton compiles per architecture and
version, cuBLAS may pick other GEMM kernels on another GPU model); there, run the script from
the code before and after a change and compare, or regenerate the file from a revision known to
be right.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env, needs_gpu, run_child

GOLDEN = Path(__file__).resolve().parent / "golden" / "model_step_digest.json"
SCRIPT = ROOT / "tests" / "gpu_child" / "model_step_digest.py"


@needs_gpu
def test_model_step_bits_equal_the_golden(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    import triton

    here = (torch.cuda.get_device_name(), list(torch.cuda.get_device_capability()),
            {"torch": torch.__version__, "triton": triton.__version__})
    want = (golden["device"], golden["capability"], golden["versions"])
    if here != want:
        pytest.skip(f"the golden digests are for {want}; this is {here}: run "
                    "tests/gpu_child/model_step_digest.py from the code before and after a "
                    "change on this GPU and compare")
    out = tmp_path / "digest.json"
    run = run_child([sys.executable, str(SCRIPT), str(out)], child_env(), timeout=600)
    assert run.returncode == 0, run.stdout[-4000:]
    got = json.loads(out.read_text())
    for name, want in golden["runs"].items():
        have = got["runs"][name]
        assert have["loss"] == want["loss"], (name, float.fromhex(have["loss"]),
                                              float.fromhex(want["loss"]))
        differ = sorted(p for p in want["grads"] if have["grads"].get(p) != want["grads"][p])
        assert not differ and have["grads"].keys() == want["grads"].keys(), (name, differ)
