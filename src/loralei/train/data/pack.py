"""Best-fit-decreasing packing of samples into sequences of at most ``capacity`` tokens."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence


def best_fit_decreasing(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """Groups sample indices into bins whose total length is at most ``capacity``.

    Samples are placed longest first, each into the open bin with the least room that still fits it (a new bin
    when none does). The bins are then shuffled with ``seed`` so that reading them in order does not go from
    full to empty bins; within a bin, samples keep their placement order.

    Args:
        lengths: length of each sample, each in ``1..capacity``.
        capacity: the most tokens a bin holds (``max_seq_length``).
        seed: seed of the bin-order shuffle.

    Returns:
        Lists of sample indices, one per bin.

    Raises:
        ValueError: a length is not in ``1..capacity`` (the caller drops or truncates long rows first).
    """
    bad = next((i for i, n in enumerate(lengths) if not 0 < n <= capacity), None)
    if bad is not None:
        raise ValueError(f"sample {bad} has length {lengths[bad]}, outside 1..{capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Open bins as (room left, bin index), sorted, so the best fit is one bisect away.
    rooms: list[tuple[int, int]] = []
    for i in order:
        at = bisect.bisect_left(rooms, (lengths[i], -1))
        if at == len(rooms):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = rooms.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(rooms, (room, b))
    random.Random(seed).shuffle(bins)
    return bins
