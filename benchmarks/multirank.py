"""What the multi-rank benchmarks share: rank 0 reports, every rank tears down."""

from __future__ import annotations

import torch


def report_and_finish(text: str, out: str | None) -> None:
    """Rank 0 prints ``text`` and writes it to ``out`` (if given); then every rank destroys
    Megatron's parallel state and the process group."""
    from megatron.core import parallel_state

    if torch.distributed.get_rank() == 0:
        print(text, flush=True)
        if out:
            with open(out, "w") as fh:
                fh.write(text + "\n")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
