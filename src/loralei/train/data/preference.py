"""prepare_preference_dataset: preference rows tokenized as pairs of sequences (prompt + chosen, prompt +
rejected) whose labels are the completion's tokens only, cut or dropped at ``max_seq_length`` a sequence, and kept
together: a dataset item is one pair, or with packing a row of whole pairs (each pair's two sequences side by side)
of at most ``2 × max_seq_length`` tokens, so a pair at its longest always fits one row.

The pairs go through the SFT rows' machinery: encoded once (in worker processes for large data) into the token
cache, two rows a pair (``encode.py``'s ``preference`` format), then cut, dropped and packed on arrays
(``preference_select.py``), so other ``max_seq_length``, ``truncate`` or ``packing`` settings do not tokenize again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .arrays import TokenArrays
from .backend import TokenizerSpec
from .errors import DataError, check_max_seq_length
from .formats import RowFormat
from .pack import best_fit_decreasing, fullest_bin
from .preference_rows import PREFERENCE_FIELDS
from .preference_select import PairSelection, no_pair_error, select_pairs
from .tokens import DataSource, resolve_workers, tokenize_source

Sequence = tuple[np.ndarray, np.ndarray]  # (input_ids, labels)


@dataclass(frozen=True)
class EncodedPair:
    """A pair's two sequences, ``(input_ids, labels)`` each, labels -100 outside the completion."""

    chosen: Sequence
    rejected: Sequence

    def __len__(self) -> int:
        return len(self.chosen[0]) + len(self.rejected[0])


class TokenPairs:
    """The kept pairs, read from the encoded rows: ``pairs[i]`` is an :class:`EncodedPair`, its sequences cut to
    ``max_seq_length`` when truncated.

    Args:
        arrays: the encoded rows, chosen at ``2p`` and rejected at ``2p + 1`` for pair ``p`` (memory-mapped from
            the token cache).
        pairs: the indices of the kept pairs.
        lengths: ``[kept, 2]`` the tokens each kept sequence contributes.
    """

    def __init__(self, arrays: TokenArrays, pairs: np.ndarray, lengths: np.ndarray) -> None:
        self.arrays, self.index, self.lengths = arrays, pairs, lengths

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> EncodedPair:
        row = 2 * int(self.index[i])
        chosen, rejected = (int(n) for n in self.lengths[i])
        return EncodedPair(self.arrays.sample(row, chosen), self.arrays.sample(row + 1, rejected))


@dataclass(frozen=True)
class PreferenceSummary:
    """Counts from ``prepare_preference_dataset``, printed as one line."""

    rows_read: int
    pairs_kept: int
    dropped: dict[str, int]
    truncated: int
    tokens: int
    trainable_tokens: int
    max_seq_length: int
    packed_rows: int = 0
    from_cache: bool = False

    def __str__(self) -> str:
        reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]))
        line = (
            f"preference data: {self.rows_read:,} rows read, {self.pairs_kept:,} pairs kept, "
            f"{sum(self.dropped.values()):,} dropped{f' ({reasons})' if reasons else ''}, {self.truncated:,} "
            f"truncated to {self.max_seq_length} tokens a sequence; {self.tokens:,} tokens, "
            f"{self.trainable_tokens:,} trained"
        )
        if self.packed_rows:
            fill = self.tokens / (self.packed_rows * 2 * self.max_seq_length)
            line += f"; packed into {self.packed_rows:,} rows of <= {2 * self.max_seq_length} tokens ({fill:.1%} full)"
        return line + ("; tokens from the cache" if self.from_cache else "")


class PreferenceDataset(torch.utils.data.Dataset):
    """Encoded pairs, one per item or packed: ``ds[i]`` is ``{"pairs": [(pair index, chosen, rejected), ...]}``
    with ``chosen`` and ``rejected`` ``(input_ids, labels)`` arrays.

    Args:
        pairs: the kept pairs.
        bins: the pair indices of each item.
        summary: the preparation counts.
        packed: the items are packed rows (else a pair each, its sequences two rows of a batch).
    """

    def __init__(
        self, pairs: TokenPairs, bins: list[list[int]], summary: PreferenceSummary, packed: bool
    ) -> None:
        self.pairs, self.bins, self.summary, self.packed = pairs, bins, summary, packed

    @property
    def rows_per_item(self) -> int:
        """Collated rows an item makes: a packed row, or a pair's two sequences."""
        return 1 if self.packed else 2

    def widest_row(self) -> int:
        """The tokens of the longest collated row: a packed row's pairs, or a pair's longer sequence."""
        if self.packed:
            return fullest_bin(self.bins, self.pairs.lengths.sum(axis=1))
        return int(self.pairs.lengths.max())

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, list]:
        out = []
        for i in self.bins[index]:
            pair = self.pairs[i]
            out.append((i, pair.chosen, pair.rejected))
        return {"pairs": out}


