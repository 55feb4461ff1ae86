"""GPU benchmark of the mHC ops: ours (fused Triton) vs PyTorch reference (eager and
torch.compile) vs TransformerEngine 2.20.2's Triton mHC, measured side by side in one run.

For every (M = s*b, C), n = 4, bf16 activations, fp32 mapping parameters it times (median of
``triton.testing.do_bench``) a chain of ``DEPTH`` sublayers as a model runs them: sublayer k
does pre (mappings + aggregate) on the streams x_k, takes its own f_k as the sublayer
output, and post (expand-combine with bias) gives x_{k+1}. Each sublayer has its own phi and
f. Reported per sublayer (chain time / DEPTH; a chain, so that each sublayer's input is the
previous one's output as in a model):

* ``fwd``       pre + post
* ``fwd+bwd``   forward and backward (grads for x, every f, bias, phi, alpha, b)

Then, ours only, each op alone with its achieved GB/s and % of the measured device-to-device
copy bandwidth, counting each input read once and each output written once
(``Case.bytes``; "pre fwd" reads x twice by design: projection, then aggregate).

    python benchmarks/bench_mhc.py [--sizes 16384x4096 ...] [--no-compile] [--out table.md]
                                   [--tiles tiles.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from mhc_megatron.kernels import reference as ref  # noqa: E402
from mhc_megatron.kernels import triton_mhc  # noqa: E402

N = 4
ITERS = 20
EPS = 1e-6
DEPTH = 2  # sublayers per timed chain (one transformer layer)


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth():
    a = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / ms / 1e6  # GB/s, read + write


def sublayer_bytes(m: int, c: int, elt: int = 2) -> dict:
    """Bytes each op of one sublayer reads and writes for ``m`` tokens of ``n*C`` streams
    (x) and ``C`` sublayer input/output (y), each input read once, each output written once."""
    x = m * N * c * elt
    y = x / N
    return {"pre fwd": x + y, "post fwd": x + y + x, "sublayer bwd": 3 * x + 3 * y}


def sublayer_pass_bytes(m: int, c: int, elt: int = 2, recompute: bool = False) -> dict:
    """The bytes of the passes any mHC sublayer inside Megatron's layer must make (the
    two-phase floor), for ``m`` tokens of ``n*C`` streams (x) and ``C`` channels (y):

    * pre forward reads x twice: the mappings need the whole row's projection and RMS before
      the aggregate can weight the streams (2x + y);
    * combine forward: x and f in, x' out (2x + y);
    * combine backward runs before the sublayer's backward (which needs its df): it reads g
      and x (dH_res) and f (dH_post), writes df (2x + 2y);
    * pre backward runs after it and is two phases again: the per-token reductions over the
      whole row (dH_pre from x and dy) come before the mappings' backward, whose logit
      gradients dx and dphi need, so x is read twice more; the dx pass also reads g (H_res^T
      g) and dy and writes dx (4x + 2y).

    10x + 6y against :func:`sublayer_bytes`' 6x + 5y (each tensor touched once). With
    ``recompute`` (``mhc_recompute``) also its replay: the combine with the next pre's
    aggregate in one pass, x and f in, x' and y out (2x + 2y)."""
    x = m * N * c * elt
    y = x / N
    passes = {"pre fwd": 2 * x + y, "post fwd": x + y + x, "post bwd": 2 * x + 2 * y,
              "pre bwd": 4 * x + 2 * y}
    if recompute:
        passes["replay"] = 2 * x + 2 * y
    return passes


