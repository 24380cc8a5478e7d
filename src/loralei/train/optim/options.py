"""Checks of optimizer and schedule options, raising errors that name the option, its value and the fix."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ...errors import ConfigError, did_you_mean


class OptionError(ConfigError):
    """One optimizer option is invalid.

    Attributes:
        field: the option's name as the constructor spells it (``"sigma"``, ``"lr"``); ``build_optimizer``
            turns it into the YAML path (``optimizer.kwargs.sigma``).
    """

    def __init__(self, field: str, value: object, need: str) -> None:
        self.field = field
        self.value = value
        self.need = need
        super().__init__(f"{field}: {need} (got {value!r})")


def check_number(
    field: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Returns ``value`` as a float after checking it is a real number between ``low`` and ``high``.

    Args:
        field: the option's name, for the error.
        value: what the user gave.
        low: smallest allowed value (excluded when ``low_open``).
        high: largest allowed value (excluded when ``high_open``).
        low_open: exclude ``low``.
        high_open: exclude ``high``.

    Returns:
        ``value`` as a float.

    Raises:
        OptionError: ``value`` is not a number (bools are not numbers here) or is out of range.
    """
    need = f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise OptionError(field, value, need)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        raise OptionError(field, value, need)
    return float(value)


def check_int(field: str, value: object, *, low: int) -> int:
    """Returns ``value`` after checking it is an integer ``>= low``.

    Raises:
        OptionError: ``value`` is not an int (bools are not ints here) or is below ``low``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OptionError(field, value, f"must be an integer >= {low}")
    return value


def check_bool(field: str, value: object) -> bool:
    """Returns ``value`` after checking it is a bool.

    Raises:
        OptionError: ``value`` is not ``True`` or ``False``.
    """
    if not isinstance(value, bool):
        raise OptionError(field, value, "must be true or false")
    return value


def check_choice(field: str, value: object, choices: Iterable[str]) -> str:
    """Returns ``value`` after checking it is one of ``choices``.

    Raises:
        OptionError: ``value`` is not one of ``choices``; the message suggests the closest one.
    """
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        hint = did_you_mean(str(value), choices)
        raise OptionError(field, value, f"must be one of {', '.join(choices)}{hint}")
    return value


def check_betas(betas: object) -> tuple[float, float]:
    """Returns ``betas`` as a pair of floats, each in ``[0, 1)``.

    Raises:
        OptionError: ``betas`` is not a pair of numbers in ``[0, 1)``.
    """
    need = "must be two numbers in [0, 1), e.g. [0.9, 0.999]"
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise OptionError("betas", betas, need)
    for beta in betas:
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta < 1.0:
            raise OptionError("betas", betas, need)
    return float(betas[0]), float(betas[1])


def check_adam_hyper(lr: object, betas: object, eps: object, weight_decay: object) -> dict[str, object]:
    """Checks the options every Adam-style optimizer here shares; returns them as parameter-group defaults.

    Raises:
        OptionError: the first invalid option.
    """
    return {
        "lr": check_number("lr", lr, low=0.0),
        "betas": check_betas(betas),
        "eps": check_number("eps", eps, low=0.0),
        "weight_decay": check_number("weight_decay", weight_decay, low=0.0),
    }