def prepare_preference_dataset(
    tokenizer: Any,
    *,
    path: str,
    split: str = "train",
    max_seq_length: int,
    packing: bool,
    fields: dict[str, str | None],
    chat_template: str | None = None,
    truncate: bool = False,
    num_proc: int | str | None = "auto",
    seed: int = 0,
    keys: tuple[str, str] = ("data.path", "data.split"),
) -> PreferenceDataset:
    """Loads and tokenizes a preference dataset (TRL's formats, see ``preference_rows``), through the token cache.

    Args:
        tokenizer: a fast Transformers tokenizer (with a chat template for conversations).
        path: local json/jsonl/parquet/csv file or directory, or a Hub dataset name.
        split: split with optional slicing.
        max_seq_length: the longest sequence (prompt + one completion), >= 2.
        packing: pack whole pairs best-fit-decreasing into rows of ``2 × max_seq_length`` tokens.
        fields: ``data.prompt_field``, ``chosen_field``, ``rejected_field`` (None: the default column).
        chat_template: Jinja template (string or file) replacing the tokenizer's.
        truncate: cut sequences longer than ``max_seq_length`` instead of dropping their pair.
        num_proc: the most tokenization processes; ``"auto"`` (or None): the cores this process may use.
        seed: seed of the packed-row order.
        keys: the config keys that gave ``path`` and ``split``, named in errors.

    Returns:
        The dataset; ``.summary`` prints as one line.

    Raises:
        DataError: a slow tokenizer, unreadable data, no chosen or rejected column, or no pair left.
    """
    check_max_seq_length(max_seq_length)
    if TokenizerSpec.of(tokenizer) is None:
        raise DataError("model.tokenizer: preference data needs a fast tokenizer; load it with use_fast=True")
    source = DataSource(
        path, split, keys, {k: fields.get(k) for k in PREFERENCE_FIELDS}, chat_template, pairs=True
    )
    limits = _PairLimits(keys, path, max_seq_length, truncate)
    tokenized = tokenize_source(tokenizer, source, workers=resolve_workers(num_proc), check=limits.select)
    rows = len(tokenized.arrays.reasons) // 2
    selection = limits.select(tokenized.arrays, rows, False, tokenized.fmt)
    summary = PreferenceSummary(
        rows_read=rows,
        pairs_kept=len(selection.pairs),
        dropped=selection.dropped,
        truncated=selection.truncated,
        tokens=int(selection.lengths.sum()),
        trainable_tokens=int(selection.counts.sum()),
        max_seq_length=max_seq_length,
        from_cache=tokenized.from_cache,
    )
    pairs = TokenPairs(tokenized.arrays, selection.pairs, selection.lengths)
    if not packing:
        return PreferenceDataset(pairs, [[i] for i in range(len(pairs))], summary, packed=False)
    bins = best_fit_decreasing(selection.lengths.sum(axis=1), 2 * max_seq_length, seed=seed)
    return PreferenceDataset(pairs, bins, dataclasses.replace(summary, packed_rows=len(bins)), packed=True)


@dataclass(frozen=True)
class _PairLimits:
    """``max_seq_length`` and ``truncate`` applied to encoded pairs, and the error when no pair is left."""

    keys: tuple[str, str]
    path: str
    max_seq_length: int
    truncate: bool

    def select(self, arrays: TokenArrays, rows: int, sampled: bool, fmt: RowFormat) -> PairSelection:
        """The kept pairs of ``arrays`` (all ``rows`` of the data, or an evenly spread sample of them).

        Raises:
            DataError: no pair is kept.
        """
        selection = select_pairs(arrays, self.max_seq_length, self.truncate)
        if not selection.pairs.size:
            raise no_pair_error(self.keys, self.path, selection.dropped, rows, sampled)
        return selection
