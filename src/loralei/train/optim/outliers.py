"""A rolling z-score outlier test whose window, statistics and verdict all stay on the device.

A window is a dict of tensors (so it travels inside ``Optimizer.state_dict``): ``values`` (a ring buffer of the
last accepted observations), ``count`` (how many slots hold one) and ``next`` (the slot to write next). Nothing
here converts a tensor to a Python value, so a training step never waits for the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

# A perfectly flat history has zero spread, which would make any later rise, however small, infinitely many
# standard deviations away and (since skipped values never enter the window) skip every step after it.
# The spread is therefore never taken below this fraction of the mean.
REL_STD_FLOOR = 1e-3


def new_window(size: int, device: torch.device) -> dict[str, Tensor]:
    """An empty window of ``size`` slots on ``device``."""
    return {
        "values": torch.zeros(size, dtype=torch.float32, device=device),
        "count": torch.zeros((), dtype=torch.long, device=device),
        "next": torch.zeros((), dtype=torch.long, device=device),
    }


def is_outlier(window: dict[str, Tensor], x: Tensor, *, sigma: float, warmup: int) -> Tensor:
    """Whether ``x`` is a spike against the accepted history: a 0-dim bool tensor on the window's device.

    ``x`` is an outlier when it is not finite, or when the window holds at least ``warmup`` values and
    ``x - mean > sigma * std`` (sample standard deviation, floored at ``REL_STD_FLOOR * |mean|``). Only
    upward spikes count: a sudden drop in loss or gradient norm is not a hazard to the weights.

    Args:
        window: from ``new_window``.
        x: the new observation (0-dim, any float dtype, any device).
        sigma: how many standard deviations above the mean make a spike.
        warmup: how many accepted values the window needs before it judges spikes.

    Returns:
        The verdict, on the window's device.
    """
    values, count = window["values"], window["count"]
    x = x.detach().to(device=values.device, dtype=torch.float32)
    filled = torch.arange(values.numel(), device=values.device) < count
    mean = torch.where(filled, values, 0.0).sum() / count.clamp_min(1)
    spread = torch.where(filled, values - mean, 0.0).square().sum() / (count - 1).clamp_min(1)
    std = spread.sqrt().maximum(REL_STD_FLOOR * mean.abs())
    spike = (count >= warmup) & (x - mean > sigma * std)
    return spike | ~torch.isfinite(x)


def push(window: dict[str, Tensor], x: Tensor, accept: Tensor) -> None:
    """Writes ``x`` into the window's next slot when ``accept`` (a 0-dim bool tensor) is true; else no change."""
    values = window["values"]
    x = x.detach().to(device=values.device, dtype=torch.float32)
    slot = torch.arange(values.numel(), device=values.device) == window["next"]
    values.copy_(torch.where(slot & accept, x, values))
    advance = accept.long()
    window["next"].add_(advance).remainder_(values.numel())
    window["count"].add_(advance).clamp_(max=values.numel())
