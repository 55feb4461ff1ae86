"""Rank-0 logging: one-per-job messages go out on global rank 0 only (Megatron's
``log_single_rank`` convention). Modules log through ``logging.getLogger(__name__)``; how
the package's messages show by default is set up in :mod:`mhc_megatron._logging`, which
takes :func:`log_rank0` from here (the kernels import nothing outside torch, triton and
themselves).
"""

from __future__ import annotations

import logging
import os


def _rank() -> int:
    # megatron.core's safe_get_rank warns when no process group exists; a single-process
    # script (or a test) is rank 0 without a word.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_rank0(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """``logger.log(level, msg, *args)`` on global rank 0 only."""
    if _rank() == 0:
        logger.log(level, msg, *args)
