"""Does mHC learn what it should? Baseline vs mHC under several initialisations, several seeds.

Every run trains the same GPT on the same tokens (the stdlib sources as bytes, as
``examples/train_gpt_mhc.py``), with Megatron's optimiser convention (no weight decay on 1-D
parameters: norms, mHC's ``alpha`` and ``bias``). At every evaluation it records, on one
validation batch (``mhc_megatron.diagnostics``): per sublayer the H_res diagonal (mean and
per-token spread), H_pre / H_post statistics, the composite gain of the H_res product along
depth (forward and backward), and the gradient norms of the mHC parameters.

Variants (``--variants``), ``name=key:value,...`` with keys ``static`` (residual | zero),
``diag`` (H_res diagonal for residual), ``gating`` (mhc_init_gating_factor), ``params``
(storage of the mapping parameters: fp32, or params = the model's params_dtype), ``variant``
(``mhc_variant``: paper | deepseek_v4, DeepSeek-V4's conventions with its learned output
head); ``baseline`` is Megatron's own layer. Default: ours (residual, diagonal 0.95), Megatron-LM's zero bias, an
intermediate diagonal (0.6), ours with a 10x gating factor, and ours with bf16-stored mapping
parameters (with ``--precision bf16``; the others then keep them in fp32, ``--mhc-params``).

    python examples/mhc_study.py --preset smoke --seeds 1 --out out/study_smoke   # CPU check
    python examples/mhc_study.py --preset study --precision bf16 --mhc-params fp32 \
        --attention sdpa --seeds 3 --out out/study                                # the study
    python examples/mhc_study.py --preset study --precision bf16 --mhc-params fp32 \
        --attention sdpa --seeds 2 --out out/study_dsv4 --variants baseline \
        mhc-ours=static:residual,diag:0.95,gating:0.01 \
        mhc-dsv4=static:residual,diag:0.95,gating:0.01,variant:deepseek_v4  # DeepSeek-V4's
    python examples/mhc_study.py --report out/study                               # plot + table

Writes ``<out>/study.json`` (appended run by run, so a stopped study keeps what finished),
and with ``--report`` ``<out>/study_val_loss.png`` and ``<out>/study.md``. A run's
``seconds`` (the table's "s / run") are its steps and evaluations; the diagnostics that only
mHC runs take are timed apart (``diagnostics_seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

import train_gpt_mhc as demo  # noqa: E402

DEFAULT_VARIANTS = [
    "baseline",
    "mhc-ours=static:residual,diag:0.95,gating:0.01",
    "mhc-zero=static:zero,gating:0.01",
    "mhc-diag0.6=static:residual,diag:0.6,gating:0.01",
    "mhc-gate0.1=static:residual,diag:0.95,gating:0.1",
    "mhc-ours-bf16params=static:residual,diag:0.95,gating:0.01,params:params",
]
PARAMS_DTYPES = {"fp32": "float32", "params": None}


def _dtype(value: str):
    if value not in PARAMS_DTYPES:
        raise SystemExit(f"params:{value}: use one of {sorted(PARAMS_DTYPES)}")
    name = PARAMS_DTYPES[value]
    return None if name is None else getattr(demo.torch, name)


def parse_variant(text: str) -> tuple[str, dict | None]:
    """``name=key:value,...`` -> (name, MHCTransformerConfig overrides); baseline -> None."""
    if text == "baseline":
        return "baseline", None
    name, _, spec = text.partition("=")
    keys = {"static": ("mhc_init_static_mapping", str), "diag": ("mhc_init_res_diagonal", float),
            "gating": ("mhc_init_gating_factor", float), "params": ("mhc_params_dtype", _dtype),
            "variant": ("mhc_variant", str)}
    overrides = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        if key not in keys:
            raise SystemExit(f"variant {text!r}: unknown key {key!r}. Fix: use {sorted(keys)}")
        field, cast = keys[key]
        overrides[field] = cast(value)
    return name, overrides


def summarise(model, val) -> dict:
    """The diagnostics of one evaluation (on one validation batch)."""
    from mhc_megatron.diagnostics import (
        capture_mappings,
        composite_gain,
        mapping_stats,
        mhc_grad_norms,
    )

    grads = mhc_grad_norms(model)  # this step's gradients, before the forward below
    ids, _ = val.next()
    model.eval()
    with capture_mappings(model) as captured, demo.torch.no_grad():
        model(ids, val.position_ids, val.mask)
    model.train()
    return {"sublayers": mapping_stats(captured), "gain": composite_gain(captured),
            "grad_norms": grads}


def run_study(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "study.json")
    done = json.load(open(path)) if os.path.exists(path) else []
    corpus = demo.load_stdlib_corpus(int(args.corpus_mb * 2**20))
    split = int(0.95 * len(corpus))
    created = demo.setup_megatron(args.device, args.seed)
    started, longest = time.time(), 0.0
    try:
        for seed in range(args.seed, args.seed + args.seeds):
            for text in args.variants:
                name, overrides = parse_variant(text)
                if any(r["variant"] == name and r["seed"] == seed for r in done):
                    continue
                if args.time_budget_s and time.time() - started + 1.2 * longest > args.time_budget_s:
                    print(f"time budget: stopping before {name} seed {seed} (rerun to resume)")
                    return
                run_started = time.time()
                run_args = argparse.Namespace(**{**vars(args), "seed": seed})
                diags = []

                def on_eval(step, model, val, diags=diags, mhc=overrides is not None):
                    if mhc:
                        diags.append({"step": step, **summarise(model, val)})

                result = demo.train(name, overrides is not None, run_args, corpus[:split],
                                    corpus[split:], mhc_overrides=overrides, on_eval=on_eval,
                                    decay_1d=False)
                done.append({"variant": name, "seed": seed, "overrides": overrides,
                             "steps": result.steps, "train_loss": result.train_loss,
                             "val_steps": result.val_steps, "val_loss": result.val_loss,
                             "seconds": result.seconds,
                             "diagnostics_seconds": result.on_eval_seconds,
                             "params": result.params,
                             "diagnostics": diags})
                with open(path, "w") as f:
                    json.dump(done, f, default=str)  # dtypes as their names
                longest = max(longest, time.time() - run_started)
                print(f"{name} seed {seed}: final val {result.val_loss[-1]:.4f}", flush=True)
    finally:
        if created:
            demo.teardown_megatron()


def _mean_std(values) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _last_diagnostics(run) -> dict | None:
    return run["diagnostics"][-1] if run["diagnostics"] else None


def paired_deltas(runs: list[dict], variant: str, index: int = -1) -> list[float]:
    """Validation loss of ``variant`` minus the baseline's, seed by seed (the same seed: the
    same initial weights of the shared modules, data order and validation batches)."""
    base = {r["seed"]: r["val_loss"][index] for r in runs if r["variant"] == "baseline"}
    return [r["val_loss"][index] - base[r["seed"]] for r in runs
            if r["variant"] == variant and r["seed"] in base]


def report(out: str) -> str:
    """Mean and spread over seeds per variant: a figure (validation loss; its paired
    difference to the baseline; the H_res per-token spread; the composite gain) and a table
    with the final losses, the paired differences and the last diagnostics."""
    runs = json.load(open(os.path.join(out, "study.json")))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    lines = ["| variant | seeds | final val loss (mean +- std) | minus baseline, paired "
             "(mean +- std; per seed) | H_res diag (mean over sublayers) | H_res diag per-token "
             "spread (max) | composite gain fwd / bwd (max) | last sublayer's H_res gradient "
             "/ the sublayer before's (bias rows, mean over evaluations) | s / run |",
             "|---|---|---|---|---|---|---|---|---|"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (loss_ax, delta_ax), (spread_ax, gain_ax) = axes
    for v in variants:
        rs = sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"])
        steps = rs[0]["val_steps"]
        curves = [[r["val_loss"][i] for r in rs] for i in range(len(steps))]
        line, = loss_ax.plot(steps, [statistics.fmean(c) for c in curves],
                             label=f"{v} ({len(rs)} seeds)")
        color = line.get_color()
        loss_ax.fill_between(steps, [min(c) for c in curves], [max(c) for c in curves],
                             color=color, alpha=0.15)
        finals = [r["val_loss"][-1] for r in rs]
        mean, std = _mean_std(finals)
        delta = "-"
        if v != "baseline":
            per_step = [paired_deltas(runs, v, i) for i in range(len(steps))]
            if per_step[-1]:
                delta_ax.plot(steps, [statistics.fmean(d) for d in per_step], color=color, label=v)
                delta_ax.fill_between(steps, [min(d) for d in per_step],
                                      [max(d) for d in per_step], color=color, alpha=0.12)
                d_mean, d_std = _mean_std(per_step[-1])
                delta = (f"{d_mean:+.4f} +- {d_std:.4f}; "
                         + ", ".join(f"{d:+.3f}" for d in per_step[-1]))
        diag = spread = gain = last_res = "-"
        last = [d for d in map(_last_diagnostics, rs) if d]
        res_ratios = [d["grad_norms"][-1].get("bias_res", 0.0) / d["grad_norms"][-2]["bias_res"]
                      for r in rs for d in r["diagnostics"]
                      if len(d["grad_norms"]) > 1 and d["grad_norms"][-2].get("bias_res")]
        if res_ratios:
            last_res = f"{statistics.fmean(res_ratios):.2e}"
        if last:
            diag = f"{statistics.fmean(statistics.fmean(s['h_res_diag_mean'] for s in d['sublayers']) for d in last):.3f}"
            spread = f"{max(max(s['h_res_diag_spread'] for s in d['sublayers']) for d in last):.3f}"
            gain = (f"{max(d['gain']['forward_max'] for d in last):.3f} / "
                    f"{max(d['gain']['backward_max'] for d in last):.3f}")
            diag_steps = [d["step"] for d in rs[0]["diagnostics"]]
            spread_ax.plot(diag_steps, [statistics.fmean(
                max(s["h_res_diag_spread"] for s in r["diagnostics"][i]["sublayers"]) for r in rs)
                for i in range(len(diag_steps))], color=color, label=v)
            gain_ax.plot(diag_steps, [statistics.fmean(
                r["diagnostics"][i]["gain"]["forward_max"] for r in rs)
                for i in range(len(diag_steps))], color=color, label=v)
        seconds = statistics.fmean(r["seconds"] for r in rs)
        lines.append(f"| {v} | {len(rs)} | {mean:.4f} +- {std:.4f} | {delta} | {diag} | {spread} "
                     f"| {gain} | {last_res} | {seconds:.0f} |")
    loss_ax.set(xlabel="step", ylabel="validation loss (nats/byte)",
                title="validation loss: mean, min-max over seeds")
    delta_ax.axhline(0.0, color="black", lw=0.8)
    delta_ax.set(xlabel="step", ylabel="variant - baseline (nats/byte)",
                 title="paired difference to the baseline (same seed): mean, min-max")
    spread_ax.set(xlabel="step", ylabel="max over sublayers",
                  title="H_res diagonal: per-token spread (mean over seeds)")
    gain_ax.set(xlabel="step", ylabel="max over tokens",
                title="composite gain of the H_res product, forward (mean over seeds)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "study_val_loss.png"), dpi=110)
    plt.close(fig)
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write(table)
    return table


def study_arguments(parser: argparse.ArgumentParser) -> None:
    """The study's own flags, as a group of the demo's parser."""
    g = parser.add_argument_group("mhc_study.py")
    g.add_argument("--seeds", type=int, default=3,
                   help="runs per variant, with seeds --seed, --seed + 1, ...")
    g.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                   help="name=key:value,... (keys: static, diag, gating, params) or baseline")
    g.add_argument("--time-budget-s", type=float, default=0.0,
                   help="start no run that would end after this many seconds (0: no "
                        "limit); study.json keeps what finished, a rerun resumes")
    g.add_argument("--report", metavar="OUT",
                   help="only write the plot and table of the study in OUT (no training)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The demo's flags (``train_gpt_mhc.parse_args``) and the study's, in one parser with
    exact names only (``--seed`` is the demo's seed, never ``--seeds``)."""
    args = demo.parse_args(argv, extra_arguments=study_arguments,
                           description=__doc__.split("\n\n")[0])
    if args.report:
        return args
    if args.precision == "fp8":
        raise SystemExit("the study runs --precision fp32 or bf16")
    for text in args.variants:
        parse_variant(text)  # bad variants fail before any training
    return args


def main(argv=None):
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.report:
        print(report(args.report))
        return
    with demo.console():
        run_study(args)
    print(report(args.out))


if __name__ == "__main__":
    main()
