"""The benchmark scripts run on CPU (``--smoke`` sizes) and print complete tables.

Not timings: a check that ``bench_e2e.py``'s ways of running (one process, a child process
per run, interleaved rounds) and ``bench_host.py``'s op table still work after a change, so a
GPU session does not find a broken script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(*argv: str, env: dict | None = None) -> str:
    """Run a benchmark script in a child process. Not with this process's MASTER_PORT (set
    when an earlier test started the one-rank process group): the child's group would try
    to listen on the port this process holds."""
    base = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**base, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {first_cell} |")]


@pytest.mark.parametrize("mode", [(), ("--isolate",), ("--interleave", "2")],
                         ids=["one-process", "isolate", "interleave"])
def test_bench_e2e_smoke_prints_every_run(mode, tmp_path):
    out = tmp_path / "e2e.md"
    run_script("benchmarks/bench_e2e.py", "--smoke", "--configs", "dense", "--specs", "local",
               "--steps", "1", "--warmup", "1", "--out", str(out), *mode)
    text = out.read_text()
    rows = table_rows(text, "dense")
    assert [r[2] for r in rows] == ["baseline", "mHC", "mHC + recompute"]
    for r in rows:
        assert float(r[3]) > 0  # step ms
    assert rows[0][6] == "1.000x" and re.fullmatch(r"\d+\.\d{3}x", rows[2][7])
    if "--interleave" in mode:
        assert text.count("round medians") == 3


def test_bench_e2e_interleave_refuses_profile():
    proc = subprocess.run([sys.executable, "benchmarks/bench_e2e.py", "--smoke", "--profile",
                           "--interleave", "2"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--interleave" in proc.stderr


def test_bench_host_op_table_on_the_interpreter(tmp_path):
    out = tmp_path / "host.md"
    run_script("benchmarks/bench_host.py", "--tokens", "8", "--hidden", "64", "--iters", "2",
               "--no-models", "--out", str(out), env={"TRITON_INTERPRET": "1"})
    rows = {r[0]: r for r in (line.strip("|").split("|") for line in out.read_text().splitlines()
                              if line.startswith("| pre") or line.startswith("| combine"))}
    names = [name.strip() for name in rows]
    assert names == ["pre forward (autograd apply)", "pre backward",
                     "combine forward (autograd apply)", "combine backward"]


def test_probe_sinkhorn_kernels_equal_the_reference():
    """The probe times copies of the Sinkhorn chain in two layouts; on the interpreter its
    ``--check`` holds all four (forward and backward) to the reference Sinkhorn."""
    out = run_script("benchmarks/probe_sinkhorn.py", "--check", env={"TRITON_INTERPRET": "1"})
    assert "probe kernels equal the reference Sinkhorn" in out



def test_probe_combine_bwd_variants_agree_with_the_shipped_kernel():
    """The probe's ``--check`` (interpreter) holds the shipped combine backward to torch math
    and every variant it times to the shipped kernel: none WRONG, none FAILED to build."""
    out = run_script("benchmarks/probe_combine_bwd.py", "--check", env={"TRITON_INTERPRET": "1"})
    rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert len(rows) >= 2 * 40, out[-2000:]  # two sizes, every variant
    assert all(row.rstrip(" |").split("|")[-1].strip().startswith("dx, df") for row in rows), \
        [row for row in rows if "WRONG" in row or "FAILED" in row]


def test_probe_pre_loops_variants_agree_with_the_shipped_kernels():
    """``probe_pre_loops.py --check`` (interpreter): every variant of ``_dhpre_partial`` and
    ``_proj_partial`` it times gives the shipped kernel's partials."""
    out = run_script("benchmarks/probe_pre_loops.py", "--check", env={"TRITON_INTERPRET": "1"})
    rows = table_rows(out, "_dhpre_partial") + table_rows(out, "_proj_partial")
    assert len(rows) == 2 * 5, out[-2000:]


def test_probe_l2_order_variants_agree_with_the_shipped_kernels():
    """``probe_l2_order.py --check`` (interpreter): the forward chain in the old (column
    stripe) and all-up orders, the backward chain walking down, and both folds of the
    combine's dx into pre's dx pass give the shipped kernels' outputs (the fold to bf16
    rounding) at both check sizes."""
    out = run_script("benchmarks/probe_l2_order.py", "--check", env={"TRITON_INTERPRET": "1"})
    rows = [line for line in out.splitlines() if line.startswith("| ") and "chain" not in line]
    assert len(rows) == 2 * 13, out[-2000:]
    assert sum("fold, all streams a program" in row for row in rows) == 2
