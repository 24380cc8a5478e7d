"""Which tokens of an encoding overlap a list of character spans: the loss mask of a chat row, on arrays.

The rule is the one of Transformers' assistant mask: walking the tokens in order, a token is inside when it overlaps
the first span that ends after the token's start. Token offsets of one encoded text never go backwards, so that is
"the token overlaps some span", and the tokens overlapping a span ``[start, end)`` are one run: from the first token
ending after ``start`` to the last one starting before ``end``. Both ends are found by bisection over the tokens'
offsets (``token_to_chars``), a few dozen lookups a span instead of building the offsets of every token.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

Span = tuple[int, int]


def token_runs(encoding: Any, spans: Sequence[Span]) -> list[tuple[int, int]]:
    """The token index runs ``[first, stop)`` that overlap each span (empty runs left out).

    Args:
        encoding: a ``tokenizers.Encoding`` of one text, its offsets in characters of that text.
        spans: ``(start, end)`` character spans, sorted and disjoint.

    Returns:
        The runs, in order.
    """
    n = len(encoding)
    runs = []
    for start, end in spans:
        first = bisect.bisect_right(range(n), start, key=lambda t: encoding.token_to_chars(t)[1])
        stop = bisect.bisect_left(range(first, n), end, key=lambda t: encoding.token_to_chars(t)[0]) + first
        if first < stop:
            runs.append((first, stop))
    return runs


def span_mask(encoding: Any, spans: Sequence[Span]) -> np.ndarray:
    """A boolean per token: does it overlap one of ``spans``? (see ``token_runs``)."""
    mask = np.zeros(len(encoding), dtype=bool)
    for first, stop in token_runs(encoding, spans):
        mask[first:stop] = True
    return mask
