"""Applying ``max_seq_length`` and ``data.truncate`` to encoded rows, on arrays: which rows are kept, how long each
is, and why the others are dropped.

The order is the one a row has always gone through: a row that failed to encode keeps its reason; a row longer
than ``max_seq_length`` is dropped as too long, or with ``truncate`` cut to it; a row with no trained token left
(in its first ``max_seq_length`` tokens) is dropped as having none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import TokenArrays
from .errors import DataError
from .messages import NO_TRAINABLE, REASONS, TOO_LONG


@dataclass(frozen=True)
class Selection:
    """The rows kept for training.

    Attributes:
        rows: indices of the kept rows.
        lengths: tokens of each kept row after truncation.
        counts: trained tokens of each kept row after truncation.
        truncated: kept rows that were cut.
        dropped: reason -> number of dropped rows.
        shortest_too_long: tokens of the shortest row dropped as too long (0 if none).
    """

    rows: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    truncated: int
    dropped: dict[str, int]
    shortest_too_long: int


def row_reasons(arrays: TokenArrays, max_seq_length: int, truncate: bool) -> tuple[np.ndarray, ...]:
    """Each encoded row's fate (see the module docstring).

    Returns:
        ``(reasons, counts, long)``: per row, its reason code after the limits (0: kept, else 1 + the position in
        ``REASONS``), its trained tokens after truncation, and whether it encoded to more than ``max_seq_length``.
    """
    reasons = arrays.reasons.copy()
    lengths, counts = arrays.lengths, arrays.counts.copy()
    long = (reasons == 0) & (lengths > max_seq_length)
    if truncate:
        counts[long] = _trained_in_prefix(arrays, np.flatnonzero(long), max_seq_length)
    else:
        reasons[long] = REASONS.index(TOO_LONG) + 1
    reasons[(reasons == 0) & (counts == 0)] = REASONS.index(NO_TRAINABLE) + 1
    return reasons, counts, long


def tally(reasons: np.ndarray) -> dict[str, int]:
    """Reason -> how many of ``reasons`` (codes, 0 for kept) name it."""
    counts = np.bincount(reasons, minlength=len(REASONS) + 1)
    return {REASONS[code - 1]: int(n) for code, n in enumerate(counts) if code and n}


def select_rows(arrays: TokenArrays, max_seq_length: int, truncate: bool) -> Selection:
    """Keeps, cuts or drops each encoded row (see the module docstring)."""
    reasons, counts, long = row_reasons(arrays, max_seq_length, truncate)
    lengths = arrays.lengths
    kept = np.flatnonzero(reasons == 0)
    return Selection(
        rows=kept,
        lengths=np.minimum(lengths[kept], max_seq_length),
        counts=counts[kept],
        truncated=int(np.count_nonzero(long[kept])) if truncate else 0,
        dropped=tally(reasons),
        shortest_too_long=int(lengths[long].min()) if long.any() and not truncate else 0,
    )


def _trained_in_prefix(arrays: TokenArrays, rows: np.ndarray, length: int) -> np.ndarray:
    """Trained tokens among the first ``length`` tokens of each of ``rows`` (all longer than ``length``)."""
    if not rows.size:
        return np.zeros(0, dtype=np.int64)
    starts = arrays.offsets[rows]
    # reduceat sums [starts[0], starts[0] + length), [starts[0] + length, starts[1]), ...: keep every other sum.
    bounds = np.stack([starts, starts + length], axis=1).ravel()
    return np.add.reduceat(arrays.trained, bounds, dtype=np.int64)[::2]


# What to change when every row is dropped for a reason ({field}: the setting naming the column, {column}: its name).
_FIXES = {
    "empty": "column {column!r} is empty in every such row: check {field}",
    "malformed": "column {column!r} does not hold rows of the expected shape: check {field}",
    "no trainable token": "no such row has a trained token (an assistant reply, a completion or a label)",
    "token id outside the vocabulary": "the input_ids do not belong to this tokenizer: check model.tokenizer",
    "rejected by template": "the chat template rejects the conversations: check data.chat_template",
    "assistant content not found in template output": "the chat template does not write the assistant "
    "messages: check data.chat_template",
}


def all_dropped_error(
    keys: tuple[str, str],
    path: str,
    selection: Selection,
    rows: int,
    *,
    sampled: bool,
    column: tuple[str, str],
) -> DataError:
    """The error for data whose every (sampled) row is dropped: the counts by reason and what to change.

    Args:
        keys: the settings that gave the data's path and split (``data.path``, ``data.split``).
        path: the data's path or name.
        selection: the selection that kept nothing.
        rows: rows in the data.
        sampled: whether ``selection`` covers an evenly spread sample of the rows rather than all of them.
        column: the setting that names the format's main column and the column, for the fixes' wording.

    Returns:
        A DataError naming the key, the value, the counts by reason and the fix.
    """
    counted = sum(selection.dropped.values())
    why = ", ".join(
        f"{n:,} {reason}" for reason, n in sorted(selection.dropped.items(), key=lambda kv: -kv[1])
    )
    head = (
        f"{keys[0]}: all {counted:,} sampled rows of {path!r} (evenly spread over its {rows:,}) would be dropped "
        f"({why})"
        if sampled
        else f"{keys[0]}: all {counted:,} rows of {path!r} were dropped ({why})"
    )
    main_reason = max(selection.dropped, key=lambda reason: selection.dropped[reason])
    if main_reason == TOO_LONG:
        fix = (
            f"the shortest{' sampled' if sampled else ''} row has {selection.shortest_too_long:,} tokens: raise "
            f"training.max_seq_length to at least {selection.shortest_too_long} or set data.truncate: true"
        )
    else:
        field, name = column
        fix = _FIXES.get(main_reason, "check the data fields and the chat template").format(
            field=field, column=name
        )
    return DataError(f"{head}; {fix}")
