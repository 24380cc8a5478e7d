"""Sums on the device of what the training steps since the last read wrote, for the logged preference metrics.

Adding never waits for the device. Under CUDA graphs a step's values are added after each replay of its graph, from
copies (the graph writes the same tensors again at its next replay); the read is over all ranks.
"""

from __future__ import annotations

import torch

from .. import distributed, graphs


class StepSums:
    """Sums of tensors of one shape, and a count of what they cover (pairs, micro batches), since the last read."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.count = 0

    def add(self, sums: torch.Tensor, count: int) -> None:
        """Adds one micro batch's ``sums`` (1-D) covering ``count`` items (after each replay under graphs)."""
        graphs.after_each_run(lambda: self._accumulate(sums, count))

    def _accumulate(self, sums: torch.Tensor, count: int) -> None:
        self.sums = sums.clone() if self.sums is None else self.sums + sums
        self.count += count

    def read(self) -> tuple[list[float], float] | None:
        """The sums and the count over all ranks (every rank calls it at the same step), then starts over; None
        when nothing was added."""
        if self.sums is None:
            return None
        count = torch.tensor([float(self.count)], device=self.sums.device)
        totals = distributed.all_reduce_sum(torch.cat([self.sums, count])).tolist()
        self.sums, self.count = None, 0
        return totals[:-1], totals[-1]
