"""examples/mhc_study.py: a smoke run on CPU, its records, its report, its refusals."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT, child_env, run_child

STUDY = ROOT / "examples" / "mhc_study.py"


def _run(*args, timeout=600):
    return run_child([sys.executable, str(STUDY), *args], child_env(cpu_only=True), timeout)


def test_smoke_study_records_diagnostics_and_reports(tmp_path):
    out = tmp_path / "study"
    proc = _run("--preset", "smoke", "--seeds", "1", "--corpus-mb", "2", "--out", str(out),
                "--variants", "baseline", "mhc-zero=static:zero,gating:0.01")
    assert proc.returncode == 0, proc.stdout[-6000:]
    runs = json.loads((out / "study.json").read_text())
    assert [r["variant"] for r in runs] == ["baseline", "mhc-zero"]
    base, mhc = runs
    assert base["diagnostics"] == [] and base["params"] < mhc["params"]
    assert len(mhc["diagnostics"]) == len(mhc["val_steps"]) == 2  # smoke: eval at 3 and 6
    last = mhc["diagnostics"][-1]
    assert len(last["sublayers"]) == 4 and len(last["grad_norms"]) == 4  # 2 layers x 2 sublayers
    assert all(abs(s["h_res_diag_mean"] - 0.25) < 0.05 for s in last["sublayers"])  # zero: 1/n
    assert last["gain"]["backward_max"] == pytest.approx(1.0, abs=1e-4)
    assert all(g["phi"] > 0 for g in last["grad_norms"])
    assert (out / "study_val_loss.png").exists()
    assert "| mhc-zero | 1 |" in (out / "study.md").read_text()
    again = _run("--preset", "smoke", "--seeds", "1", "--corpus-mb", "2", "--out", str(out),
                 "--variants", "baseline", "mhc-zero=static:zero,gating:0.01")
    assert again.returncode == 0 and len(json.loads((out / "study.json").read_text())) == 2  # resumed


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
