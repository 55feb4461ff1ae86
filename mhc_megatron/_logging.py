"""Logging of mhc_megatron: Megatron's conventions, visible by default.

Modules log through ``logging.getLogger(__name__)``; one-per-job messages go out on
rank 0 only (:func:`log_rank0`, Megatron's ``log_single_rank`` convention; defined in
:mod:`mhc_megatron.kernels.log`: the kernels import nothing outside themselves).
Megatron's own training loop (``megatron.training``) configures the root logger at INFO, so
there our messages show with Megatron's. A script that configures no logging would show only
warnings and errors (Python's ``logging.lastResort``), so the package logger
``mhc_megatron`` is set to INFO and carries one stderr handler that acts only while the
root logger has no handlers: our INFO messages (e.g. which kernel backend runs) show by
default, and once you configure logging they go to your handlers alone, never twice.

Quieter: ``logging.getLogger("mhc_megatron").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys

from mhc_megatron.kernels.log import log_rank0

__all__ = ["PACKAGE_LOGGER", "install_default_handler", "log_rank0"]

PACKAGE_LOGGER = "mhc_megatron"


class _StderrWhileUnconfigured(logging.StreamHandler):
    """Writes to the current ``sys.stderr``, and only while the root logger has no handlers."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):  # StreamHandler.__init__ assigns it; we always use sys.stderr
        pass

    def filter(self, record):
        return not logging.getLogger().handlers and super().filter(record)


def install_default_handler() -> None:
    """Give the package logger level INFO and the stderr fallback handler (idempotent)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    if not any(isinstance(h, _StderrWhileUnconfigured) for h in logger.handlers):
        logger.addHandler(_StderrWhileUnconfigured())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
