"""Applying ``max_seq_length`` and ``data.truncate`` to encoded preference pairs, on arrays.

A pair is encoded as two rows of the token arrays, chosen (row ``2i``) then rejected (``2i + 1``); each goes
through the SFT rows' limits (``select.row_reasons``) and the pair is kept when both are. A dropped pair counts
one reason: the first failure to encode (chosen's, then rejected's), else the first sequence over the limits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import TokenArrays
from .errors import DataError
from .select import row_reasons, tally


@dataclass(frozen=True)
class PairSelection:
    """The pairs kept for training.

    Attributes:
        pairs: indices of the kept pairs.
        lengths: ``[kept, 2]`` tokens of each kept pair's chosen and rejected sequence after truncation.
        counts: ``[kept, 2]`` their trained tokens after truncation.
        truncated: kept pairs with a sequence cut.
        dropped: reason -> number of dropped pairs.
    """

    pairs: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    truncated: int
    dropped: dict[str, int]


def _first(reasons: np.ndarray) -> np.ndarray:
    """Per pair (a row of ``[pairs, 2]`` codes), chosen's reason when it has one, else rejected's."""
    return np.where(reasons[:, 0] != 0, reasons[:, 0], reasons[:, 1])


def select_pairs(arrays: TokenArrays, max_seq_length: int, truncate: bool) -> PairSelection:
    """Keeps, cuts or drops each encoded pair (see the module docstring)."""
    fitted, counts, long = row_reasons(arrays, max_seq_length, truncate)
    encoded = _first(arrays.reasons.reshape(-1, 2))
    reasons = np.where(encoded != 0, encoded, _first(fitted.reshape(-1, 2)))
    kept = np.flatnonzero(reasons == 0)
    return PairSelection(
        pairs=kept,
        lengths=np.minimum(arrays.lengths, max_seq_length).reshape(-1, 2)[kept],
        counts=counts.reshape(-1, 2)[kept],
        truncated=int(np.count_nonzero(long.reshape(-1, 2)[kept].any(axis=1))) if truncate else 0,
        dropped=tally(reasons),
    )


def no_pair_error(
    keys: tuple[str, str], path: str, dropped: dict[str, int], rows: int, sampled: bool
) -> DataError:
    """The error for data none of whose (sampled) pairs is kept: the counts by reason and what to change.

    Args:
        keys: the settings that gave the data's path and split.
        path: the data's path or name.
        dropped: reason -> dropped pairs.
        rows: rows in the data.
        sampled: whether the pairs are an evenly spread sample of the rows rather than all of them.
    """
    reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(dropped.items(), key=lambda kv: -kv[1]))
    what = (
        f"no sampled pair of {path!r} (evenly spread over its {rows:,} rows) would be left"
        if sampled
        else f"no pair of {path!r} is left"
    )
    return DataError(
        f"{keys[0]}: {what} ({reasons}); raise training.max_seq_length, set data.truncate: true, or check the "
        "chosen/rejected columns"
    )
