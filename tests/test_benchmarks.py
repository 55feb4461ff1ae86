"""The benchmark scripts run on CPU (``--smoke`` sizes) and print complete tables.

Not timings: a check that ``bench_e2e.py``'s ways of running (one process, a child process
per run, interleaved rounds), ``bench_host.py``'s op table and the two report scripts still
work after a change, so a run on a GPU host does not find a broken script.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env, interpreter_child_env, run_python

ROOT = Path(__file__).resolve().parents[1]


def run_script(*argv: str, env: dict | None = None) -> str:
    """Run a benchmark script in a child process; its stdout. Not with a MASTER_PORT of this
    process's environment (a launcher's): the child's one-rank group would try to listen on
    the port the launcher holds, where without it the group runs on a store of its own."""
    base = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**base, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def run_report_script(*argv: str, cpu_only: bool = False, interpreter: bool = False) -> None:
    """Run a benchmark script whose report the test reads from its ``--out`` file in a process
    of its own (``helpers.run_python``: on a CPU host forked from the tests' fork server, where
    torch and Megatron are imported already), with the tests' child environment (no
    MASTER_PORT; CUDA hidden where there is none, and with ``cpu_only`` also on a GPU host: the
    scripts' CPU runs). ``interpreter``: the kernels on Triton's interpreter, CUDA hidden
    (``helpers.interpreter_child_env``: the test is skipped where such a child cannot run
    them)."""
    env = interpreter_child_env() if interpreter else child_env(
        cpu_only=cpu_only or not torch.cuda.is_available())
    run = run_python(*argv, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:]


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {first_cell} |")]


@pytest.mark.parametrize("mode", [(), ("--isolate",), ("--interleave", "2")],
                         ids=["one-process", "isolate", "interleave"])
def test_bench_e2e_smoke_prints_every_run(mode, tmp_path):
    out = tmp_path / "e2e.md"
    run_report_script("benchmarks/bench_e2e.py", "--smoke", "--configs", "dense", "--specs",
                      "local", "--steps", "1", "--warmup", "1", "--out", str(out), *mode)
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
    """The op table (with the dense mHC models' sublayers as their layers run them, chained),
    and ``--launch-ab``'s table of the two launch modes (on the interpreter
    both launch through Triton's own launcher: the plumbing only); ``--replay-ab`` says why
    there is no replay from C++ on the interpreter; the model table, each model's growth per
    sublayer the median of its paired steps' differences with their interquartile range."""
    out = tmp_path / "host.md"
    run_report_script("benchmarks/bench_host.py", "--tokens", "8", "--hidden", "64", "--iters",
                      "2", "--launch-ab", "--replay-ab", "--split", "--rounds", "2", "--out",
                      str(out), interpreter=True)
    text, models = out.read_text().split("| model (4 layers, local specs) |")
    for kind in ("dense", "moe"):
        (row,) = table_rows(models, kind)
        assert [float(c.split(" (")[0]) > 0 for c in row[1:4]] == [True] * 3, row
        for growth in row[4:]:  # "median (q1 to q3)"
            median, q1, q3 = map(float, growth.replace("(", "").replace(")", "").replace(
                " to ", " ").split())
            assert q1 <= median <= q3, row
    text, replay = text.split("replayed from C++ against the Python path")
    replay, split = replay.split("its Python and its C++ replay")
    assert "(no replay here: TRITON_INTERPRET=1)" in replay, replay
    assert "(no replay here: TRITON_INTERPRET=1)" in split, split
    table, ab = text.split("Launches by signature against the per-argument key")
    names = [line.split("|")[1].strip() for line in table.splitlines()
             if line.startswith("| pre") or line.startswith("| combine")]
    assert names == ["pre forward (autograd apply)", "pre backward",
                     "combine forward (autograd apply)", "combine backward"]
    engine = [line for line in table.splitlines() if "| one sublayer through autograd (" in line]
    assert [("; 1 chained" in line, "; 2 chained" in line) for line in engine] == \
        [(True, False), (False, True)], engine  # (8 chained on a GPU)
    chains = [line.split("|") for line in table.splitlines()
              if "'s layer runs it (pre and the combine module calls" in line]
    assert [c[1].split(" as ")[1].split("'s layer")[0] for c in chains] == \
        ["mHC", "mHC + recompute"], chains
    assert all("; 6 chained, one backward call" in c[1] and float(c[2]) > 0 for c in chains)
    nodes = [line for line in table.splitlines() if "pass-through Python autograd node" in line]
    assert [("0 allocations" in line, "4 allocations" in line) for line in nodes] == \
        [(True, False), (False, True)], nodes  # on CPU: one device
    assert all("(cpu tensors; 4 chained" in line for line in nodes), nodes
    assert sum("4 allocations on the calling thread (cpu" in line
               for line in table.splitlines()) == 1
    ab_rows = [line.split("|")[1].strip() for line in ab.splitlines() if line.startswith("| ")]
    assert ab_rows == ["host us", *names, "one sublayer through autograd (2 chained, one "
                       "backward call; per sublayer)",
                       *(f"one sublayer as {name}'s layer runs it (pre and the combine "
                         "module calls around a null body; 6 chained, one backward call; per "
                         "sublayer)" for name in ("mHC", "mHC + recompute")),
                       "dense baseline model step (4 layers), "
                       "ms, min", "dense mHC model step (4 layers), ms, min",
                       "dense mHC + recompute model step (4 layers), ms, min",
                       "mHC's step over the baseline's, per sublayer, us (min)",
                       "mHC + recompute's step over the baseline's, per sublayer, us (min)",
                       "mHC's step over the baseline's, per sublayer, us (median of step "
                       "pairs, interquartile range)",
                       "mHC + recompute's step over the mHC's, per sublayer, us (median of "
                       "step pairs, interquartile range)"], ab_rows


def test_bench_study_step_on_cpu(tmp_path):
    """The study step's table (smoke preset on CPU: the plumbing only): baseline, mHC and mHC +
    recompute, each against the baseline, also paired round by round."""
    out = tmp_path / "study.md"
    run_report_script("benchmarks/bench_study_step.py", "--preset", "smoke", "--device", "cpu",
                      "--precision", "fp32", "--rounds", "1", "--steps", "2", "--warmup", "1",
                      "--recompute", "--out", str(out), cpu_only=True)
    rows = [line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| baseline") or line.startswith("| mHC")]
    assert [r[1].strip() for r in rows] == ["baseline", "mHC", "mHC + recompute"], rows
    assert rows[0][5].strip() == "1.000x" and all(float(r[2]) > 0 for r in rows)
    # paired: the baseline against itself, round by round
    assert rows[0][7].strip() == "1.000x (1.000-1.000)", rows[0]


def test_bench_study_step_spans_on_cpu(tmp_path):
    """``--spans --module-spans --python-hooks --python-replays --whole-sublayer-hooks``: the
    runs' table with the Python-hooks, Python-replays and whole-sublayer-hooks runs,
    the host time of the phases and of the calls in the forward, and of each module class's
    forward calls, a column per run (the plumbing only)."""
    out = tmp_path / "study.md"
    run_report_script("benchmarks/bench_study_step.py", "--preset", "smoke", "--device", "cpu",
                      "--precision", "fp32", "--rounds", "1", "--steps", "2", "--warmup", "1",
                      "--recompute", "--python-hooks", "--python-replays",
                      "--whole-sublayer-hooks", "--spans",
                      "--module-spans", "--out", str(out), cpu_only=True)
    text = out.read_text()
    names = ["baseline", "mHC", "mHC + recompute", "mHC + recompute, Python hooks",
             "mHC + recompute, blocks replayed in Python",
             "mHC + recompute, hooks over the sublayer"]
    assert all(table_rows(text, name) for name in names[3:])
    (header,) = [line for line in text.splitlines() if line.startswith("| | ")]
    assert [c.strip() for c in header.strip("|").split("|")][1:] == names
    (pre,) = table_rows(text, "mHC pre, us a call")
    assert pre[1] == "-" and all(float(c) > 0 for c in pre[2:]), pre
    (layer,) = table_rows(text, "a layer's forward, us a call")
    assert all(float(c) > 0 for c in layer[1:]), layer
    (phases,) = table_rows(text, "forward / backward / optimiser, ms")
    assert all(len(c.split(" / ")) == 3 for c in phases[1:]), phases
    # --module-spans: every run calls the model once a step; only mHC's runs have its module
    (model,) = table_rows(text, "GPTModel")
    assert all(c.startswith("1; ") for c in model[1:]), model
    (hc,) = table_rows(text, "HyperConnectionModule")
    assert hc[1] == "-" and all(c != "-" for c in hc[2:]), hc


def test_bench_study_step_phases_and_null_ops_on_cpu(tmp_path):
    """``--phases --null-ops``: the runs' table with mHC with null ops, and the phases' table,
    each phase's host ms (its GPU ms "-" on the CPU), a row per run (the plumbing only);
    ``--phases`` refuses ``--overlap``."""
    out = tmp_path / "study.md"
    run_report_script("benchmarks/bench_study_step.py", "--preset", "smoke", "--device", "cpu",
                      "--precision", "fp32", "--rounds", "1", "--steps", "2", "--warmup", "1",
                      "--phases", "--null-ops", "--out", str(out), cpu_only=True)
    text = out.read_text()
    runs, phases = text.split("Each phase's host time and GPU time")
    assert [r[1].strip() for r in (line.split("|") for line in runs.splitlines())
            if r[1:] and r[1].strip() in ("baseline", "mHC", "mHC, null ops")] == \
        ["baseline", "mHC", "mHC, null ops"], runs
    rows = [line.split("|") for line in phases.splitlines()
            if line.startswith("| baseline") or line.startswith("| mHC")]
    assert [r[1].strip() for r in rows] == ["baseline", "mHC", "mHC, null ops"], rows
    for row in rows:
        for cell in row[2:5]:
            host, gpu = cell.strip().split(" / ")
            assert float(host) > 0 and gpu == "-", row
    proc = subprocess.run([sys.executable, "benchmarks/bench_study_step.py", "--phases",
                           "--overlap"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--overlap" in proc.stderr


def test_bench_study_step_overlapped_loop_on_cpu(tmp_path):
    """``--overlap``: the same table, the losses read a step later (the plumbing only)."""
    out = tmp_path / "study.md"
    run_report_script("benchmarks/bench_study_step.py", "--preset", "smoke", "--device", "cpu",
                      "--precision", "fp32", "--rounds", "2", "--steps", "2", "--warmup", "1",
                      "--overlap", "--out", str(out), cpu_only=True)
    text = out.read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ")][1:]
    assert "losses read a step later" in text
    assert [r[1].strip() for r in rows] == ["baseline", "mHC"], rows
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)


def test_bench_host_breakdown_and_model_profile_on_the_interpreter(tmp_path):
    """``--breakdown`` times the baseline, mHC and mHC with null ops (no kernels) side by
    side; ``--profile-models`` writes the per-step differences of the two models' profiles."""
    out, prof = tmp_path / "host.md", tmp_path / "models.md"
    run_report_script("benchmarks/bench_host.py", "--tokens", "8", "--hidden", "64", "--iters",
                      "2", "--no-models", "--breakdown", "--rounds", "1", "--profile-models",
                      str(prof), "--profile-steps", "3", "--out", str(out),
                      interpreter=True)
    rows = [line.split("|")[1].strip() for line in out.read_text().splitlines()
            if line.startswith("| baseline") or line.startswith("| mHC")]
    assert rows == ["baseline", "mHC", "mHC, null ops"], rows
    # (on CPU the models' backend 'auto' runs the reference ops: no launches to count)
    assert re.search(r"the ops' launches in 10 mHC steps, by path: by signature \d+, "
                     r"per-argument key \d+, Triton's launcher \d+", out.read_text())
    assert re.search(r"chained through autograd alone: the null ops \d+ us, the ops \d+ us; "
                     r"the layer code around the ops less the null ops' own time: -?\d+ us",
                     out.read_text())
    text = prof.read_text()
    assert "extra own us / step" in text and "mhc_megatron" not in text.split("\n")[0]
    assert "layers/hyper_connection.py" in text, text[:2000]


def test_bench_host_grad_fusion_on_the_interpreter(tmp_path):
    """``--grad-fusion`` times the baseline, mHC and mHC with the gradient-accumulation fusion,
    each inside Megatron's DDP, side by side."""
    out = tmp_path / "host.md"
    run_report_script("benchmarks/bench_host.py", "--tokens", "8", "--hidden", "64", "--iters",
                      "2", "--no-models", "--grad-fusion", "--rounds", "1", "--out", str(out),
                      interpreter=True)
    rows = [line.split("|")[1].strip() for line in out.read_text().splitlines()
            if line.startswith("| baseline") or line.startswith("| mHC")]
    assert rows == ["baseline", "mHC", "mHC, gradient_accumulation_fusion"], rows
    assert "the fusion saves" in out.read_text()


def test_bench_host_recompute_split_on_the_interpreter(tmp_path):
    """``--recompute-split`` times the recompute's pieces inside its model steps: two records
    and at least two hook switches a sublayer (pre's and the combine's), and the block
    replays' time within the unpacks' that run them. (On the CPU the models run the reference
    ops, whose saved tensors are their own fp32 copies, not the recorded outputs: no
    placeholders, so nothing to unpack or replay.) ``--recompute-phases`` times the
    recompute's forward and backward apart against mHC's, whole, with its blocks replayed in
    Python, and with its hooks, then its records, switched off; ``--profile-recompute``
    profiles its steps against mHC's; mHC's own forward and backward against the baseline's
    head the phases' table; ``--recompute-chain-parts`` switches the same parts off in mHC's
    sublayers as the layers run them, against mHC's; ``--chain-grad-accumulation`` runs those
    sublayers with the mapping parameters' gradients dropped and accumulated.
    ``--sublayer-split`` times a sublayer's forward pieces in the baseline's and mHC's steps:
    Megatron's sublayer method once a sublayer in both, the whole sublayer, pre and the
    combine once a sublayer in mHC's."""
    out, prof = tmp_path / "host.md", tmp_path / "prof.md"
    run_report_script("benchmarks/bench_host.py", "--tokens", "8", "--hidden", "64", "--iters",
                      "2", "--no-models", "--recompute-split", "--recompute-phases",
                      "--recompute-chain-parts", "--chain-grad-accumulation",
                      "--sublayer-split", "--rounds", "1",
                      "--profile-models", str(prof), "--profile-recompute", "--profile-steps",
                      "2", "--out", str(out), interpreter=True)
    rows_of = [r.split("|") for r in out.read_text().splitlines()]
    # the phases' rows (forward, backward, step) and the chain's (us, over mHC)
    phases = [r for r in rows_of if len(r) == 6 and (
        r[1].strip() in ("mHC over the baseline", "mHC + recompute")
        or r[1].startswith(" recompute, "))]
    assert [r[1].strip() for r in phases] == [
        "mHC over the baseline", "mHC + recompute", "recompute, blocks replayed in Python",
        "recompute, hooks off (ops recorded)",
        "recompute, hooks and records off (block scopes)"], phases
    assert all(len(r) == 6 and all(float(c) == float(c) for c in r[2:5]) for r in phases)
    chain = {r[1].strip(): r for r in rows_of if len(r) == 5 and (
        r[1].strip() in ("mHC", "mHC + recompute") or r[1].startswith(" recompute, "))}
    assert list(chain) == ["mHC", "mHC + recompute", "recompute, blocks replayed in Python",
                           "recompute, hooks off (ops recorded)",
                           "recompute, hooks and records off (block scopes)"], chain
    assert chain["mHC"][3].strip() == "+0.0", chain["mHC"]
    assert all(float(r[2].split()[0]) > 0 for r in chain.values()), chain
    accumulation = [r[1].strip() for r in rows_of if len(r) == 4 and ", gradients " in r[1]]
    assert accumulation == [f"{m}, gradients {g}" for m in ("mHC", "mHC + recompute")
                            for g in ("dropped", "accumulated")], accumulation
    profile = prof.read_text()
    assert "own time a step mHC " in profile and ", mHC + recompute " in profile, profile[:300]
    rows = {r[1].strip(): r for r in (line.split("|") for line in out.read_text().splitlines()
                                      if line.startswith("| forward") or
                                      line.startswith("| backward"))}
    split = {label: rows.pop(label) for label in list(rows) if label.startswith((
        "forward: Megatron's", "forward: the whole", "forward: pre (", "forward: the combine",
        "forward: mHC's own", "forward host time"))}
    assert split.pop(next(k for k in split if k.startswith("forward host time")))
    assert len(rows) == 5, rows
    calls = {label: [c.strip() for c in r[2:4]] for label, r in split.items()}
    assert calls.pop("forward: mHC's own (the whole sublayer minus the baseline's Megatron "
                     "method)")[0] == ""
    assert len(calls) == 4, calls
    for label, (base, mhc) in calls.items():
        assert mhc.endswith("(1.0)"), (label, mhc)
        assert base.endswith("(1.0)") if label.startswith("forward: Megatron's") else \
            base == "-", (label, base)
    records = next(k for k in rows if k.startswith("forward: records of pre's aggregate"))
    assert float(rows[records][3]) == 2.0, rows  # (no call sites here: every call records after)
    assert float(rows["forward: SublayerSaving (hooks pushed)"][3]) == 1.0, rows
    assert float(rows["forward: hooks on / off / close"][3]) >= 2.0, rows
    unpacks = rows["backward: the saved tensors' unpack hook (with the block replays)"]
    replays = rows["backward: the block replays alone"]
    assert float(replays[2]) <= float(unpacks[2]), (replays, unpacks)
    assert "mHC + recompute's step over mHC's" in out.read_text()


def test_profile_native_steps_the_model_and_summarises_py_spys_samples(tmp_path):
    """``profile_native.py run`` steps the dense mHC model in its timed loop (here on the
    CPU, the Triton ops in the interpreter) and says how many steps it took; ``summarize``
    reads py-spy's raw samples: the main thread's inside the loop only, split by mHC's forward
    pieces and their own frames; autograd's device thread's busy samples after the warm-up
    (queue waits and the ops' first Python backward left out), by node, mHC's nodes
    summed."""
    env = interpreter_child_env()
    run = run_python("benchmarks/profile_native.py", "run", "--model", "mhc", "--seconds", "0",
                     "--warmup", "1", "--tokens", "8", "--hidden", "64", env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:]
    assert re.search(r"^mhc: 1 steps, [0-9.]+ ms a step", run.stdout, re.M), run.stdout[-2000:]
    main = "thread (1): MainThread;<module> (/r/profile_native.py:9);timed_loop (/r/p.py:70)"
    node = "thread (2);torch::autograd::Engine::thread_main;torch::autograd::Node::operator()"
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        f"{main};HyperConnectionModule.pre (/m/hyper_connection.py:211);pre (/m/triton_pre.py:356)"
        ";mhc::pre_apply;malloc;0x7f0012 3",
        f"{main};_StreamCombine._combine (/m/transformer_layer.py:163);cuLaunchKernel 1",
        f"{main};RMSNorm.forward (/m/normalization.py:1) 6",
        "thread (1): MainThread;<module> (/r/profile_native.py:9);build (/r/e2e.py:1) 50",
        f"{node};mhc::(anonymous namespace)::PreBackward::apply;mhc::replay;cuLaunchKernel 2",
        f"{node};torch::autograd::generated::MulBackward0::apply 2",
        "thread (2);torch::autograd::Engine::thread_main;torch::autograd::ReadyQueue::pop 10",
        "thread (1);0x7f0001;exit 4",  # (the main thread, its name unseen: neither table's)
        f"{node};torch::autograd::PyNode::apply;_pre_native_backward (/m/triton_pre.py:1) 5",
    ]) + "\n")
    out = tmp_path / "summary.md"
    summary = run_python("benchmarks/profile_native.py", "summarize", str(raw), "--out",
                         str(out), env=env, timeout=120)
    assert summary.returncode == 0, summary.stdout[-2000:]
    rows = {r[0]: r[1] for r in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.read_text().splitlines() if line.startswith("|"))}
    assert rows["main thread, samples in the step loop: 10"] == "share"
    assert rows["pre (the module's call)"] == "30.0%"
    assert rows[". malloc"] == "30.0%"
    assert rows["the combine (the bias-dropout-add slot's call)"] == "10.0%"
    assert rows["autograd's device thread, busy samples after the warm-up: 4"] == "share"
    assert rows["mhc::(anonymous namespace)::PreBackward::apply"] == "50.0%"
    assert rows["mHC's nodes (MHCPreBackward, MHCCombineBackward)"] == "50.0%"
    assert rows[". cuLaunchKernel"] == "50.0%"  # (the nodes' own frames: the last table's)
    (tmp_path / "flat.txt").write_text("process 7;main (/r/a.py:1) 3\n")
    flat = run_python("benchmarks/profile_native.py", "summarize", str(tmp_path / "flat.txt"),
                      env=env, timeout=120)
    assert flat.returncode != 0 and "--threads" in flat.stdout, flat.stdout[-2000:]


