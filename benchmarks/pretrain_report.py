"""Loss curves and a table from Megatron's own training logs (examples/pretrain_gpt_mhc.py).

    python benchmarks/pretrain_report.py docs/results/pretrain_2gpu --out docs/results/pretrain_2gpu

Reads ``<layout>_baseline.log`` and ``<layout>_mhc_part1.log`` + ``<layout>_mhc_part2.log``
(an mHC run interrupted and resumed from its checkpoint) for every layout found, and, where
present, ``<layout>_mhc_full.log`` (the same mHC run uninterrupted). Writes
``loss_curves.png`` (training and validation loss, a panel per layout), one
``loss_curves_<layout>.png`` per layout, and ``summary.md``: parameters, step time and
tokens/s (median over the log intervals after the first of each process, so neither
compilation nor the resume's warm-up counts), peak allocated memory per GPU, and the final
losses; with uninterrupted runs also a second table, the resumed run's logged losses after
the resume against the uninterrupted run's at the same iterations (the largest difference,
training and validation). Megatron stops its interval timer during evaluation.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
                  r".*?global batch size:\s+(\d+) \| lm loss: ([-+0-9.Ee]+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+0-9.Ee]+)")
FINAL_VALID = re.compile(r"validation loss at iteration \d+ on validation set \| lm loss value: ([-+0-9.Ee]+)")
PEAK = re.compile(r"max allocated: ([0-9.]+)")
PARAMS = re.compile(r"model parallel rank \(\d+, \d+, \d+\): (\d+)")
SEQ = re.compile(r"^\s+seq_length \.+ (\d+)", re.M)
TP = re.compile(r"^\s+tensor_model_parallel_size \.+ (\d+)", re.M)


def parse(paths: list[Path]) -> dict:
    """One run from its log(s), in order (a resumed run continues in the next file)."""
    run = {"train": {}, "valid": {}, "ms": [], "peak_mb": 0.0, "final_valid": None}
    for path in paths:
        text = path.read_text(errors="replace")
        rows = ITER.findall(text)
        for i, (it, ms, gbs, loss) in enumerate(rows):
            run["train"][int(it)] = float(loss)
            if i > 0:  # the first interval of a process holds compilation / warm-up
                run["ms"].append(float(ms))
            run["gbs"] = int(gbs)
        run["valid"].update({int(i): float(v) for i, v in VALID.findall(text)})
        run["peak_mb"] = max([run["peak_mb"], *map(float, PEAK.findall(text))])
        final = FINAL_VALID.findall(text)
        if final:
            run["final_valid"] = float(final[-1])
        run["params_per_rank"] = int(PARAMS.findall(text)[0])
        run["seq"], run["tp"] = int(SEQ.findall(text)[0]), int(TP.findall(text)[0])
    run["step_ms"] = statistics.median(run["ms"])
    run["tokens_per_s"] = run["gbs"] * run["seq"] / (run["step_ms"] / 1e3)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    layouts = sorted(p.name[: -len("_baseline.log")] for p in args.logs.glob("*_baseline.log"))
    runs, uninterrupted = {}, {}
    for layout in layouts:
        runs[layout] = {
            "baseline": parse([args.logs / f"{layout}_baseline.log"]),
            "mHC n=4": parse([args.logs / f"{layout}_mhc_part1.log",
                              args.logs / f"{layout}_mhc_part2.log"]),
        }
        full = args.logs / f"{layout}_mhc_full.log"
        if full.exists():
            uninterrupted[layout] = parse([full])

    lines = ["| layout | run | params/rank | step (ms) | tokens/s | vs baseline | peak alloc/GPU (GB) "
             "| train loss @end | val loss @end |", "|" + "---|" * 9]
    for layout, pair in runs.items():
        base = pair["baseline"]
        for name, r in pair.items():
            last = max(r["train"])
            lines.append(
                f"| {layout} | {name} | {r['params_per_rank'] / 1e6:.1f}M | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s'] / 1e3:.1f}k | {r['step_ms'] / base['step_ms']:.2f}x | "
                f"{r['peak_mb'] / 1e3:.2f} | {r['train'][last]:.4f} | {r['final_valid']:.4f} |")
    if uninterrupted:
        lines += ["", resume_table(runs, uninterrupted, args.logs)]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.2), squeeze=False)
    for ax, (layout, pair) in zip(axes[0], runs.items()):
        _plot_layout(ax, layout, pair, uninterrupted.get(layout))
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=110)
    plt.close(fig)
    for layout, pair in runs.items():
        fig, ax = plt.subplots(figsize=(7, 4.4))
        _plot_layout(ax, layout, pair, uninterrupted.get(layout))
        fig.tight_layout()
        fig.savefig(args.out / f"loss_curves_{layout}.png", dpi=110)
        plt.close(fig)
    print(f"wrote {args.out / 'loss_curves.png'}, a loss_curves_<layout>.png per layout and "
          f"{args.out / 'summary.md'}")


def _plot_layout(ax, layout: str, pair: dict, full: dict | None) -> None:
    """One layout's training and validation losses: baseline, mHC (interrupted and resumed)
    and, where there is one, the uninterrupted mHC run."""
    named = list(pair.items()) + ([("mHC n=4, uninterrupted", full)] if full else [])
    for (name, r), color in zip(named, ("tab:blue", "tab:red", "tab:orange")):
        it = sorted(r["train"])
        style = ":" if full is r else "-"
        ax.plot(it, [r["train"][i] for i in it], style, color=color, label=f"{name} train")
        iv = sorted(r["valid"])
        ax.plot(iv, [r["valid"][i] for i in iv], "o--", color=color, label=f"{name} validation")
    ax.axvline(max(pair["mHC n=4"]["train"]) // 2, color="gray", lw=0.8, ls=":",
               label="mHC run resumed from its checkpoint")
    ax.set(title=f"{layout}: Megatron pretrain, 85M GPT, stdlib bytes", xlabel="iteration",
           ylabel="lm loss (nats/byte)", ylim=(1.0, 3.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def resume_table(runs: dict, uninterrupted: dict, logs: Path) -> str:
    """The resumed mHC run against the uninterrupted one, per layout: the iterations logged
    after the resume (those of ``<layout>_mhc_part2.log``) and the largest absolute
    difference of their training and validation losses."""
    lines = ["| layout | iterations compared (after the resume) | max abs diff, train loss | "
             "max abs diff, validation loss |", "|" + "---|" * 4]
    for layout, full in uninterrupted.items():
        after = parse([logs / f"{layout}_mhc_part2.log"])
        resumed = runs[layout]["mHC n=4"]
        its = sorted(set(after["train"]) & set(full["train"]))
        ivs = sorted(set(after["valid"]) & set(full["valid"]))
        d_train = max((abs(resumed["train"][i] - full["train"][i]) for i in its), default=None)
        d_valid = max((abs(resumed["valid"][i] - full["valid"][i]) for i in ivs), default=None)
        span = f"{its[0]}-{its[-1]} ({len(its)} logged)" if its else "none"
        lines.append(f"| {layout} | {span} | {_num(d_train)} | {_num(d_valid)} |")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.2e}"


if __name__ == "__main__":
    main()
