"""GPU benchmark of the mHC ops: ours (fused Triton) vs PyTorch reference (eager and
torch.compile) vs TransformerEngine 2.20.2's Triton mHC, measured side by side in one run.

For every (M = s*b, C), n = 4, bf16 activations, fp32 mapping parameters it times (median of
``triton.testing.do_bench``):

* ``pre fwd``   mappings + aggregate (TE: projection, scale, sinkhorn, aggregate kernels)
* ``post fwd``  expand-combine with bias
* ``fwd``       pre + post of one sublayer
* ``fwd+bwd``   pre + post forward and backward (grads for x, f, bias, phi, alpha, b)
* ours only: ``pre bwd`` / ``post bwd`` (backward alone), each with achieved GB/s and % of
  the measured device-to-device copy bandwidth, counting each input read once and each
  output written once.

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


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth():
    a = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / ms / 1e6  # GB/s, read + write


class Case:
    def __init__(self, m, c, dtype=torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.m, self.c = m, c
        self.x = torch.randn(m, N, c, device="cuda", dtype=dtype, generator=g)
        self.f = torch.randn(m, c, device="cuda", dtype=dtype, generator=g)
        self.fb = torch.randn(c, device="cuda", dtype=dtype, generator=g)
        mm = 2 * N + N * N
        self.phi = torch.randn(mm, N * c, device="cuda", generator=g) / (N * c) ** 0.5
        self.alpha = torch.full((3,), 0.5, device="cuda")
        self.bias = torch.randn(mm, device="cuda", generator=g)
        self.gy = torch.randn(m, c, device="cuda", dtype=dtype, generator=g)
        self.gx = torch.randn(m, N, c, device="cuda", dtype=dtype, generator=g)
        # TE layout: [s, b, C, n] (stream-minor); same bytes, its own phi column order.
        self.x_te = self.x.permute(0, 2, 1).contiguous().view(m, 1, c, N)
        self.f_te = self.f.view(m, 1, c)
        self.beta_te = self.bias.view(1, mm)
        self.gx_te = self.gx.permute(0, 2, 1).contiguous().view(m, 1, c, N)

    def bytes(self, elt=2):
        x = self.m * N * self.c * elt
        return {"pre fwd": x + x / N, "post fwd": x + x / N + x,
                "pre bwd": 2 * x + x / N, "post bwd": 3 * x + 2 * x / N}


def ours_or_ref(pre, post):
    def fwd(cs, leaves=None):
        x, phi, alpha, bias, f, fb = leaves or (cs.x, cs.phi, cs.alpha, cs.bias, cs.f, cs.fb)
        y, hp, hq, hr = pre(x, phi, alpha, bias, ITERS, EPS)
        return y, post(x, f, fb, hr, hq)
    return fwd


def te_fwd(te):
    def fwd(cs, leaves=None):
        x, phi, alpha, bias, f, fb = leaves or (cs.x_te, cs.phi, cs.alpha, cs.beta_te, cs.f_te, cs.fb)
        y, hq, hr = te.mhc_generate_mix_and_aggregate(x, phi, alpha, bias)
        return y, te.mhc_fused_expand_combine(f, fb, hq, x, hr, N)
    return fwd


def fwd_bwd_step(fwd, cs, is_te=False):
    """A closure running one pre+post forward and backward on fresh leaf copies."""
    base = (cs.x_te, cs.phi, cs.alpha, cs.beta_te, cs.f_te, cs.fb) if is_te else \
        (cs.x, cs.phi, cs.alpha, cs.bias, cs.f, cs.fb)
    leaves = [t.detach().clone().requires_grad_() for t in base]
    gx = cs.gx_te if is_te else cs.gx
    gy = cs.gy.view(cs.m, 1, cs.c) if is_te else cs.gy

    def step():
        for t in leaves:
            t.grad = None
        y, out = fwd(cs, leaves)
        torch.autograd.backward([y, out], [gy, gx])
    return step


def time_impl(name, fwd, cs, is_te=False):
    row = {}
    with torch.no_grad():
        row["fwd"] = bench(lambda: fwd(cs))
    step = fwd_bwd_step(fwd, cs, is_te)
    row["fwd+bwd"] = bench(step)
    return row


def time_parts_ours(cs):
    parts = {}
    x, phi, alpha, bias, f, fb = (cs.x, cs.phi, cs.alpha, cs.bias, cs.f, cs.fb)
    with torch.no_grad():
        parts["pre fwd"] = bench(lambda: triton_mhc.pre(x, phi, alpha, bias, ITERS, EPS))
        _, hp, hq, hr = triton_mhc.pre(x, phi, alpha, bias, ITERS, EPS)
        parts["post fwd"] = bench(lambda: triton_mhc.combine(x, f, fb, hr, hq))
    xl = x.detach().clone().requires_grad_()
    pl = [t.detach().clone().requires_grad_() for t in (phi, alpha, bias)]
    outs = triton_mhc.pre(xl, *pl, ITERS, EPS)
    grads = [cs.gy, torch.randn_like(hp), torch.randn_like(hq), torch.randn_like(hr)]
    # autograd.grad, not backward: no accumulation into .grad inside the timed region
    parts["pre bwd"] = bench(lambda: torch.autograd.grad(outs, [xl] + pl, grads,
                                                         retain_graph=True))
    ls = [t.detach().clone().requires_grad_() for t in (x, f, fb, hr, hq)]
    out = triton_mhc.combine(*ls)
    parts["post bwd"] = bench(lambda: torch.autograd.grad(out, ls, cs.gx, retain_graph=True))
    return parts


def apply_tiles(path):
    """Override ``triton_mhc.TILES`` from a JSON file (as written by tune_tiles.py)."""
    import json

    with open(path) as fh:
        tiles = json.load(fh)
    for key, value in tiles.items():
        if key == "proj":
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
    impls = {"ours": ours_or_ref(triton_mhc.pre, triton_mhc.combine),
             "reference": ours_or_ref(ref.pre, ref.expand_combine)}
    if not args.no_compile:
        impls["compiled ref"] = ours_or_ref(torch.compile(ref.pre, dynamic=True),
                                            torch.compile(ref.expand_combine, dynamic=True))
    if te is not None:
        impls["TE 2.20.2"] = te_fwd(te)

    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}; copy bandwidth {bw:.0f} GB/s (read+write); "
             f"n={N}, bf16 x/f, fp32 mappings, Sinkhorn {ITERS} iterations; times in ms "
             "(median of triton.testing.do_bench)", ""]
    header = "| M | C | impl | fwd | fwd+bwd | fwd / ours | fwd+bwd / ours |"
    lines += [header, "|---|---|---|---|---|---|---|"]
    part_lines = ["", "| M | C | our kernel | ms | GB/s | % of copy BW |", "|---|---|---|---|---|---|"]
    for size in args.sizes:
        m, c = (int(v) for v in size.split("x"))
        cs = Case(m, c)
        rows = {}
        for name, fwd in impls.items():
            try:
                rows[name] = time_impl(name, fwd, cs, is_te=name.startswith("TE"))
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