class Case:
    """Inputs of one size: streams x, per-sublayer phi and f, shared alpha / bias / f bias,
    upstream gradients; plus the same bytes in TE's stream-minor layout."""

    def __init__(self, m, c, dtype=torch.bfloat16, device="cuda"):
        g = torch.Generator(device=device).manual_seed(0)
        self.m, self.c = m, c
        mm = 2 * N + N * N
        self.x = torch.randn(m, N, c, device=device, dtype=dtype, generator=g)
        self.fs = [torch.randn(m, c, device=device, dtype=dtype, generator=g)
                   for _ in range(DEPTH)]
        self.fb = torch.randn(c, device=device, dtype=dtype, generator=g)
        self.phis = [torch.randn(mm, N * c, device=device, generator=g) / (N * c) ** 0.5
                     for _ in range(DEPTH)]
        self.alpha = torch.full((3,), 0.5, device=device)
        self.bias = torch.randn(mm, device=device, generator=g)
        self.gy = torch.randn(m, c, device=device, dtype=dtype, generator=g)
        self.gx = torch.randn(m, N, c, device=device, dtype=dtype, generator=g)
        # TE layout: [s, b, C, n] (stream-minor); same bytes, its own phi column order.
        self.x_te = self.x.permute(0, 2, 1).contiguous().view(m, 1, c, N)
        self.gx_te = self.gx.permute(0, 2, 1).contiguous().view(m, 1, c, N)

    def inputs(self, is_te=False):
        """[x, alpha, bias, f bias, *phis, *fs] in the impl's layout."""
        if is_te:
            return ([self.x_te, self.alpha, self.bias.view(1, -1), self.fb] + self.phis
                    + [f.view(self.m, 1, self.c) for f in self.fs])
        return [self.x, self.alpha, self.bias, self.fb] + self.phis + self.fs

    def bytes(self, elt=2):
        return sublayer_bytes(self.m, self.c, elt)


def chain(pre, post):
    """fwd(inputs) running DEPTH sublayers; returns (the ys, the last streams)."""
    def fwd(inputs):
        x, alpha, bias, fb = inputs[:4]
        phis, fs = inputs[4:4 + DEPTH], inputs[4 + DEPTH:]
        ys = []
        for k in range(DEPTH):
            y, _, h_post, h_res = pre(x, phis[k], alpha, bias, ITERS, EPS)
            x = post(x, fs[k], fb, h_res, h_post)
            ys.append(y)
        return ys, x
    return fwd


def te_chain(te):
    def pre(x, phi, alpha, bias, iters, eps):
        y, h_post, h_res = te.mhc_generate_mix_and_aggregate(x, phi, alpha, bias)
        return y, None, h_post, h_res

    def post(x, f, fb, h_res, h_post):
        return te.mhc_fused_expand_combine(f, fb, h_post, x, h_res, N)
    return chain(pre, post)


def fwd_bwd_step(fwd, cs, is_te=False):
    """A closure running the chain's forward and backward on fresh leaf copies."""
    leaves = [t.detach().clone().requires_grad_() for t in cs.inputs(is_te)]
    gx = cs.gx_te if is_te else cs.gx
    gy = cs.gy.view(cs.m, 1, cs.c) if is_te else cs.gy

    def step():
        for t in leaves:
            t.grad = None
        ys, out = fwd(leaves)
        torch.autograd.backward(ys + [out], [gy] * len(ys) + [gx])
    return step


def time_impl(fwd, cs, is_te=False):
    """Per-sublayer fwd and fwd+bwd times (ms) of the chain."""
    row = {}
    inputs = cs.inputs(is_te)
    with torch.no_grad():
        row["fwd"] = bench(lambda: fwd(inputs)) / DEPTH
    row["fwd+bwd"] = bench(fwd_bwd_step(fwd, cs, is_te)) / DEPTH
    return row


def ours_ops(cs):
    """Closures running one of our ops alone (keys of ``Case.bytes``)."""
    x, alpha, bias, fb = cs.x, cs.alpha, cs.bias, cs.fb
    phi, f = cs.phis[0], cs.fs[0]
    with torch.no_grad():
        _, _, hq, hr = triton_mhc.pre(x, phi, alpha, bias, ITERS, EPS)

    def no_grad(fn, *args, **kwargs):
        def run():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return run

    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, alpha, bias, f, fb)]
    xl, phil, alphal, biasl, fl, fbl = leaves
    y, _, hql, hrl = triton_mhc.pre(xl, phil, alphal, biasl, ITERS, EPS)
    out = triton_mhc.combine(xl, fl, fbl, hrl, hql)  # combine's dx handed to pre's kernel
    return {
        "pre fwd": no_grad(triton_mhc.pre, x, phi, alpha, bias, ITERS, EPS),
        "post fwd": no_grad(triton_mhc.combine, x, f, fb, hr, hq),
        # autograd.grad, not backward: no accumulation into .grad inside the timed region
        "sublayer bwd": lambda: torch.autograd.grad([y, out], leaves, [cs.gy, cs.gx],
                                                    retain_graph=True),
    }


