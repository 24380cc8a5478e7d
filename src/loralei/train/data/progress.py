"""The setup's progress bars (the data pipeline's, a precomputed DPO reference's): shown after a second of work,
and not at all where :func:`hide` was called (the processes of a multi-process run other than the main one, which
would each draw their own)."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

_shown = True


def bar(*args: Any, **kwargs: Any) -> tqdm:
    """A tqdm bar that appears once its work has lasted a second (``delay=1``), unless bars are hidden."""
    return tqdm(*args, delay=1, disable=not _shown, **kwargs)


def hide() -> None:
    """Hides this process's data progress bars from now on."""
    global _shown
    _shown = False
