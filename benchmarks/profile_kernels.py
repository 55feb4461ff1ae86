"""Per-kernel GPU time of one sublayer's pre+post forward+backward (ours, and TE 2.20.2 when
carried).

Complements ``bench_mhc.py`` (which times whole ops): runs ``torch.profiler`` over a few
steps of the same chain of ``DEPTH`` sublayers and prints each CUDA kernel's mean time per
sublayer, so one can see which kernel bounds the op.

    python benchmarks/profile_kernels.py [--size 16384x4096] [--no-te] [--steps 10] [--tiles tiles.json]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import DEPTH, Case, apply_tiles, chain, fwd_bwd_step, te_chain  # noqa: E402
from mhc_megatron.kernels import triton_mhc  # noqa: E402


def cuda_kernel_ms(fn, steps, warmup=3):
    """``{kernel name (70 chars): CUDA ms per fn() call}``, from the torch profiler over
    ``steps`` calls after ``warmup``: device time only, idle gaps and host time excluded."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name[:70]] += ev.device_time / 1e3 / steps
    return per_kernel


def profile_step(fwd, cs, is_te, steps):
    per_call = cuda_kernel_ms(fwd_bwd_step(fwd, cs, is_te), steps)
    per_sublayer = {name: ms / DEPTH for name, ms in per_call.items()}
    return sorted(per_sublayer.items(), key=lambda kv: -kv[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="16384x4096")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-te", action="store_true")
    p.add_argument("--te-root", default=".te")
    p.add_argument("--tiles", default=None, help="JSON tile overrides (tune_tiles.py)")
    args = p.parse_args()
    if args.tiles:
        apply_tiles(args.tiles)
    m, c = (int(v) for v in args.size.split("x"))
    cs = Case(m, c)
    impls = {"ours": (chain(triton_mhc.pre, triton_mhc.combine), False)}
    if not args.no_te:
        from te_peer import load_te_mhc

        impls["TE 2.20.2"] = (te_chain(load_te_mhc(args.te_root)), True)
    print(f"{torch.cuda.get_device_name()}; M={m} C={c} n=4 bf16; CUDA kernel ms per sublayer "
          f"(fwd+bwd of chains of {DEPTH})")
    for name, (fwd, is_te) in impls.items():
        rows = profile_step(fwd, cs, is_te, args.steps)
        print(f"\n{name}: total {sum(v for _, v in rows):.3f} ms")
        for k, v in rows:
            print(f"  {v:8.3f}  {k}")


if __name__ == "__main__":
    main()