def test_profile_native_counts_the_nodes_and_launches_mhc_adds():
    """``profile_native.py counts`` profiles the steps of each model and tabulates, per
    sublayer, the autograd nodes evaluated where the models differ and the kernel launches
    (none on the CPU): mHC's three mapping parameters a sublayer are three more
    ``AccumulateGrad`` nodes."""
    env = child_env(cpu_only=not torch.cuda.is_available())
    out = run_python("benchmarks/profile_native.py", "counts", "--models", "baseline", "mhc",
                     "--steps", "1", "--warmup", "1", "--tokens", "8", "--hidden", "64",
                     env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:]
    rows = {r[0]: r[1:] for r in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.stdout.splitlines() if line.startswith("| "))}
    assert rows["node torch::autograd::AccumulateGrad"][-1] == "+3.00", rows
    if not torch.cuda.is_available():
        assert rows["launches, forward"] == ["0.00", "0.00", "+0.00"], rows


def test_pretrain_report_reproduces_the_committed_table(tmp_path):
    """``pretrain_report.py`` on the committed 2-GPU pretraining logs writes the committed
    ``summary.md`` (the table benchmarks/RESULTS.md cites) and the loss curves."""
    logs = ROOT / "docs" / "results" / "pretrain_2gpu"
    run_script("benchmarks/pretrain_report.py", str(logs), "--out", str(tmp_path))
    assert (tmp_path / "summary.md").read_text() == (logs / "summary.md").read_text()
    assert (tmp_path / "loss_curves.png").stat().st_size > 0


