"""The third-party warnings that the test-suite and the CPU demo hide: one list for both.

On a machine without CUDA, Transformer Engine or Apex, Megatron-Core warns at import and at
model build that those optional packages are missing, about one of its own config defaults
and (as DeprecationWarnings) about its own internals. Those lines say nothing about mHC and
repeat on every run, so
``scripts/test.sh`` (through ``tests/conftest.py``) and ``scripts/demo.sh`` (through
``examples/train_gpt_mhc.py``) filter exactly these, by message and by Megatron's module.
Every other warning, mhc_megatron's own included, stays visible in both.
"""

from __future__ import annotations

import warnings

# (message regex, category, module regex): matched as warnings.filterwarnings does.
KNOWN_NOISE = (
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\."),
    (r"Apex is not installed", UserWarning, r"megatron\."),
    (r"absl\.logging is not installed", UserWarning, r"megatron\."),
    (r"full scope is deprecated", UserWarning, r"megatron\."),
    # Megatron's notices about its own internals (Python hides DeprecationWarnings of library
    # modules by default; pytest would show them), and torch's about the checkpoint format
    # Megatron's distributed checkpoints use.
    (r"", DeprecationWarning, r"megatron\."),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"torch\.distributed\.checkpoint"),
)


def install() -> None:
    """Ignore :data:`KNOWN_NOISE` in this process (call before importing megatron)."""
    for message, category, module in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def pytest_filter_lines() -> list[str]:
    """:data:`KNOWN_NOISE` as pytest ``filterwarnings`` lines (regexes, like the ini option)."""
    return [f"ignore:{message}:{category.__name__}:{module}"
            for message, category, module in KNOWN_NOISE]
