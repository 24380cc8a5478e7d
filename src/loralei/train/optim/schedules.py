"""Learning-rate schedules: linear warm-up, then cosine or linear decay to a floor, or a constant rate."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...errors import ConfigError
from .options import OptionError, check_choice, check_int, check_number

# Decay shapes: progress through the decay phase (0 → 1) to the fraction of the way from the floor to the peak.
_DECAYS: dict[str, Callable[[float], float]] = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
    "constant": lambda progress: 1.0,
}
SCHEDULES: tuple[str, ...] = tuple(_DECAYS)


class WarmupDecay:
    """The LR multiplier at scheduler step ``t`` (the number of optimizer steps taken before this one).

    Warm-up: ``(t + 1) / (warmup_steps + 1)`` for ``t < warmup_steps``, so the first step already trains and
    the peak is reached at ``t = warmup_steps``. Then ``floor + (1 - floor) * decay(progress)`` with
    ``progress = (t - warmup_steps) / (total_steps - warmup_steps)`` clipped to [0, 1] and ``floor`` the
    ``min_lr_ratio`` (``constant`` stays at 1). A plain object rather than a closure so that
    ``LambdaLR.state_dict`` saves its settings with the scheduler.
    """

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        decayed = _DECAYS[self.schedule](min(1.0, progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decayed


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LRScheduler:
    """A scheduler that multiplies each group's initial LR by ``WarmupDecay``; call its ``step()`` per step.

    Args:
        optimizer: the optimizer whose groups' ``lr`` it sets.
        schedule: ``"cosine"``, ``"linear"`` or ``"constant"`` (after the warm-up).
        warmup_steps: optimizer steps of linear warm-up, 0 for none.
        total_steps: optimizer steps of the whole run.
        min_lr_ratio: the LR that the decay ends at, as a fraction of the peak, in [0, 1].

    Returns:
        A ``LambdaLR`` whose ``state_dict`` includes the schedule's settings.

    Raises:
        ConfigError: naming the ``optimizer.*`` setting (or ``total_steps``) that is invalid.
    """
    try:
        check_choice("optimizer.schedule", schedule, SCHEDULES)
        check_int("total_steps", total_steps, low=1)
        check_int("optimizer.warmup_steps", warmup_steps, low=0)
        check_number("optimizer.min_lr_ratio", min_lr_ratio, low=0.0, high=1.0)
    except OptionError as err:
        raise ConfigError(str(err)) from None
    if warmup_steps > total_steps:
        raise ConfigError(
            f"optimizer.warmup_steps: must not exceed the run's {total_steps} total steps (got {warmup_steps}); "
            "shorten the warm-up or train longer"
        )
    multiplier = WarmupDecay(schedule, warmup_steps, total_steps, float(min_lr_ratio))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
