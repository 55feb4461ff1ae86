"""The README's usage snippet runs exactly as written: on CPU here, under torchrun on a GPU."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- readme-snippet: usage"


def readme_usage_snippet() -> str:
    """The first ```python block after the usage marker in README.md."""
    text = README.read_text()
    assert MARKER in text, f"README.md lost its '{MARKER}' marker"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.DOTALL)
    assert block, "no ```python block after the usage marker"
    return block.group(1)


def test_readme_usage_snippet_runs(tmp_path):
    script = tmp_path / "readme_usage.py"
    script.write_text(readme_usage_snippet())
    # A fresh process as a user would start it: none of this test process's group settings.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if torch.cuda.is_available():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=1", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    found = re.search(r"mHC GPT on (\w+): loss ([\d.]+), 4 streams", run.stdout)
    assert found, run.stdout[-3000:]
    assert found.group(1) == ("cuda" if torch.cuda.is_available() else "cpu")
    # An untrained model predicts about uniformly over the 32000-token vocabulary.
    assert abs(float(found.group(2)) - math.log(32000)) < 1.0