def test_pretrain_report_resume_check(tmp_path):
    """The resume check compares every loss both runs logged: zero where the resumed run
    agrees with the uninterrupted one, the largest difference where one logged loss differs
    (absolute and relative); and a loss-curve PNG per layout. The stand-in resumed runs are
    copies of the committed uninterrupted mHC logs, one with a training loss moved by 0.01."""
    import re
    import shutil

    logs = tmp_path / "logs"
    shutil.copytree(ROOT / "docs" / "results" / "pretrain_2gpu", logs)
    layouts = sorted(p.name[: -len("_mhc.log")] for p in logs.glob("*_mhc.log"))
    assert len(layouts) >= 2, layouts
    for layout in layouts:
        shutil.copy(logs / f"{layout}_mhc.log", logs / f"{layout}_mhc_resumed.log")
    moved = logs / f"{layouts[0]}_mhc_resumed.log"
    text = moved.read_text()
    last = list(re.finditer(r"lm loss: ([0-9.E+-]+) \|", text))[-1]
    loss = float(last.group(1))
    moved.write_text(text[:last.start(1)] + f"{loss + 0.01:.6E}" + text[last.end(1):])
    out = tmp_path / "out"
    out.mkdir()
    run_script("benchmarks/pretrain_report.py", str(logs), "--out", str(out))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (out / "summary.md").read_text().splitlines()
            if line.count("|") == 7 and "iterations compared" not in line and "---" not in line}
    assert sorted(rows) == layouts, rows
    assert rows[layouts[0]][1:] == ["1.00e-02", f"{0.01 / loss:.2e}", "0.00e+00", "0.00e+00"], rows
    for layout in layouts[1:]:
        assert rows[layout][1:] == ["0.00e+00"] * 4, rows
    for layout in layouts:
        assert (out / f"loss_curves_{layout}.png").stat().st_size > 0


