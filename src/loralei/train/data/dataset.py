"""prepare_sft_dataset: tokenize once (token cache), then keep, cut and pack rows on arrays."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .arrays import TokenArrays
from .errors import check_max_seq_length
from .formats import RowFormat, main_column
from .pack import best_fit_decreasing, fullest_bin
from .select import Selection, all_dropped_error, select_rows
from .summary import DataSummary
from .tokens import DataSource, resolve_workers, tokenize_source


class TokenRows:
    """The kept samples, read from the encoded rows: ``rows[i]`` is ``{"input_ids": list[int], "labels":
    list[int]}``, cut to ``max_seq_length`` when truncated.

    Args:
        arrays: the encoded rows (memory-mapped from the token cache).
        rows: the indices of the kept rows in ``arrays``.
        lengths: the tokens each kept row contributes.
    """

    def __init__(self, arrays: TokenArrays, rows: np.ndarray, lengths: np.ndarray) -> None:
        self.arrays, self.index, self.lengths = arrays, rows, lengths

    def __len__(self) -> int:
        return len(self.index)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``i`` as int64 arrays ``(input_ids, labels)``."""
        return self.arrays.sample(int(self.index[i]), int(self.lengths[i]))

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids, labels = self.sample(i)
        return {"input_ids": ids.tolist(), "labels": labels.tolist()}


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized training samples, optionally packed.

    ``ds[i]`` is ``{"input_ids": list[int], "labels": list[int]}``, plus ``"position_ids"`` (restarting at 0 for
    every packed sample) when packed.

    Args:
        rows: the kept samples.
        bins: for packing, the sample indices of each packed sequence; None when not packed.
        summary: the preparation counts.
    """

    def __init__(self, rows: TokenRows, bins: list[list[int]] | None, summary: DataSummary) -> None:
        self.rows = rows
        self.bins = bins
        self.summary = summary

    @property
    def packed(self) -> bool:
        """Whether items are packed sequences."""
        return self.bins is not None

    # collated rows an item makes
    rows_per_item = 1

    def widest_row(self) -> int:
        """The tokens of the longest item: the widest row a batch of this data can have."""
        if self.bins is None:
            return int(self.rows.lengths.max())
        return fullest_bin(self.bins, self.rows.lengths)

    def __len__(self) -> int:
        return len(self.bins) if self.bins is not None else len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if self.bins is None:
            return self.rows[index]
        parts = [self.rows.sample(i) for i in self.bins[index]]
        return {
            "input_ids": np.concatenate([ids for ids, _ in parts]).tolist(),
            "labels": np.concatenate([labels for _, labels in parts]).tolist(),
            "position_ids": np.concatenate([np.arange(len(ids)) for ids, _ in parts]).tolist(),
        }


def prepare_sft_dataset(
    tokenizer: Any,
    *,
    path: str,
    split: str = "train",
    max_seq_length: int,
    packing: bool,
    messages_field: str | None = None,
    text_field: str | None = None,
    instruction_field: str | None = None,
    input_field: str | None = None,
    response_field: str | None = None,
    prompt_field: str | None = None,
    completion_field: str | None = None,
    chat_template: str | None = None,
    truncate: bool = False,
    num_proc: int | str | None = "auto",
    seed: int = 0,
    keys: tuple[str, str] = ("data.path", "data.split"),
) -> SFTDataset:
    """Loads, tokenizes, filters and (optionally) packs a supervised fine-tuning dataset.

    Rows are tokenized whole once and kept in the token cache (``cache.py``); ``max_seq_length``, ``truncate`` and
    ``packing`` are applied to the cached rows, so changing them does not tokenize again.

    Args:
        tokenizer: a Transformers tokenizer (a fast one for the formats that use the chat template).
        path: local json/jsonl/parquet/csv file or directory, or a Hub dataset name.
        split: split with optional slicing, e.g. ``"train[:100]"``.
        max_seq_length: the longest sample (and packed sequence), >= 2.
        packing: pack samples best-fit-decreasing into sequences of ``max_seq_length``.
        messages_field: column of chat turns (role/content or ShareGPT from/value).
        text_field: column of plain text (every token trained).
        instruction_field: column of instructions; with ``input_field`` (optional) and ``response_field``.
        input_field: column of instruction inputs.
        response_field: column of responses.
        prompt_field: column of prompts (loss off); with ``completion_field`` (loss on).
        completion_field: column of completions.
        chat_template: Jinja template (string or file) replacing the tokenizer's.
        truncate: cut rows longer than ``max_seq_length`` instead of dropping them.
        num_proc: the most tokenization processes; ``"auto"`` (or None): the cores this process may use.
        seed: seed of the packed-sequence order.
        keys: the config keys that gave ``path`` and ``split``, named in errors (``data.eval_path``, ...).

    Returns:
        The dataset; ``.summary`` holds the counts and prints as one line.

    Raises:
        DataError: bad settings, unreadable data, a missing column or template, or no row left.
    """
    check_max_seq_length(max_seq_length)
    fields = {
        "messages_field": messages_field,
        "text_field": text_field,
        "instruction_field": instruction_field,
        "input_field": input_field,
        "response_field": response_field,
        "prompt_field": prompt_field,
        "completion_field": completion_field,
    }
    limits = _Limits(keys, path, max_seq_length, truncate)
    source = DataSource(path, split, keys, fields, chat_template)
    tokenized = tokenize_source(tokenizer, source, workers=resolve_workers(num_proc), check=limits.select)
    arrays = tokenized.arrays
    selection = limits.select(arrays, len(arrays.reasons), False, tokenized.fmt)
    summary = DataSummary(
        rows_read=len(arrays.reasons),
        rows_kept=len(selection.rows),
        dropped=selection.dropped,
        truncated=selection.truncated,
        tokens=int(selection.lengths.sum()),
        trainable_tokens=int(selection.counts.sum()),
        max_seq_length=max_seq_length,
        from_cache=tokenized.from_cache,
    )
    rows = TokenRows(arrays, selection.rows, selection.lengths)
    if not packing:
        return SFTDataset(rows, None, summary)
    bins = best_fit_decreasing(selection.lengths, max_seq_length, seed=seed)
    return SFTDataset(rows, bins, dataclasses.replace(summary, packed_sequences=len(bins)))


@dataclass(frozen=True)
class _Limits:
    """``max_seq_length`` and ``truncate`` applied to encoded rows, and the error when no row is left."""

    keys: tuple[str, str]
    path: str
    max_seq_length: int
    truncate: bool

    def select(self, arrays: TokenArrays, rows: int, sampled: bool, fmt: RowFormat) -> Selection:
        """The kept rows of ``arrays`` (all ``rows`` of the data, or an evenly spread sample of them).

        Raises:
            DataError: no row is kept.
        """
        selection = select_rows(arrays, self.max_seq_length, self.truncate)
        if not selection.rows.size:
            column = main_column(fmt)
            raise all_dropped_error(self.keys, self.path, selection, rows, sampled=sampled, column=column)
        return selection
