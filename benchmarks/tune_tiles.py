"""Coordinate search of the Triton kernels' tile sizes on the GPU (n=4, bf16).

For each group of ``triton_mhc.TILES`` in turn it times the op that group drives (the ops
of ``bench_mhc.ours_ops``) over a few candidates, keeps the fastest, and goes on to the next
group; it prints every timing and
writes the result as JSON for ``bench_mhc.py --tiles``. The chosen values are then copied
into ``KernelTiles``' defaults by hand (with the table that justifies them).

    python benchmarks/tune_tiles.py [--size 16384x4096] [--out tiles.json] [--groups dx ...]
                                    [--metric op|kernels]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_mhc import Case, bench, ours_ops  # noqa: E402
from profile_kernels import cuda_kernel_ms  # noqa: E402
from mhc_megatron.kernels import triton_mhc  # noqa: E402

T = triton_mhc.TILES


GROUPS = [  # (TILES field, op it drives, candidates)
    ("proj", "pre fwd", [{4: v} for v in [(64, 128, 4, 3), (64, 64, 8, 3), (128, 128, 8, 2),
                                         (64, 128, 8, 4), (32, 128, 4, 4), (64, 256, 8, 2)]]),
    ("target_programs", "pre fwd", [512, 1024, 2048]),
    ("sweep", "pre fwd", [(8, 1024, 8), (16, 512, 4), (8, 512, 4), (16, 512, 8), (4, 1024, 4)]),
    ("combine_fwd", "post fwd", [(2, 512, 4), (4, 256, 4), (8, 128, 4), (4, 128, 4)]),
    ("maps", "sublayer bwd", [(16, 1), (8, 1), (32, 1), (16, 2), (64, 4)]),
    ("dx", "sublayer bwd", [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 8, 2),
                            (32, 64, 4, 3), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2),
                            (16, 64, 4, 3), (16, 64, 4, 2), (32, 128, 8, 2), (128, 32, 4, 2),
                            (64, 128, 4, 2), (64, 128, 8, 2), (32, 128, 4, 3), (128, 64, 8, 2)]),
    ("dx_streams", "sublayer bwd", [1, 2, 4]),
    ("combine_bwd", "sublayer bwd", [(8, 128, 4, 2), (8, 128, 4, 3), (8, 128, 4, 1),
                                     (4, 128, 4, 2), (4, 256, 4, 2), (8, 256, 8, 2),
                                     (16, 64, 8, 2)]),
]
DICT_FIELDS = ("proj",)  # per-n tables: a candidate replaces the n=4 entry


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="16384x4096")
    p.add_argument("--out", default=None)
    p.add_argument("--groups", nargs="*", default=None,
                   help="TILES fields to tune, in this order (default all)")
    p.add_argument("--metric", choices=["op", "kernels"], default="op",
                   help="op: do_bench of the op (default); kernels: the op's CUDA kernel "
                        "time (torch profiler: idle gaps and host time excluded, so small "
                        "tile effects stay visible where do_bench moves by a few per cent)")
    args = p.parse_args()
    m, c = (int(v) for v in args.size.split("x"))
    cs = Case(m, c)
    what = "median of do_bench" if args.metric == "op" else "CUDA kernel time per call"
    print(f"{torch.cuda.get_device_name()}; M={m} C={c} n=4 bf16; ms ({what})")
    by_field = {field: (field, op, candidates) for field, op, candidates in GROUPS}
    order = GROUPS if args.groups is None else [by_field[g] for g in args.groups]
    for field, op, candidates in order:  # --groups may repeat a field (a second round)
        best = None
        for cand in candidates:
            value = {**getattr(T, field), **cand} if field in DICT_FIELDS else cand
            setattr(T, field, value)
            try:
                fn = ours_ops(cs)[op]
                ms = (bench(fn, rep=100) if args.metric == "op"
                      else sum(cuda_kernel_ms(fn, steps=30).values()))
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                print(f"  {field}={cand}: failed ({type(exc).__name__})")
                continue
            print(f"  {field}={cand}: {op} {ms:.3f} ms", flush=True)
            if best is None or ms < best[0]:
                best = (ms, value)
        setattr(T, field, best[1])
        print(f"{field}: best {best[1]} ({best[0]:.3f} ms)", flush=True)
    tiles = {k: v for k, v in dataclasses.asdict(T).items()}
    for key in DICT_FIELDS:
        tiles[key] = {str(k): v for k, v in tiles[key].items()}
    print(json.dumps(tiles))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(tiles, fh)


if __name__ == "__main__":
    main()
