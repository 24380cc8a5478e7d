"""Best-fit-decreasing packing of samples into sequences of at most ``capacity`` tokens."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

import numpy as np

from . import progress


def best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int, seed: int = 0) -> list[list[int]]:
    """Groups sample indices into bins whose total length is at most ``capacity``.

    Samples are placed longest first (ties: lower index first), each into the open bin with the least room that
    still fits it (ties: the older bin; a new bin when none fits). The bins are then shuffled with ``seed`` so that
    reading them in order does not go from full to empty bins; within a bin, samples keep their placement order.

    Args:
        lengths: length of each sample, each in ``1..capacity``.
        capacity: the most tokens a bin holds (``max_seq_length``).
        seed: seed of the bin-order shuffle.

    Returns:
        Lists of sample indices, one per bin.

    Raises:
        ValueError: a length is not in ``1..capacity`` (the caller drops or truncates long rows first).
    """
    sizes = np.asarray(lengths, dtype=np.int64)
    bad = np.flatnonzero((sizes < 1) | (sizes > capacity))
    if bad.size:
        raise ValueError(f"sample {bad[0]} has length {sizes[bad[0]]}, outside 1..{capacity}")
    order = np.argsort(-sizes, kind="stable").tolist()  # stable: equal lengths keep index order
    sizes_list = sizes.tolist()
    bins: list[list[int]] = []
    # Open bins as (room left, bin index), sorted, so the best fit is one bisect away.
    rooms: list[tuple[int, int]] = []
    for i in progress.bar(order, desc="packing", unit=" samples"):
        size = sizes_list[i]
        at = bisect.bisect_left(rooms, (size, -1))
        if at == len(rooms):
            bins.append([i])
            room, b = capacity - size, len(bins) - 1
        else:
            room, b = rooms.pop(at)
            bins[b].append(i)
            room -= size
        if room > 0:
            bisect.insort(rooms, (room, b))
    random.Random(seed).shuffle(bins)
    return bins


def fullest_bin(bins: Sequence[Sequence[int]], lengths: np.ndarray) -> int:
    """The most tokens any of ``bins`` holds, ``lengths`` giving each sample's."""
    members = np.concatenate([np.asarray(b, dtype=np.int64) for b in bins])
    owner = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    return int(np.bincount(owner, weights=lengths[members]).max())
