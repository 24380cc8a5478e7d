"""Handing the C heap's freed pages back to the operating system.

glibc keeps freed blocks below its mmap threshold (which grows to 32 MiB as large blocks are freed) in its heap,
where they still count as the process's resident memory. A setup that frees one dense layer after another (read,
packed or copied to pinned memory, dropped) would otherwise hold the whole dense model's worth of resident pages
at its end; trimming after each layer keeps it at one layer.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def trim() -> None:
    """Returns the heap's free pages to the operating system, where the C library can."""
    if (malloc_trim := _malloc_trim()) is not None:
        malloc_trim(0)
