"""Side-by-side GPU benchmark of DeepSeek-V4's mHC ops: ours (fused Triton, the paper's form and
DeepSeek-V4's) against DeepSeek's TileKernels (TileLang), in one process, with a correctness
gate against our PyTorch reference.

For each size (T tokens x C channels, n = 4 streams, bf16 activations, fp32 mappings,
Sinkhorn ITERS = 20, RMS eps 1e-6, DeepSeek-V4 eps 1e-6, its H_res transposed) a table of:

* ``pre fwd`` / ``combine fwd`` / ``head fwd``: the op alone under ``torch.no_grad``
  (TileKernels' pre then runs its fused inference kernel, ``mhc_pre_big_fuse``);
* ``pre fwd+bwd``: forward and ``autograd.grad`` of ``(y, h_post, h_res)`` for x, phi, alpha,
  bias (what a model gives it; TileKernels is handed a zeroed x-gradient buffer, see
  ``tilekernels_peer.py``); ``combine fwd+bwd``: for x, f, h_res, h_post (mappings from the
  same impl's pre); ``head fwd+bwd``: for x, phi, alpha, bias;
* ``sublayer fwd+bwd``: pre, a stand-in sublayer (forward returns a fixed f, backward hands
  df to y as dy, no kernels), combine, and the gradient of the streams out for x, phi, alpha,
  bias: each implementation's own x-gradient handoff between its two ops, as in a model.

Columns: median ms of ``triton.testing.do_bench`` (which flushes L2 before every rep by
zeroing a 256 MB buffer outside the timed region), the achieved GB/s counting each input
read once and each output written once (x-sized and C-sized tensors only, bf16), that as a
% of the measured device-to-device copy bandwidth (``bench_mhc.copy_bandwidth``: a 2 GiB
copy, read + write), the time over ours in DeepSeek-V4's form, and the max relative error
(``max|a - ref| / max|ref|`` over every output and every gradient of the op) against
``mhc_megatron.kernels.reference`` in fp32 in the same form, on the first ``--check-tokens``
tokens of the same inputs.

Prepare the GPU host as ``benchmarks/README.md`` says (TileKernels in ``.tilekernels/``,
tilelang 0.1.11 and apache-tvm-ffi 0.1.11 in ``.whl_tile/site``), then from the repository
root::

    PYTHONPATH=.whl_tile/site:. python3 benchmarks/bench_dsv4.py --out dsv4.md
    python3 benchmarks/bench_dsv4.py --sizes 16384x4096 --no-tilekernels   # ours only
    python benchmarks/bench_dsv4.py --dry-run     # CPU: tiny size, reference ops; plumbing only

With ``TRITON_INTERPRET=1`` the dry run also runs our Triton ops in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from mhc_megatron.kernels import reference as ref  # noqa: E402
from mhc_megatron.kernels.reference import PAPER, MappingForm  # noqa: E402

N = 4
ITERS = 20
EPS = 1e-6  # RMS eps
DSV4 = MappingForm("deepseek_v4", 1e-6, True)
DEFAULT_SIZES = ["4096x4096", "16384x4096", "16384x7168"]
OPS = ["pre fwd", "combine fwd", "head fwd", "pre fwd+bwd", "combine fwd+bwd",
       "head fwd+bwd", "sublayer fwd+bwd"]
COLUMNS = ["op", "impl", "ms", "GB/s", "% of copy BW", "/ baseline", "max rel err"]


@dataclass
class Impl:
    """An implementation's ops with the benchmark's fixed constants bound."""

    name: str
    form: MappingForm
    pre: Callable  # (x, phi, alpha, bias) -> (y, h_pre, h_post, h_res)
    combine: Callable  # (x, f, h_res, h_post) -> x'
    head: Callable | None  # (x, phi [n, nC], alpha [1], bias [n]) -> y
    ops: tuple = tuple(OPS)
    release: Callable = lambda *t: None  # drop state an op left on its inputs (TileKernels)
    unsupported: Callable = lambda T, C, backward: None  # a reason, or None


def reference_impl(form: MappingForm, name: str) -> Impl:
    return Impl(
        name, form,
        pre=lambda x, phi, a, b: ref.pre(x, phi, a, b, ITERS, EPS, form),
        combine=lambda x, f, hr, hq: ref.expand_combine(x, f, None, hr, hq),
        head=lambda x, phi, a, b: ref.output_head(x, phi, a, b, EPS, DSV4.eps),
        ops=tuple(OPS) if form.name == "deepseek_v4" else _PAPER_OPS)


_PAPER_OPS = ("pre fwd", "pre fwd+bwd", "sublayer fwd+bwd")  # combine: the same kernel


def ours_impl(form: MappingForm, name: str) -> Impl:
    from mhc_megatron.kernels import triton_mhc

    head = getattr(triton_mhc, "output_head", None)
    return Impl(
        name, form,
        pre=lambda x, phi, a, b: triton_mhc.pre(x, phi, a, b, ITERS, EPS, form=form),
        combine=lambda x, f, hr, hq: triton_mhc.combine(x, f, None, hr, hq),
        head=None if head is None else (lambda x, phi, a, b: head(x, phi, a, b, EPS, DSV4.eps)),
        ops=tuple(OPS) if form.name == "deepseek_v4" else _PAPER_OPS)


def tilekernels_impl(tk) -> Impl:
    label = "TileKernels" + (f" {tk.commit[:7]}" if tk.commit else "")
    return Impl(
        label, DSV4,
        pre=lambda x, phi, a, b: tk.pre(x, phi, a, b, ITERS, EPS, form=DSV4),
        combine=lambda x, f, hr, hq: tk.combine(x, f, None, hr, hq),
        head=lambda x, phi, a, b: tk.output_head(x, phi, a, b, EPS, DSV4.eps),
        release=tk.release,
        unsupported=lambda T, C, backward: tk.unsupported(T, N, C, torch.bfloat16, backward))


class _Sublayer(torch.autograd.Function):
    """Stand-in sublayer: forward returns the fixed output ``f`` (a view, no kernel), backward
    hands ``df`` to ``y`` as ``dy`` (no kernel), so the graph runs the combine's backward,
    then the pre's, as a model does."""

    @staticmethod
    def forward(ctx, y, f):
        return f.view_as(f)

    @staticmethod
    def backward(ctx, df):
        return df, None


class Data:
    """One size's inputs (the same for every implementation) and upstream gradients."""

    def __init__(self, T, C, device, dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        m = 2 * N + N * N

        def randn(*shape, dt=torch.float32, scale=1.0):
            return (torch.randn(*shape, device=device, generator=g) * scale).to(dt)

        self.T, self.C = T, C
        self.x = randn(T, N, C, dt=dtype)
        self.f = randn(T, C, dt=dtype)
        self.phi = randn(m, N * C, scale=(N * C) ** -0.5)
        self.alpha = torch.full((3,), 0.5, device=device)
        self.bias = randn(m)
        self.phi_h = randn(N, N * C, scale=(N * C) ** -0.5)
        self.alpha_h = torch.full((1,), 0.5, device=device)
        self.bias_h = randn(N)
        self.gx = randn(T, N, C, dt=dtype)
        self.gy = randn(T, C, dt=dtype)
        self.gh_post = randn(T, N)
        self.gh_res = randn(T, N, N)

    def first(self, t):
        """The first ``t`` tokens (contiguous copies)."""
        out = Data.__new__(Data)
        out.__dict__.update(self.__dict__)
        out.T = min(t, self.T)
        for k in ("x", "f", "gx", "gy", "gh_post", "gh_res"):
            setattr(out, k, getattr(self, k)[:out.T].contiguous())
        return out


def op_case(impl: Impl, op: str, d: Data):
    """``(inputs, fwd(*inputs) -> outputs, backward: [(output index, grad)], grad inputs)``
    for ``op`` (without its " fwd" / " fwd+bwd" suffix)."""
    if op == "pre":
        def fwd(x, phi, a, b):
            return list(impl.pre(x, phi, a, b))
        return [d.x, d.phi, d.alpha, d.bias], fwd, [(0, d.gy), (2, d.gh_post), (3, d.gh_res)], 4
    if op == "combine":
        with torch.no_grad():
            _, _, h_post, h_res = impl.pre(d.x, d.phi, d.alpha, d.bias)

        def fwd(x, f, hr, hq):
            return [impl.combine(x, f, hr, hq)]
        return [d.x, d.f, h_res, h_post], fwd, [(0, d.gx)], 4
    if op == "head":
        def fwd(x, phi, a, b):
            return [impl.head(x, phi, a, b)]
        return [d.x, d.phi_h, d.alpha_h, d.bias_h], fwd, [(0, d.gy)], 4
    if op == "sublayer":
        def fwd(x, phi, a, b, f):
            y, _, h_post, h_res = impl.pre(x, phi, a, b)
            return [y, impl.combine(x, _Sublayer.apply(y, f), h_res, h_post)]
        return [d.x, d.phi, d.alpha, d.bias, d.f], fwd, [(1, d.gx)], 4
    raise ValueError(op)


def _split(op_name):
    op, mode = op_name.split(" ")
    return op, mode == "fwd+bwd"


def _leaves(inputs, n_grad, backward):
    """Fresh copies (own storage, same strides) of the inputs; the first ``n_grad`` require
    grad when timing a backward."""
    out = []
    for i, t in enumerate(inputs):
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        c.copy_(t.detach())
        out.append(c.requires_grad_(backward and i < n_grad))
    return out


def make_step(impl: Impl, op_name: str, d: Data):
    """A zero-argument closure running the op once (as timed) and the leaves it reuses."""
    op, backward = _split(op_name)
    inputs, fwd, grads, n_grad = op_case(impl, op, d)
    leaves = _leaves(inputs, n_grad, backward)
    if not backward:
        def step():
            with torch.no_grad():
                fwd(*leaves)
        return step, leaves
    wrt = leaves[:n_grad]

    def step():
        outs = fwd(*leaves)
        torch.autograd.grad([outs[i] for i, _ in grads], wrt, [g for _, g in grads])
    return step, leaves


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def check(impl: Impl, oracle: Impl, op_name: str, d: Data) -> float:
    """Max relative error of the op's outputs (and, for fwd+bwd, of its gradients) against
    ``oracle`` (the fp32 reference in the same form) on the same inputs, run as timed (a
    forward alone under ``torch.no_grad``): the oracle gets fp32 copies, and for the combine
    the mappings ``impl``'s own pre made."""
    op, backward = _split(op_name)
    inputs, fwd, grads, n_grad = op_case(impl, op, d)
    if op == "combine":
        def fwd_ref(x, f, hr, hq):
            return [oracle.combine(x, f, hr, hq)]
    else:
        fwd_ref = op_case(oracle, op, d)[1]
    leaves = _leaves(inputs, n_grad, backward)  # fwd alone: under no_grad, as timed
    leaves_ref = [t.detach().float().requires_grad_(backward and i < n_grad)
                  for i, t in enumerate(inputs)]
    with torch.set_grad_enabled(backward):
        outs, outs_ref = fwd(*leaves), fwd_ref(*leaves_ref)
    errs = [rel_err(a, b) for a, b in zip(outs, outs_ref) if a is not None and b is not None]
    if backward:
        gs = torch.autograd.grad([outs[i] for i, _ in grads], leaves[:n_grad],
                                 [g for _, g in grads])
        gs_ref = torch.autograd.grad([outs_ref[i] for i, _ in grads], leaves_ref[:n_grad],
                                     [g.float() for _, g in grads])
        errs += [rel_err(a, b) for a, b in zip(gs, gs_ref)]
    impl.release(*leaves)
    return max(errs)


def sizes_bytes(op_name: str, T: int, C: int, elt: int = 2) -> int:
    """Bytes the op must move at least: each x-sized ([T, n, C]) and C-sized ([T, C]) input
    read once, each output written once (mappings and parameters not counted)."""
    X, Y = T * N * C * elt, T * C * elt
    return {"pre fwd": X + Y, "head fwd": X + Y, "combine fwd": 2 * X + Y,
            "pre fwd+bwd": 3 * X + 2 * Y, "head fwd+bwd": 3 * X + 2 * Y,
            "combine fwd+bwd": 5 * X + 3 * Y, "sublayer fwd+bwd": 6 * X + 5 * Y}[op_name]


def cpu_bench(fn, reps=3):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cpu_copy_bandwidth():
    a = torch.randn(1 << 24).to(torch.bfloat16)
    ms = cpu_bench(lambda: a.clone())
    return 2 * a.numel() * 2 / ms / 1e6


def run_size(T, C, impls, oracles, baseline, timer, bw, device, check_tokens, ops):
    d = Data(T, C, device)
    small = d.first(check_tokens)
    rows = []
    for op_name in ops:
        op, backward = _split(op_name)
        results = {}
        for impl in impls:
            if op_name not in impl.ops or (op == "head" and impl.head is None):
                continue
            why = impl.unsupported(T, C, backward)
            if why is None:
                why = impl.unsupported(small.T, C, backward)
            if why is not None:
                results[impl.name] = ("skipped: " + why, None)
                continue
            try:
                err = check(impl, oracles[impl.form], op_name, small)
                step, leaves = make_step(impl, op_name, d)
                ms = timer(step)
                impl.release(*leaves)
                del step, leaves
                results[impl.name] = (ms, err)
            except torch.OutOfMemoryError:
                results[impl.name] = ("OOM", None)
            except Exception as exc:  # one failing op must not lose the others' numbers
                traceback.print_exc()
                results[impl.name] = (f"failed: {type(exc).__name__}: {str(exc)[:80]}", None)
            if device == "cuda":
                torch.cuda.empty_cache()
        base = results.get(baseline, (None,))[0]
        for name, (ms, err) in results.items():
            if not isinstance(ms, float):
                rows.append([op_name, name, str(ms), "", "", "", ""])
                continue
            gbs = sizes_bytes(op_name, T, C) / ms / 1e6
            ratio = f"{ms / base:.2f}" if isinstance(base, float) else ""
            rows.append([op_name, name, f"{ms:.3f}", f"{gbs:.0f}", f"{100 * gbs / bw:.0f}%",
                         ratio, f"{err:.1e}"])
    return rows


def table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", default=None, help="TxC ... (default %s; dry run 64x256)"
                   % " ".join(DEFAULT_SIZES))
    p.add_argument("--tilekernels-root", default=".tilekernels")
    p.add_argument("--no-tilekernels", action="store_true")
    p.add_argument("--ops", nargs="*", default=OPS, choices=OPS, metavar="OP",
                   help="a subset of: " + ", ".join(f"'{o}'" for o in OPS))
    p.add_argument("--check-tokens", type=int, default=2048,
                   help="tokens of the correctness gate (the first ones of each size)")
    p.add_argument("--rep", type=int, default=200, help="do_bench's rep (ms of timing per op)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny size, reference ops only: the script's plumbing, no timings")
    p.add_argument("--out", default=None, help="also write the tables (markdown) here")
    args = p.parse_args(argv)

    oracles = {PAPER: reference_impl(PAPER, "reference (paper)"),
               DSV4: reference_impl(DSV4, "reference (DSV4)")}
    notes, tk_notes = [], []
    if args.dry_run:
        device, sizes = "cpu", args.sizes or ["64x256"]
        impls = list(oracles.values())
        baseline = "reference (DSV4)"
        if os.environ.get("TRITON_INTERPRET") == "1":
            impls += [ours_impl(PAPER, "ours (paper)"), ours_impl(DSV4, "ours (DSV4)")]
        bw = cpu_copy_bandwidth()
        timer = cpu_bench
        head = [f"DRY RUN on CPU (torch {torch.__version__}): numbers mean nothing; "
                f"copy bandwidth {bw:.0f} GB/s"]
    else:
        import triton
        from bench_mhc import bench, copy_bandwidth

        device, sizes = "cuda", args.sizes or DEFAULT_SIZES
        impls = [ours_impl(PAPER, "ours (paper)"), ours_impl(DSV4, "ours (DSV4)")]
        baseline = "ours (DSV4)"
        tk, tk_line = None, "TileKernels: not run (--no-tilekernels)"
        if not args.no_tilekernels:
            try:
                from tilekernels_peer import load_tilekernels

                tk = load_tilekernels(args.tilekernels_root)
                impls.append(tilekernels_impl(tk))
                tk_line = (f"TileKernels {tk.commit or '(commit unknown)'} from "
                           f"{args.tilekernels_root}, tilelang {tk.tilelang_version}")
            except Exception as exc:
                traceback.print_exc()
                tk_line = f"TileKernels: NOT LOADED ({type(exc).__name__}: {exc})"
        bw = copy_bandwidth()
        tk_notes = [] if tk is None else [
            lambda: tk.head_composed and "TileKernels' head: its mhc_head was refused by "
            "tilelang (it hands a non-compact slice of the mixes to a kernel declaring a compact "
            "buffer); the rows run mhc_head's own ops with that slice made contiguous "
            "(tilekernels_peer.TileKernelsMHC._head_ops)"]
        timer = lambda fn: bench(fn, rep=args.rep)  # noqa: E731
        head = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
                f"{triton.__version__}; {tk_line}; copy bandwidth {bw:.0f} GB/s (read+write)"]
        notes.append("ms: median of triton.testing.do_bench (L2 flushed before each rep)")
        if tk is not None:
            notes.append("TileKernels' pre/head fwd+bwd include one memset of x: the zeroed "
                         "dx buffer its backward accumulates into (in a model the pre gets the "
                         "combine's dx instead: the sublayer rows)")
    head.append(f"n={N}, bf16 x/f, fp32 mappings, Sinkhorn {ITERS} iterations, RMS eps {EPS:g}, "
                f"DeepSeek-V4 eps {DSV4.eps:g} (H_res transposed); GB/s counts each x-/C-sized "
                f"input read once and output written once; '/ baseline' = ms / {baseline}'s; "
                f"max rel err = max|a - ref| / max|ref| over outputs (and gradients) against the "
                f"fp32 reference in the impl's form on the first {args.check_tokens} tokens")
    head += notes
    text = head[:]
    print("\n".join(head), flush=True)
    for size in sizes:
        T, C = (int(v) for v in size.lower().split("x"))
        rows = run_size(T, C, impls, oracles, baseline, timer, bw, device, args.check_tokens,
                        args.ops)
        block = ["", f"### T={T}, C={C}", ""] + table(rows)
        print("\n".join(block), flush=True)
        text += block
    late = [note for note in (f() for f in tk_notes) if note]
    if late:
        print("\n" + "\n".join(late))
        text += [""] + late
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(text) + "\n")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"\nbench wall time {time.time() - t0:.0f} s")
