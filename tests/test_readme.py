"""The README's code runs as written.

* ``usage`` and ``hybrid-usage``: the Python snippets (the second continues the first), as a
  plain ``python`` process on CPU and under ``torchrun`` on a GPU host;
* ``cpu-smoke``: the CPU smoke run of ``examples/pretrain_gpt_mhc.py`` (Megatron's training
  loop on one gloo rank), on any machine (CUDA hidden);
* ``gpu-pretrain``: the GPU pretraining commands (data parallel with the distributed
  optimiser, then pipeline parallel), on a host with 2 or more GPUs and Transformer Engine.

Each bash block runs in a fresh directory holding a link to the repository's ``examples/``,
as the README's commands would from the repository root, with ``python`` and ``torchrun`` of
this interpreter first on ``PATH`` (what ``source .venv/bin/activate`` gives).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HAVE_TE, LAUNCH_VARIABLES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_block(name: str, language: str) -> str:
    """The first ```language block after the ``<!-- readme-snippet: name`` marker."""
    text = README.read_text()
    marker = f"<!-- readme-snippet: {name}"
    assert marker in text, f"README.md lost its '{marker}' marker"
    block = re.search(rf"```{language}\n(.*?)```", text[text.index(marker):], re.DOTALL)
    assert block, f"no ```{language} block after the '{marker}' marker"
    return block.group(1)


def user_env(**extra: str) -> dict[str, str]:
    """A fresh process's environment, as a user would start it: none of this test process's
    process-group settings."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {**env, **extra}


def run_bash_block(name: str, workdir: Path, timeout: int, **env: str) -> str:
    """Run the README's bash block ``name`` in ``workdir`` as a user would from the repository
    root; returns its output, asserting it exits 0."""
    (workdir / "examples").symlink_to(ROOT / "examples")
    bindir = workdir / "bin"
    bindir.mkdir()
    for tool, command in (("python", ""), ("torchrun", " -m torch.distributed.run")):
        (bindir / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bindir / tool).chmod(0o755)
    script = workdir / f"readme_{name}.sh"
    script.write_text("set -euo pipefail\n" + readme_block(name, "bash"))
    path = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    run = subprocess.run(["bash", str(script)], cwd=workdir, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout,
                         env=user_env(PATH=path, **env))
    assert run.returncode == 0, run.stdout[-8000:]
    return run.stdout


def lm_losses(log: str) -> list[float]:
    """The training losses Megatron logs (``lm loss: 4.1E+00``), in order."""
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", log)]


def test_readme_usage_snippet_runs(tmp_path):
    script = tmp_path / "readme_usage.py"
    script.write_text(readme_block("usage", "python") + readme_block("hybrid-usage", "python"))
    if torch.cuda.is_available():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=1", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    run = subprocess.run(cmd, cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    found = re.search(r"mHC GPT on (\w+): loss ([\d.]+), 4 streams", run.stdout)
    assert found, run.stdout[-3000:]
    assert found.group(1) == ("cuda" if torch.cuda.is_available() else "cpu")
    # An untrained model predicts about uniformly over the 32000-token vocabulary.
    assert abs(float(found.group(2)) - math.log(32000)) < 1.0
    hybrid = re.search(r"mHC HybridModel on (\w+): loss ([\d.]+)", run.stdout)
    assert hybrid and hybrid.group(1) == found.group(1), run.stdout[-3000:]
    assert abs(float(hybrid.group(2)) - math.log(32000)) < 1.0


@pytest.mark.skipif(HAVE_TE, reason="the CPU smoke run is for machines without Transformer "
                    "Engine: with TE importable, Megatron's optimiser takes TE's CUDA-only "
                    "multi-tensor kernels (GPU hosts run the gpu-pretrain commands instead)")
def test_readme_cpu_smoke_run(tmp_path):
    """Megatron's ``pretrain`` with the mHC flags on one CPU rank: 10 steps, evaluation,
    the reference ops, a falling loss."""
    log = run_bash_block("cpu-smoke", tmp_path, timeout=900, CUDA_VISIBLE_DEVICES="")
    assert "mhc_kernel_backend='auto' runs the reference ops on cpu" in log, log[-4000:]
    assert re.search(r"iteration\s+10/\s+10 ", log), log[-4000:]
    assert "validation loss at iteration 10" in log, log[-4000:]
    losses = lm_losses(log)
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), log[-4000:]
    # Byte-level data: an untrained model starts near ln(257); 10 steps bring it down.
    assert losses[0] < math.log(257) + 0.5 and losses[-1] < losses[0], losses


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not HAVE_TE,
                    reason="needs 2 CUDA devices and Transformer Engine")
def test_readme_gpu_pretrain_commands(tmp_path):
    """The README's 2-GPU pretraining: DP=2 with the distributed optimiser, then PP=2; each
    trains to the end with the Triton kernels, saves its checkpoint and its loss falls."""
    log = run_bash_block("gpu-pretrain", tmp_path, timeout=1500)
    runs = re.split(r"using world size: ", log)[1:]  # Megatron's first line of each run
    assert len(runs) == 2, log[-6000:]
    for run, layout in zip(runs, (r"data-parallel size: 2", r"pipeline-model-parallel size: 2")):
        assert re.search(layout, run), run[:2000]
        assert "runs the triton ops on cuda" in run, run[-6000:]
        assert re.search(r"iteration\s+200/\s+200 ", run), run[-6000:]
        assert "successfully saved checkpoint" in run, run[-6000:]
        losses = lm_losses(run)
        assert len(losses) >= 4 and all(math.isfinite(v) for v in losses), run[-6000:]
        assert losses[-1] < losses[0] - 1.0, losses
