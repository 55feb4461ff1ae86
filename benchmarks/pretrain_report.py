"""Loss curves and tables from Megatron's own training logs (examples/pretrain_gpt_mhc.py).

    python benchmarks/pretrain_report.py docs/results/pretrain_2gpu --out docs/results/pretrain_2gpu

Per layout found (``scripts/gpu.sh pretrain`` writes these):

- ``<layout>_baseline.log``: the baseline run;
- ``<layout>_mhc.log``: the mHC n=4 run, which saves a checkpoint half-way;
- ``<layout>_mhc_resumed.log``: a second process that loads that half-way checkpoint and
  trains to the end (the interrupted-and-resumed run), if present.

Writes ``summary.md``: parameters, step time and tokens/s (median over the log intervals
after the first two of each process, so neither compilation nor the resume's warm-up
counts),
peak allocated memory per GPU and the final losses, baseline against mHC; and the resume
check: the resumed run's losses at every logged iteration after the resume against the
uninterrupted run's at the same iterations (largest absolute and relative difference,
training and validation). Also ``loss_curves.png`` (a panel per layout) and one
``loss_curves_<layout>.png`` per layout. Megatron stops its interval timer during
evaluation.
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
PARAMS = re.compile(r"model parallel rank (\(\d+, \d+, \d+\)): (\d+)")
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
            # Megatron logs a process's first iteration without resetting its accumulators,
            # so the second line averages over the first iteration too (loss and time)
            if i == 1:
                first, span = float(rows[0][3]), int(it) - int(rows[0][0])
                run["train"][int(it)] = (float(loss) * (span + 1) - first) / span
            if i > 1:  # the first two lines of a process hold compilation / warm-up
                run["ms"].append(float(ms))
            run["gbs"] = int(gbs)
        run["valid"].update({int(i): float(v) for i, v in VALID.findall(text)})
        run["peak_mb"] = max([run["peak_mb"], *map(float, PEAK.findall(text))])
        final = FINAL_VALID.findall(text)
        if final:
            run["final_valid"] = float(final[-1])
        per_rank = dict(PARAMS.findall(text))  # (tensor, ..., pipeline) rank -> parameters
        run["params_per_rank"] = int(next(iter(per_rank.values())))
        run["params"] = sum(map(int, per_rank.values()))
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
    runs, resumed = {}, {}
    for layout in layouts:
        runs[layout] = {"baseline": parse([args.logs / f"{layout}_baseline.log"]),
                        "mHC n=4": parse([args.logs / f"{layout}_mhc.log"])}
        path = args.logs / f"{layout}_mhc_resumed.log"
        if path.exists():
            resumed[layout] = parse([path])

    lines = ["| layout | run | params/rank | step (ms) | tokens/s | vs baseline | peak alloc/GPU (GB) "
             "| train loss @end | val loss @end |", "|" + "---|" * 9]
    for layout, pair in runs.items():
        base = pair["baseline"]
        for name, r in pair.items():
            last = max(r["train"])
            lines.append(
                f"| {layout} | {name} | {r['params_per_rank'] / 1e6:.1f}M | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s'] / 1e3:.1f}k | {r['step_ms'] / base['step_ms']:.2f}x | "
                f"{r['peak_mb'] / 1e3:.2f} | {r['train'][last]:.4f} | {_num(r['final_valid'], 4)} |")
    if resumed:
        lines += ["", resume_table(runs, resumed)]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.2), squeeze=False)
    for ax, (layout, pair) in zip(axes[0], runs.items()):
        _plot_layout(ax, layout, pair, resumed.get(layout))
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=110)
    plt.close(fig)
    for layout, pair in runs.items():
        fig, ax = plt.subplots(figsize=(7, 4.4))
        _plot_layout(ax, layout, pair, resumed.get(layout))
        fig.tight_layout()
        fig.savefig(args.out / f"loss_curves_{layout}.png", dpi=110)
        plt.close(fig)
    print(f"wrote {args.out / 'loss_curves.png'}, a loss_curves_<layout>.png per layout and "
          f"{args.out / 'summary.md'}")


def _plot_layout(ax, layout: str, pair: dict, resumed: dict | None) -> None:
    """One layout's training and validation losses: baseline, mHC, and where there is one
    the mHC run resumed from the half-way checkpoint (dotted, from the resume on)."""
    named = list(pair.items()) + ([("mHC n=4, resumed", resumed)] if resumed else [])
    for (name, r), color in zip(named, ("tab:blue", "tab:red", "black")):
        it = sorted(r["train"])
        style = ":" if r is resumed else "-"
        ax.plot(it, [r["train"][i] for i in it], style, color=color, lw=1.0,
                label=f"{name} train")
        iv = sorted(r["valid"])
        ax.plot(iv, [r["valid"][i] for i in iv], "o--" if r is not resumed else "x",
                color=color, label=f"{name} validation")
    if resumed:
        ax.axvline(min(resumed["train"]) - 1, color="gray", lw=0.8, ls=":",
                   label="resumed from the checkpoint")
    params = pair["baseline"]["params"]
    ax.set(title=f"{layout}: Megatron pretrain, {params / 1e6:.0f}M GPT, stdlib bytes",
           xlabel="iteration", ylabel="lm loss (nats/byte)", ylim=(0.8, 3.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def resume_table(runs: dict, resumed: dict) -> str:
    """The resumed mHC run against the uninterrupted one, per layout: the iterations both
    logged after the resume and the largest absolute and relative difference of their
    training and validation losses."""
    lines = ["| layout | iterations compared (after the resume) | train loss: max abs diff "
             "| max rel diff | validation loss: max abs diff | max rel diff |", "|" + "---|" * 6]
    for layout, after in resumed.items():
        full = runs[layout]["mHC n=4"]
        its = sorted(set(after["train"]) & set(full["train"]))
        ivs = sorted(set(after["valid"]) & set(full["valid"]))
        cells = []
        for key, keys in (("train", its), ("valid", ivs)):
            cells += [_num(max((abs(after[key][i] - full[key][i]) for i in keys), default=None)),
                      _num(max((abs(after[key][i] - full[key][i]) / abs(full[key][i])
                                for i in keys), default=None))]
        span = f"{its[0]}-{its[-1]} ({len(its)} logged)" if its else "none"
        lines.append(f"| {layout} | {span} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(value, digits: int | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if digits is not None else f"{value:.2e}"


if __name__ == "__main__":
    main()
