"""Narrow silencers for third-party noise that says nothing to a loralei user, each around one call.

TorchAO logs "Failed to load ..._C_*.so" while it is imported, for optional compiled kernels that the installed
build does not carry (a CUDA-only or other-Python library), and registers Enum subclasses as pytree constants,
which torch logs as deprecated. Transformers' modeling code imports TorchAO whenever it is installed, so every
command that loads a model printed those lines. :func:`quiet_import_logs` raises just those two loggers to ERROR
for the length of an import and puts their levels back; :func:`ignoring_warning` ignores one warning message
for the length of a call. Nothing is filtered process-wide.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import warnings
from collections.abc import Iterator
from types import ModuleType

# The loggers that speak while TorchAO is imported: its own, and torch's pytree registry.
IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_import_logs() -> Iterator[None]:
    """Raises :data:`IMPORT_LOGGERS` to ERROR inside the block and restores their levels after it."""
    loggers = [logging.getLogger(name) for name in IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` inside :func:`quiet_import_logs`, for modules that import TorchAO.

    Args:
        name: the module's absolute name.

    Returns:
        The module.

    Raises:
        ImportError: the module (or something it imports) is not installed.
    """
    with quiet_import_logs():
        return importlib.import_module(name)


@contextlib.contextmanager
def ignoring_warning(message: str, category: type[Warning] = UserWarning) -> Iterator[None]:
    """Ignores warnings of ``category`` whose text starts with ``message`` inside the block (the previous
    filters come back after it).

    Args:
        message: the start of the warning's text (matched literally).
        category: the warning class.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield
