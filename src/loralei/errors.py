"""Exceptions raised by loralei for bad input.

Every error names what was wrong (the field, key or path), the value it got, and what to do instead.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LoraleiError(Exception):
    """Base class of every error loralei raises on purpose."""


class ConfigError(LoraleiError, ValueError):
    """A configuration value is invalid; the message lists every problem found, one per line."""


class InjectionError(LoraleiError, ValueError):
    """LoRA cannot be injected into (or removed from) the given model as asked."""


class CheckpointError(LoraleiError, ValueError):
    """An adapter directory is missing, incomplete, corrupt, or does not fit the model."""


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


def format_validation_errors(
    errors: list[dict], model_fields: dict[str, Iterable[str]], prefix: str = ""
) -> str:
    """Turns pydantic's error dicts into one readable line per problem.

    Args:
        errors: ``ValidationError.errors()``.
        model_fields: for each dotted location of a model (``""`` for the top), the keys it accepts; used to
            suggest the intended key when an unknown one is given.
        prefix: prepended to every location, e.g. ``"lora."``.

    Returns:
        The lines joined with newlines.
    """
    lines = []
    for err in errors:
        loc = ".".join(str(part) for part in err["loc"])
        where = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
        if err["type"] == "extra_forbidden":
            parent = ".".join(str(part) for part in err["loc"][:-1])
            hint = did_you_mean(str(err["loc"][-1]), model_fields.get(parent, ()))
            lines.append(f"{where}: unknown key{hint}; remove it or fix its spelling")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        # A check across fields (no location) names its fields itself; echoing the whole input adds noise.
        lines.append(f"{where}: {msg} (got {err.get('input')!r})" if loc else f"{where}: {msg}")
    return "\n".join(lines)
