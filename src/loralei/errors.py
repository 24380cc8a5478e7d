"""Exceptions raised by loralei for bad input.

Every error names what was wrong (the field, key or path), the value it got, and what to do instead.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any


class LoraleiError(Exception):
    """Base class of every error loralei raises on purpose."""


class ConfigError(LoraleiError, ValueError):
    """A configuration value is invalid; the message lists every problem found, one per line.

    Attributes:
        validation_errors: pydantic's error dicts behind the message, when it came from a model's validation
            (so that a caller validating the model as part of a larger config can word them in its terms).
    """

    def __init__(self, message: str, validation_errors: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.validation_errors = list(validation_errors)


class InjectionError(LoraleiError, ValueError):
    """LoRA cannot be injected into (or removed from) the given model as asked."""


class CheckpointError(LoraleiError, ValueError):
    """An adapter directory is missing, incomplete, corrupt, or does not fit the model."""


class TrainingError(LoraleiError, RuntimeError):
    """Training cannot go on (e.g. the loss stayed non-finite for too many steps)."""


def together(problems: list[LoraleiError]) -> LoraleiError:
    """One error for the problems of independent checks: the problem itself when alone, else a ConfigError with
    every line of every problem."""
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  {line}" for problem in problems for line in str(problem).splitlines())
    return ConfigError(f"{len(problems)} problems:\n{lines}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Returns ' (did you mean "x"?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""
