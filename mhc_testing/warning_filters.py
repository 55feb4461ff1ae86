"""The third-party warnings and log lines that the test-suite, the demo and the examples on
CPU hide: one list for all of them.

On a machine without CUDA, Transformer Engine or Apex, Megatron-Core warns at import and at
model build that those optional packages are missing (and, without TE, that TE "0.0.0" is too
old for MoE experts), about one of its own config defaults, about an experimental class it
imports, and (as DeprecationWarnings / FutureWarnings) about its own internals and the torch
APIs it calls; torch says that there is no CUDA runtime. Those lines say nothing about mHC and
repeat on every run, so ``scripts/test.sh`` (through ``tests/conftest.py``),
``scripts/demo.sh`` (through ``examples/train_gpt_mhc.py``), ``examples/mhc_study.py`` and
the CPU runs of ``examples/pretrain_gpt_mhc.py`` filter exactly these, by message and by
module. Megatron's notice that ``GPTModel`` is deprecated is logged each time a model is
built; it is shown once per process. Every other warning and log line, mhc_megatron's own
included, stays visible.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

# (message regex, category, module regex): matched as warnings.filterwarnings does.
KNOWN_NOISE = (
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\."),
    (r"Apex is not installed", UserWarning, r"megatron\."),
    (r"absl\.logging is not installed", UserWarning, r"megatron\."),
    (r"full scope is deprecated", UserWarning, r"megatron\."),
    (r"MimoModelConfig is experimental", UserWarning, r"megatron\."),
    # Megatron's notices about its own internals (Python hides DeprecationWarnings of library
    # modules by default; pytest would show them); Python's about Megatron's parser passing
    # type= to argparse.BooleanOptionalAction; torch's about the checkpoint format Megatron's
    # distributed checkpoints use and the collective its training loop calls.
    (r"", DeprecationWarning, r"megatron\."),
    (r"'type' is deprecated as of Python 3\.12", DeprecationWarning, r"argparse"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"torch\.distributed\.checkpoint"),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning,
     r"torch\.distributed"),
    # TE (where installed) on a host that also has Jax but not TE's Jax extension.
    (r"Detected a Jax installation but could not find the shared object file", RuntimeWarning,
     r"transformer_engine"),
    # Megatron's data loaders ask for pinned memory, which a machine without a GPU lacks.
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning,
     r"torch\.utils\.data"),
) + (() if HAVE_TE else (
    # Without TE, Megatron reports TE's version as 0.0.0 and calls it too old for MoE.
    (r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version is 0\.0\.0",
     UserWarning, r"megatron\."),
))

# (logger, message regex): records dropped.
KNOWN_LOG_NOISE = (
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
)
# (logger, message regex): records shown the first time only (per process).
ONCE_LOG_MESSAGES = (
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
)


class _LogFilter(logging.Filter):
    """Drops the records whose message matches ``pattern``; with ``once``, all but the
    first of each distinct message."""

    def __init__(self, pattern: str, once: bool):
        super().__init__()
        self.pattern, self.once = re.compile(pattern), once
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not self.pattern.search(message):
            return True
        if not self.once or message in self.seen:
            return False
        self.seen.add(message)
        return True


def install() -> None:
    """Ignore :data:`KNOWN_NOISE` and :data:`KNOWN_LOG_NOISE`, and show
    :data:`ONCE_LOG_MESSAGES` once, in this process (call before importing megatron;
    idempotent)."""
    for message, category, module in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    rules = [(name, pattern, False) for name, pattern in KNOWN_LOG_NOISE]
    rules += [(name, pattern, True) for name, pattern in ONCE_LOG_MESSAGES]
    for name, pattern, once in rules:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _LogFilter) and f.pattern.pattern == pattern
                   for f in logger.filters):
            logger.addFilter(_LogFilter(pattern, once))


def pytest_filter_lines() -> list[str]:
    """:data:`KNOWN_NOISE` as pytest ``filterwarnings`` lines (regexes, like the ini option)."""
    return [f"ignore:{message}:{category.__name__}:{module}"
            for message, category, module in KNOWN_NOISE]