def time_parts_ours(cs):
    return {name: bench(op) for name, op in ours_ops(cs).items()}


def apply_tiles(path):
    """Override ``triton_mhc.TILES`` from a JSON file (as written by tune_tiles.py)."""
    import json

    with open(path) as fh:
        tiles = json.load(fh)
    for key, value in tiles.items():
        if isinstance(value, dict):
            value = {int(n): tuple(v) for n, v in value.items()}
        elif isinstance(value, list):
            value = tuple(value)
        setattr(triton_mhc.TILES, key, value)
    return tiles


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="*", default=["16384x2048", "16384x4096", "16384x7168",
                                                  "65536x2048", "65536x4096", "65536x7168"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-te", action="store_true")
    p.add_argument("--te-root", default=".te")
    p.add_argument("--out", default=None)
    p.add_argument("--tiles", default=None, help="JSON tile overrides (tune_tiles.py)")
    args = p.parse_args()
    if args.tiles:
        print("tiles:", apply_tiles(args.tiles))

    te = None
    if not args.no_te:
        from te_peer import load_te_mhc

        te = load_te_mhc(args.te_root)
    bw = copy_bandwidth()
    impls = {"ours": (chain(triton_mhc.pre, triton_mhc.combine), False),
             "reference": (chain(ref.pre, ref.expand_combine), False)}
    if not args.no_compile:
        impls["compiled ref"] = (chain(torch.compile(ref.pre, dynamic=True),
                                       torch.compile(ref.expand_combine, dynamic=True)), False)
    if te is not None:
        impls["TE 2.20.2"] = (te_chain(te), True)

    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}; copy bandwidth {bw:.0f} GB/s (read+write); "
             f"n={N}, bf16 x/f, fp32 mappings, Sinkhorn {ITERS} iterations; times in ms per "
             f"sublayer (chains of {DEPTH}; median of triton.testing.do_bench)", ""]
    header = "| M | C | impl | fwd | fwd+bwd | fwd / ours | fwd+bwd / ours |"
    lines += [header, "|---|---|---|---|---|---|---|"]
    part_lines = ["", "| M | C | our kernel | ms | GB/s | % of copy BW |", "|---|---|---|---|---|---|"]
    for size in args.sizes:
        m, c = (int(v) for v in size.split("x"))
        cs = Case(m, c)
        rows = {}
        for name, (fwd, is_te) in impls.items():
            try:
                rows[name] = time_impl(fwd, cs, is_te)
            except torch.OutOfMemoryError:
                rows[name] = None
            torch.cuda.empty_cache()
        ours = rows["ours"]
        for name, r in rows.items():
            if r is None:
                lines.append(f"| {m} | {c} | {name} | OOM | OOM | | |")
                continue
            lines.append(f"| {m} | {c} | {name} | {r['fwd']:.3f} | {r['fwd+bwd']:.3f} | "
                         f"{r['fwd'] / ours['fwd']:.2f} | {r['fwd+bwd'] / ours['fwd+bwd']:.2f} |")
        parts = time_parts_ours(cs)
        for k, ms in parts.items():
            gbs = cs.bytes()[k] / ms / 1e6
            part_lines.append(f"| {m} | {c} | {k} | {ms:.3f} | {gbs:.0f} | {100 * gbs / bw:.0f}% |")
        print("\n".join(lines[-len(rows):]), flush=True)
        del cs
        torch.cuda.empty_cache()
    text = "\n".join(lines + part_lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"\nbench wall time {time.time() - t0:.0f} s")
