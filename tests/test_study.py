"""examples/mhc_study.py: a smoke run on CPU, its records, its report, its refusals."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT, child_env, run_python

STUDY = ROOT / "examples" / "mhc_study.py"


def _run(*args, timeout=600):
    """The study on CPU (``helpers.run_python``): exit code and output."""
    return run_python(STUDY, *args, env=child_env(cpu_only=True), timeout=timeout)


def test_smoke_study_records_diagnostics_and_reports(tmp_path):
    out = tmp_path / "study"
    variants = ["baseline", "mhc-zero=static:zero,gating:0.01",
                "mhc-dsv4=static:residual,diag:0.95,gating:0.01,variant:deepseek_v4"]
    proc = _run("--preset", "smoke", "--seeds", "1", "--corpus-mb", "2", "--out", str(out),
                "--variants", *variants)
    assert proc.returncode == 0, proc.stdout[-6000:]
    runs = json.loads((out / "study.json").read_text())
    assert [r["variant"] for r in runs] == ["baseline", "mhc-zero", "mhc-dsv4"]
    base, mhc, dsv4 = runs
    assert base["diagnostics"] == [] and base["params"] < mhc["params"]
    # the diagnostics, which only mHC runs take, are timed apart from the training's seconds
    assert 0 <= base["diagnostics_seconds"] < mhc["diagnostics_seconds"]
    assert all(r["seconds"] > 0 for r in runs)
    assert len(mhc["diagnostics"]) == len(mhc["val_steps"]) == 2  # smoke: eval at 3 and 6
    last = mhc["diagnostics"][-1]
    assert len(last["sublayers"]) == 4 and len(last["grad_norms"]) == 4  # 2 layers x 2 sublayers
    assert all(abs(s["h_res_diag_mean"] - 0.25) < 0.05 for s in last["sublayers"])  # zero: 1/n
    assert last["gain"]["backward_max"] == pytest.approx(1.0, abs=1e-4)
    assert all(g["phi"] > 0 for g in last["grad_norms"])
    # the last sublayer's H_res: under the plain sum contraction its gradient vanishes (its
    # columns sum to 1, so it cancels: orders of magnitude below the sublayer before it's);
    # under DeepSeek-V4's learned output head it learns like the others
    plain, head = (run["diagnostics"][-1]["grad_norms"] for run in (mhc, dsv4))
    assert plain[-1]["bias_res"] < 1e-2 * plain[-2]["bias_res"], plain
    assert head[-1]["bias_res"] > 0.1 * head[-2]["bias_res"], head
    assert (out / "study_val_loss.png").exists()
    table = (out / "study.md").read_text()
    assert "| mhc-zero | 1 |" in table and "| mhc-dsv4 | 1 |" in table
    again = _run("--preset", "smoke", "--seeds", "1", "--corpus-mb", "2", "--out", str(out),
                 "--variants", *variants)
    assert again.returncode == 0 and len(json.loads((out / "study.json").read_text())) == 3  # resumed


def test_bad_variant_is_refused_before_training(tmp_path):
    proc = _run("--preset", "smoke", "--out", str(tmp_path), "--variants", "x=colour:red")
    assert proc.returncode != 0 and "unknown key 'colour'" in proc.stdout


def test_parser_takes_exact_names_only():
    """--seed is the demo's seed (never an abbreviation of --seeds), both keep their values,
    and an abbreviation of a study flag is refused rather than guessed."""
    sys.path.insert(0, str(ROOT / "examples"))
    import mhc_study

    args = mhc_study.parse_args(["--seeds", "2", "--seed", "4242", "--preset", "smoke"])
    assert (args.seeds, args.seed) == (2, 4242)
    args = mhc_study.parse_args(["--seed", "7", "--preset", "smoke"])
    assert (args.seeds, args.seed) == (3, 7)
    with pytest.raises(SystemExit):
        mhc_study.parse_args(["--seed", "7", "--variant", "baseline"])
