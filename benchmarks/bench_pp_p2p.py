"""What mHC's n streams cost at a pipeline-stage boundary: P2P bytes and time.

    torchrun --nproc-per-node=2 benchmarks/bench_pp_p2p.py [--sizes 4096x1x4096 1024x8x768]
        [--streams 4] [--iters 50] [--out table.md]

Two ranks are two pipeline stages. Per size ``s x b x C`` and case, stage 0 sends one
micro-batch's activation forward and stage 1 sends its gradient back, through Megatron's own
``P2PCommunicator`` with the calls of its 1F1B schedule (``send_forward`` / ``recv_forward``,
``send_backward`` / ``recv_backward``), configured by the model config the case builds:

* ``baseline``: ``MHCTransformerConfig`` with mHC off: ``[s, b, C]``, fixed shapes (Megatron
  sizes the receive buffer from the config);
* ``mHC``: mHC on, n streams: ``[s, b, n*C]``; the config turns ``variable_seq_lengths`` on
  for PP (see README, "Pipeline stages"), so a 3-integer shape message precedes each tensor;
* ``mHC, fixed shapes``: ``[s, b, n*C]`` with ``variable_seq_lengths`` forced off: the stream
  bytes alone, to separate them from the shape exchange (not a layout Megatron can run: its
  buffers would be ``[s, b, C]``).

For each case: bytes a boundary moves per micro-batch (forward + backward), milliseconds per
round trip (median of ``--iters``, after warm-up), achieved bandwidth, and the extra time per
micro-batch over the baseline; plus the raw ``torch.distributed`` send/recv round trip of
the largest message (the floor a P2P layer can reach). On CPU ranks (gloo, no CUDA) it runs
as a smoke test only; its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multirank import report_and_finish  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["4096x1x4096", "1024x8x768"],
                   help="s x b x C of one micro-batch")
    p.add_argument("--streams", type=int, default=4, help="n")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the table here (rank 0)")
    return p.parse_args(argv)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stage_config(hidden: int, streams: int, mhc: bool, force_fixed_shapes: bool = False):
    """The P2P communicator's config, as a model of this width configures it."""
    from mhc_megatron.config import MHCTransformerConfig

    cfg = MHCTransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=8,
        pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16, bf16=True,
        params_dtype=torch.bfloat16, enable_hyper_connections=mhc, num_residual_streams=streams,
        batch_p2p_comm=torch.cuda.is_available())  # gloo has no batched isend/irecv
    if force_fixed_shapes:
        cfg.variable_seq_lengths = False
    return cfg


def _timed(round_trip, iters: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``round_trip()`` after ``warmup`` more, both
    ranks starting together (the time is stage 0's: it starts and ends a round trip)."""
    times = []
    for i in range(warmup + iters):
        torch.distributed.barrier()
        _sync()
        start = time.perf_counter()
        round_trip()
        _sync()
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return times


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def round_trips(comm, shape, iters: int, warmup: int) -> list[float]:
    """A forward send of ``shape`` from stage 0 and the gradient's send back, through
    Megatron's P2P communicator."""
    x = torch.randn(shape, device=_device(), dtype=torch.bfloat16)

    def round_trip():
        if comm.is_pp_first_stage:
            comm.send_forward(x, is_last_stage=False)
            assert comm.recv_backward(shape, is_last_stage=False).shape == x.shape
        else:
            comm.send_backward(comm.recv_forward(shape, is_first_stage=False),
                               is_first_stage=False)

    return _timed(round_trip, iters, warmup)


def raw_round_trips(shape, iters: int, warmup: int) -> list[float]:
    """The same round trip with bare torch.distributed send/recv of one preallocated buffer."""
    buf = torch.empty(shape, device=_device(), dtype=torch.bfloat16)
    peer = 1 - torch.distributed.get_rank()

    def round_trip():
        if peer == 1:
            torch.distributed.send(buf, peer)
            torch.distributed.recv(buf, peer)
        else:
            torch.distributed.recv(buf, peer)
            torch.distributed.send(buf, peer)

    return _timed(round_trip, iters, warmup)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        from mhc_testing import cpu_training

        cpu_training.install_cuda_to_cpu()  # Megatron's P2P buffers are device="cuda"
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mhc_testing.cpu import init_single_process_group, setup_cpu_megatron

    init_single_process_group()
    if torch.distributed.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node=2 (two pipeline stages)")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    setup_cpu_megatron()  # seeds; CPU ranks: torch.cuda.current_device() -> "cpu"
    group = parallel_state.get_pipeline_model_parallel_group()
    n = args.streams
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo: smoke only)"
    lines = [f"P2P at one pipeline-stage boundary, n={n}, bf16, {device} x 2, "
             f"torch {torch.__version__}, median of {args.iters} round trips",
             "", "| s x b x C | case | bytes / micro-batch (fwd+bwd) | ms / round trip | GB/s "
             "| extra ms over baseline |", "|---|---|---|---|---|---|"]
    for size in args.sizes:
        s, b, c = (int(v) for v in size.split("x"))
        cases = [("baseline", [s, b, c], stage_config(c, n, mhc=False)),
                 ("mHC", [s, b, n * c], stage_config(c, n, mhc=True)),
                 ("mHC, fixed shapes", [s, b, n * c],
                  stage_config(c, n, mhc=True, force_fixed_shapes=True))]
        base_ms = None
        for name, shape, cfg in cases:
            assert cfg.variable_seq_lengths == (name == "mHC"), (name, cfg.variable_seq_lengths)
            ms = statistics.median(round_trips(P2PCommunicator(group, cfg), shape, args.iters,
                                               args.warmup))
            nbytes = 2 * 2 * s * b * shape[-1]  # bf16, forward + backward
            base_ms = ms if base_ms is None else base_ms
            extra = "-" if name == "baseline" else f"{ms - base_ms:+.3f}"
            lines.append(f"| {size} | {name} | {nbytes / 2**20:.1f} MiB | {ms:.3f} | "
                         f"{nbytes / ms / 1e6:.1f} | {extra} |")
        raw = statistics.median(raw_round_trips([s, b, n * c], args.iters, args.warmup))
        nbytes = 2 * 2 * s * b * n * c
        lines.append(f"| {size} | raw send/recv, n*C | {nbytes / 2**20:.1f} MiB | {raw:.3f} | "
                     f"{nbytes / raw / 1e6:.1f} | (floor) |")
    report_and_finish("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
