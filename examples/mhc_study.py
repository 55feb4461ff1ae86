"""Does mHC learn what it should? Baseline vs mHC under several initialisations, several seeds.

Every run trains the same GPT on the same tokens (the stdlib sources as bytes, as
``examples/train_gpt_mhc.py``), with Megatron's optimiser convention (no weight decay on 1-D
parameters: norms, mHC's ``alpha`` and ``bias``). At every evaluation it records, on one
validation batch (``mhc_megatron.diagnostics``): per sublayer the H_res diagonal (mean and
per-token spread), H_pre / H_post statistics, the composite gain of the H_res product along
depth (forward and backward), and the gradient norms of the mHC parameters.

Variants (``--variants``), ``name=key:value,...`` with keys ``static`` (residual | zero),
``diag`` (H_res diagonal for residual), ``gating`` (mhc_init_gating_factor); ``baseline`` is
Megatron's own layer. Default: ours (residual, diagonal 0.95), Megatron-LM's zero bias, an
intermediate diagonal (0.6), and ours with a 10x gating factor.

    python examples/mhc_study.py --preset smoke --seeds 1 --out out/study_smoke   # CPU check
    python examples/mhc_study.py --preset gpu --seeds 3 --out out/study           # the study
    python examples/mhc_study.py --report out/study                               # plot + table

Writes ``<out>/study.json`` (appended run by run, so a stopped study keeps what finished),
and with ``--report`` ``<out>/study_val_loss.png`` and ``<out>/study.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_gpt_mhc as demo  # noqa: E402

DEFAULT_VARIANTS = [
    "baseline",
    "mhc-ours=static:residual,diag:0.95,gating:0.01",
    "mhc-zero=static:zero,gating:0.01",
    "mhc-diag0.6=static:residual,diag:0.6,gating:0.01",
    "mhc-gate0.1=static:residual,diag:0.95,gating:0.1",
]


def parse_variant(text: str) -> tuple[str, dict | None]:
    """``name=key:value,...`` -> (name, MHCTransformerConfig overrides); baseline -> None."""
    if text == "baseline":
        return "baseline", None
    name, _, spec = text.partition("=")
    keys = {"static": ("mhc_init_static_mapping", str), "diag": ("mhc_init_res_diagonal", float),
            "gating": ("mhc_init_gating_factor", float)}
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
    try:
        for seed in range(args.seed, args.seed + args.seeds):
            for text in args.variants:
                name, overrides = parse_variant(text)
                if any(r["variant"] == name and r["seed"] == seed for r in done):
                    continue
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
                             "seconds": result.seconds, "params": result.params,
                             "diagnostics": diags})
                with open(path, "w") as f:
                    json.dump(done, f)
                print(f"{name} seed {seed}: final val {result.val_loss[-1]:.4f}", flush=True)
    finally:
        if created:
            demo.teardown_megatron()


def report(out: str) -> str:
    """Mean and spread over seeds per variant: a plot of validation loss, and a table with the
    final losses and the last diagnostics."""
    runs = json.load(open(os.path.join(out, "study.json")))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    lines = ["| variant | seeds | final val loss (mean +- std) | H_res diag (mean over sublayers) "
             "| H_res diag per-token spread (max) | composite gain fwd / bwd (max) |",
             "|---|---|---|---|---|---|"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        finals = [r["val_loss"][-1] for r in rs]
        std = statistics.pstdev(finals) if len(finals) > 1 else 0.0
        steps = rs[0]["val_steps"]
        mean = [statistics.fmean(r["val_loss"][i] for r in rs) for i in range(len(steps))]
        lo = [min(r["val_loss"][i] for r in rs) for i in range(len(steps))]
        hi = [max(r["val_loss"][i] for r in rs) for i in range(len(steps))]
        line, = ax.plot(steps, mean, label=f"{v} ({len(rs)} seeds)")
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
        diag = spread = gain = "-"
        last = [r["diagnostics"][-1] for r in rs if r["diagnostics"]]
        if last:
            diag = f"{statistics.fmean(statistics.fmean(s['h_res_diag_mean'] for s in d['sublayers']) for d in last):.3f}"
            spread = f"{max(max(s['h_res_diag_spread'] for s in d['sublayers']) for d in last):.3f}"
            gain = (f"{max(d['gain']['forward_max'] for d in last):.3f} / "
                    f"{max(d['gain']['backward_max'] for d in last):.3f}")
        lines.append(f"| {v} | {len(rs)} | {statistics.fmean(finals):.4f} +- {std:.4f} | {diag} "
                     f"| {spread} | {gain} |")
    ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title="mHC study: mean, min-max over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "study_val_loss.png"), dpi=110)
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write(table)
    return table


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--report" in argv:
        print(report(argv[argv.index("--report") + 1]))
        return
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--seeds", type=int, default=3)
    extra.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    mine, rest = extra.parse_known_args(argv)
    args = demo.parse_args(rest)
    if args.precision != "fp32":
        raise SystemExit("the study runs --precision fp32 (Megatron's no-decay-on-1-D convention "
                         "is implemented for it)")
    args.seeds, args.variants = mine.seeds, mine.variants
    for text in args.variants:
        parse_variant(text)  # bad variants fail before any training
    run_study(args)
    print(report(args.out))


if __name__ == "__main__":
    main()
