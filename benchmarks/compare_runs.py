"""Compare demo runs (``examples/train_gpt_mhc.py --out DIR``) of different precisions or specs.

    python benchmarks/compare_runs.py --out fp8_vs_bf16.png bf16=out/bf16 fp8=out/fp8

Each ``LABEL=DIR`` holds a ``results.json`` with a baseline and an mHC run. Prints a table of
the final validation losses, each run against the first label's run of the same model, and
plots the validation curves (left: whole run; right: the last half, zoomed).
"""

from __future__ import annotations

import argparse
import json
import os


def load(spec: str):
    label, path = spec.split("=", 1)
    with open(os.path.join(path, "results.json")) as fh:
        data = json.load(fh)
    return label, data


def table(loaded) -> str:
    ref_label, ref = loaded[0]
    lines = [f"{'run':>22} | {'final val':>9} | {'vs ' + ref_label:>12} | {'ms/step':>8}"]
    for label, data in loaded:
        for i, run in enumerate(data["runs"]):
            base = ref["runs"][i]["val_loss"][-1]
            final = run["val_loss"][-1]
            ms = 1000 * run["seconds"] / len(run["steps"])
            lines.append(f"{label + ' ' + run['name']:>22} | {final:>9.4f} | "
                         f"{final - base:>+12.4f} | {ms:>8.1f}")
    return "\n".join(lines)


def plot(loaded, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(13, 5))
    styles = ("-", "--", ":", "-.")
    colors = ("tab:blue", "tab:red")
    for (label, data), ls in zip(loaded, styles):
        for run, color in zip(data["runs"], colors):
            for ax in (full, zoom):
                ax.plot(run["val_steps"], run["val_loss"], ls=ls, color=color, marker="o", ms=2,
                        label=f"{run['name']}, {label}: {run['val_loss'][-1]:.4f}")
    steps = loaded[0][1]["runs"][0]["val_steps"]
    half = steps[len(steps) // 2]
    last = [v for _, d in loaded for r in d["runs"] for s, v in zip(r["val_steps"], r["val_loss"])
            if s >= half]
    pad = 0.1 * (max(last) - min(last) or 1.0)
    zoom.set_xlim(half, steps[-1])
    zoom.set_ylim(min(last) - pad, max(last) + pad)
    for ax, title in ((full, "validation loss, whole run"), (zoom, "last half, zoomed")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.grid(alpha=0.3)
    zoom.legend(fontsize=8)
    args = loaded[0][1]["args"]
    fig.suptitle(f"{loaded[0][1]['device']}: {args['layers']}L x {args['hidden']}, seq "
                 f"{args['seq']}, batch {args['batch']}, {args.get('spec', 'local')} spec; "
                 + " vs ".join(label for label, _ in loaded), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=DIR, the first is the reference")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    loaded = [load(spec) for spec in args.runs]
    print(table(loaded))
    plot(loaded, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
