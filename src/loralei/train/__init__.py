"""The YAML fine-tuning runner: schema, data, loop, optimizers, checkpoints, logging.

This package loads only the config side (schema and loading, no torch), so that ``loralei-finetune --help`` and
config errors answer at once. :func:`train`, :func:`validate` and :func:`exit_failed` import the runner
(torch, Transformers, datasets) when they are called.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .loading import load_config
from .schema import RunConfig

if TYPE_CHECKING:
    from .result import RunResult

__all__ = ["RunConfig", "exit_failed", "load_config", "train", "validate"]


def train(cfg: RunConfig) -> RunResult | None:
    """Runs the fine-tuning job ``cfg`` describes (:func:`loralei.train.run.train`).

    Args:
        cfg: the validated config.

    Returns:
        The run's result on the main process, ``None`` on the others.
    """
    from . import run

    return run.train(cfg)


def validate(cfg: RunConfig) -> str:
    """Checks ``cfg`` end to end without training (:func:`loralei.train.run.validate`).

    Args:
        cfg: the validated config.

    Returns:
        A readable summary of what training would do.
    """
    from . import run

    return run.validate(cfg)


def exit_failed(status: int) -> None:
    """Ends a failed rank of a multi-process run at once (:func:`loralei.train.launch.exit_failed`).

    A process that never loaded torch has no process group, so there is nothing to end and nothing is imported.

    Args:
        status: the exit status.
    """
    if "torch" in sys.modules:
        from .launch import exit_failed as end_rank

        end_rank(status)
