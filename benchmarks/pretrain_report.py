"""Loss curves and a table from Megatron's own training logs (examples/pretrain_gpt_mhc.py).

    python benchmarks/pretrain_report.py docs/results/pretrain_2gpu --out docs/results/pretrain_2gpu

Reads ``<layout>_baseline.log`` and ``<layout>_mhc_part1.log`` + ``<layout>_mhc_part2.log``
(an mHC run interrupted and resumed from its checkpoint) for every layout found, and writes
``loss_curves.png`` (training and validation loss per layout) and ``summary.md``: parameters,
step time and tokens/s (median over the log intervals after the first of each process, so
neither compilation nor the resume's warm-up counts), peak allocated memory per GPU, and the
final losses. Megatron stops its interval timer during evaluation.
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
    runs = {}
    for layout in layouts:
        runs[layout] = {
            "baseline": parse([args.logs / f"{layout}_baseline.log"]),
            "mHC n=4": parse([args.logs / f"{layout}_mhc_part1.log",
                              args.logs / f"{layout}_mhc_part2.log"]),
        }

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
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.2), squeeze=False)
    for ax, (layout, pair) in zip(axes[0], runs.items()):
        for (name, r), color in zip(pair.items(), ("tab:blue", "tab:red")):
            it = sorted(r["train"])
            ax.plot(it, [r["train"][i] for i in it], color=color, label=f"{name} train")
            iv = sorted(r["valid"])
            ax.plot(iv, [r["valid"][i] for i in iv], "o--", color=color, label=f"{name} validation")
        ax.axvline(max(pair["mHC n=4"]["train"]) // 2, color="gray", lw=0.8, ls=":",
                   label="mHC run resumed from its checkpoint")
        ax.set(title=f"{layout}: Megatron pretrain, 85M GPT, stdlib bytes", xlabel="iteration",
               ylabel="lm loss (nats/byte)", ylim=(1.0, 3.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=110)
    print(f"wrote {args.out / 'loss_curves.png'} and {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