def test_compare_runs_table_and_plot(tmp_path):
    """``compare_runs.py`` on two demo-style result folders: each run against the first
    label's run of the same model, and the plot."""
    def results(path, losses):
        path.mkdir()
        runs = [{"name": name, "steps": list(range(1, 5)), "seconds": 2.0,
                 "val_steps": [2, 4], "val_loss": vals} for name, vals in losses]
        args = {"layers": 2, "hidden": 64, "seq": 32, "batch": 4}
        (path / "results.json").write_text(json.dumps(
            {"device": "CPU", "args": args, "runs": runs}))

    results(tmp_path / "a", [("baseline", [2.0, 1.5]), ("mHC", [2.0, 1.4])])
    results(tmp_path / "b", [("baseline", [2.0, 1.6]), ("mHC", [2.0, 1.3])])
    plot = tmp_path / "cmp.png"
    out = run_script("benchmarks/compare_runs.py", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}",
                     "--out", str(plot))
    rows = {" ".join(line.split("|")[0].split()): line.split("|")[1:]
            for line in out.splitlines() if "|" in line}
    assert float(rows["b baseline"][1]) == pytest.approx(0.1)
    assert float(rows["b mHC"][1]) == pytest.approx(-0.1)
    assert float(rows["a mHC"][2]) == pytest.approx(500.0)  # ms a step
    assert plot.stat().st_size > 0


