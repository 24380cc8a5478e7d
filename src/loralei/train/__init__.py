"""The YAML fine-tuning runner: schema, data, loop, optimizers, checkpoints, logging.

This package loads only the config side (schema and loading, no torch), so that ``loralei-finetune --help`` and
config errors answer at once; the runner (``loralei.train.run``: torch, Transformers, datasets) is imported where
it is used, and :func:`exit_failed` imports torch's side only when torch is loaded.
"""

from __future__ import annotations

import sys

from .loading import load_config
from .schema import RunConfig

__all__ = ["RunConfig", "exit_failed", "load_config"]


def exit_failed(status: int) -> None:
    """Ends a failed rank of a multi-process run at once (:func:`loralei.train.launch.exit_failed`).

    A process that never loaded torch has no process group, so there is nothing to end and nothing is imported.

    Args:
        status: the exit status.
    """
    if "torch" in sys.modules:
        from .launch import exit_failed as end_rank

        end_rank(status)
