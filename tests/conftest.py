"""Shared fixtures: one process group (gloo on CPU, nccl on GPU) with TP=PP=1.

Without CUDA the Triton kernels run in Triton's interpreter. The switch must be set before
anything imports triton (megatron-core does), because triton.language's own jit helpers
(``tl.zeros``, ...) are built in the mode that is active at import time. The interpreter's
fp32 ``tl.dot`` is made exact (:mod:`mhc_testing.triton_interpreter`): as on a GPU, an
output element's bits then do not depend on the tile it is in.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every launch by signature is checked against the per-argument key (kernels/launch.py), in
# this process and in the child processes the tests start.
os.environ.setdefault("MHC_CHECK_LAUNCH_SIGNATURES", "1")

import pytest  # noqa: E402

from mhc_testing import warning_filters  # noqa: E402
from mhc_testing.cpu import init_single_process_group, setup_cpu_megatron  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # a GPU's tl.dot: per element, any tile
    from mhc_testing.triton_interpreter import exact_fp32_dots

    exact_fp32_dots()


def pytest_configure(config):
    # The same third-party filters as the demo (scripts/demo.sh); everything else shows.
    for line in warning_filters.pytest_filter_lines():
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def megatron_single_rank():
    """Process group of one rank, Megatron model-parallel state TP=PP=1, CPU shims."""
    from megatron.core import parallel_state

    init_single_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    setup_cpu_megatron()
    yield


@pytest.fixture
def seeded(megatron_single_rank):
    """Re-seed the CPU (and CUDA) RNG before each test."""
    setup_cpu_megatron(seed=1234)
    yield


@pytest.fixture
def device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