def test_bench_dsv4_dry_run_table(tmp_path):
    """``bench_dsv4.py --dry-run`` (CPU, reference ops) prints every op's row with the table's
    columns, the correctness gate included (the reference against its fp32 self: bf16
    rounding only)."""
    out = tmp_path / "dsv4.md"
    text = run_script("benchmarks/bench_dsv4.py", "--dry-run", "--sizes", "16x64", "--out",
                      str(out))
    written = out.read_text()
    assert "### T=16, C=64" in text and "### T=16, C=64" in written
    header = next(line for line in written.splitlines() if line.startswith("| op |"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "op", "impl", "ms", "GB/s", "% of copy BW", "/ baseline", "max rel err"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in written.splitlines()
            if line.startswith("| ") and not line.startswith("| op |")]
    ops = ["pre fwd", "combine fwd", "head fwd", "pre fwd+bwd", "combine fwd+bwd",
           "head fwd+bwd", "sublayer fwd+bwd"]
    assert {r[0] for r in rows} == set(ops)
    assert {(r[0], r[1]) for r in rows} >= {(op, "reference (DSV4)") for op in ops}
    assert {r[0] for r in rows if r[1] == "reference (paper)"} == {
        "pre fwd", "pre fwd+bwd", "sublayer fwd+bwd"}
    for r in rows:
        assert len(r) == 7 and float(r[2]) > 0 and r[4].endswith("%")
        assert 0 <= float(r[6]) < 2e-2, r  # max rel err: bf16 rounding against fp32
        if r[1] == "reference (DSV4)":
            assert r[5] == "1.00"


def test_bench_host_counts_the_launch_paths(monkeypatch, device):
    """``counting_launch_paths`` counts each launch once, by the path it took (pre forward: 2
    or 3 launches, backward: 4). On the interpreter every launch goes through Triton's own
    launcher. On a GPU, with the ops' host work in Python (their replay and C++ nodes off, so
    that every launch passes the launcher) and the launch shapes seen once, every launch takes
    its per-argument key where each signed launch is checked against that key
    (``MHC_CHECK_LAUNCH_SIGNATURES=1``, the test-suite's default: tests/conftest.py), and its
    signature otherwise."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import host_ops

    from mhc_megatron.kernels import host_replay, launch, native_autograd, triton_mhc

    def pre_and_backward(paths: dict) -> int:
        x = torch.randn(6, 4, 16, device=device, requires_grad=True)
        phi = torch.randn(24, 64, device=device, requires_grad=True)
        alpha = torch.ones(3, device=device, requires_grad=True)
        bias = torch.zeros(24, device=device, requires_grad=True)
        y = triton_mhc.pre(x, phi, alpha, bias, 3, 1e-6)[0]
        forward = sum(paths.values())
        y.sum().backward()
        return forward

    on_gpu = device.type == "cuda"
    with contextlib.ExitStack() as python_host_work:
        if on_gpu:
            python_host_work.enter_context(host_ops.switched_off(native_autograd))
            python_host_work.enter_context(host_ops.switched_off(host_replay))
            pre_and_backward({})  # the launch shapes seen
        with host_ops.counting_launch_paths() as paths:
            forward = pre_and_backward(paths)
    taken = ("Triton's launcher" if not on_gpu else
             "per-argument key" if launch.CHECK_SIGNATURES else "by signature")
    assert all(count == 0 for path, count in paths.items() if path != taken), paths
    assert forward in (2, 3) and paths[taken] == forward + 4, (forward, paths)


def test_bench_host_chain_enters_each_layers_block_once(monkeypatch, megatron_single_rank):
    """``sublayers_as_layers_run_them`` runs a layer's two sublayers inside one entry of its
    ``mhc_recompute`` block, as the layer's forward does: layers 2-4 of a 4-layer model
    (blocks of 2 layers) open 2 blocks in 3 layer entries, and the backward replays each
    once (the Triton ops, on the interpreter: their outputs are saved as placeholders)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import host_chain

    shape = dict(layers=4, hidden=32, ffn=64, heads=4, seq=8, mbs=1, vocab=64)
    model = host_chain.build(shape, "local", True, True, host_chain.DEVICE)[0]
    monkeypatch.setattr(model.config, "mhc_kernel_backend", "triton")
    manager = model.decoder.layers[1].mhc_recompute_manager
    assert manager.block_size == 2
    run, count = host_chain.sublayers_as_layers_run_them(model, 8)
    assert count == 6
    entered = []
    state_for = manager._state_for
    monkeypatch.setattr(manager, "_state_for",
                        lambda *a: entered.append(state_for(*a)) or entered[-1])
    before = manager.blocks_recomputed
    run()
    assert len(entered) == 3 and len({id(block) for block in entered}) == 2, entered
    assert manager.blocks_recomputed - before == 2


def test_bench_host_chain_drops_or_accumulates_the_mapping_gradients(monkeypatch,
                                                                      megatron_single_rank):
    """The chained sublayers drop the mapping parameters' gradients after each call, or with
    ``accumulate`` keep them: two calls give twice one call's gradients (the ops are
    deterministic: the same bits each call)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import host_chain

    shape = dict(layers=3, hidden=32, ffn=64, heads=4, seq=8, mbs=1, vocab=64)
    model = host_chain.build(shape, "local", True, False, host_chain.DEVICE)[0]
    params = [p for layer in model.decoder.layers[1:] for hc in (
        layer.self_attention_hyper_connection, layer.mlp_hyper_connection)
        for p in hc.parameters()]
    dropping, _ = host_chain.sublayers_as_layers_run_them(model, 8)
    dropping()
    assert all(p.grad is None for p in params)
    accumulating, _ = host_chain.sublayers_as_layers_run_them(model, 8, accumulate=True)
    accumulating()
    once = [p.grad.clone() for p in params]
    accumulating()
    for p, g in zip(params, once):
        torch.testing.assert_close(p.grad, 2 * g, rtol=0, atol=0)


def test_bench_host_recompute_parts_switch_and_restore(monkeypatch):
    """``recompute_parts_switched`` turns the recompute's parts off as asked (no sublayer
    saving scope without hooks; the blocks' C++ replay off for Python replays) and restores
    everything it replaced on exit."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import host_chain

    from mhc_megatron.layers import hyper_connection, transformer_layer
    from mhc_megatron.recompute import manager as rm

    before = (transformer_layer.sublayer_saving, hyper_connection.record_as,
              hyper_connection.run_recorded, hyper_connection.HyperConnectionModule._site_record,
              rm.native_replay())
    rm.set_native_replay(True)
    try:
        with host_chain.recompute_parts_switched() as switch:
            switch("python replays")
            assert not rm.native_replay()
            switch("no hooks")
            assert rm.native_replay() and transformer_layer.sublayer_saving() is None
            switch("no hooks, no records")  # (a site call is handed no record: the block
            # is not read)
            assert hyper_connection.HyperConnectionModule._site_record(None, object(), None) \
                is None
        assert rm.native_replay()
        assert (transformer_layer.sublayer_saving, hyper_connection.record_as,
                hyper_connection.run_recorded,
                hyper_connection.HyperConnectionModule._site_record) == before[:4]
    finally:
        rm.set_native_replay(before[4])
