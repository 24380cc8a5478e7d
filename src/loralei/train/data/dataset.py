"""prepare_sft_dataset: load, detect the format, tokenize once (cached ``datasets.map``), filter, pack."""

from __future__ import annotations

import dataclasses
from collections import Counter

import datasets
import torch

from .encode import RowEncoder
from .errors import DataError, check_max_seq_length
from .formats import RowFormat, resolve_format
from .load import load_rows
from .pack import best_fit_decreasing
from .summary import DataSummary
from .template import IGNORE_INDEX, ChatEncoder

_IDS = datasets.List(datasets.Value("int32"))
ENCODED_FEATURES = datasets.Features(
    {
        "input_ids": _IDS,
        "labels": _IDS,
        "dropped": datasets.Value("string"),
        "truncated": datasets.Value("bool"),
    }
)


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized training samples, optionally packed.

    ``ds[i]`` is ``{"input_ids": list[int], "labels": list[int]}``, plus ``"position_ids"`` (restarting at 0 for
    every packed sample) when packed.

    Args:
        rows: the kept tokenized rows (``input_ids``, ``labels``).
        bins: for packing, the row indices of each packed sequence; None when not packed.
        summary: the preparation counts.
    """

    def __init__(self, rows: datasets.Dataset, bins: list[list[int]] | None, summary: DataSummary) -> None:
        self.rows = rows
        self.bins = bins
        self.summary = summary

    @property
    def packed(self) -> bool:
        """Whether items are packed sequences."""
        return self.bins is not None

    def __len__(self) -> int:
        return len(self.bins) if self.bins is not None else len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if self.bins is None:
            return self.rows[index]
        parts = self.rows[self.bins[index]]
        return {
            "input_ids": [t for ids in parts["input_ids"] for t in ids],
            "labels": [t for labels in parts["labels"] for t in labels],
            "position_ids": [p for ids in parts["input_ids"] for p in range(len(ids))],
        }


def _needs_chat(fmt: RowFormat, raw: datasets.Dataset) -> bool:
    if fmt.kind in ("messages", "instruction"):
        return True
    if fmt.kind != "prompt_completion":
        return False
    first = next((p for p in raw[fmt.columns["prompt"]] if p is not None), None)
    return isinstance(first, list)


def _all_dropped_error(path_key: str, path: str, rows: int, reasons: Counter) -> DataError:
    why = ", ".join(f"{n:,} {reason}" for reason, n in reasons.most_common())
    return DataError(
        f"{path_key}: all {rows:,} rows of {path!r} were dropped ({why}); check the data fields, the chat "
        "template and training.max_seq_length (or set data.truncate: true)"
    )


def prepare_sft_dataset(
    tokenizer,
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
    num_proc: int | None = None,
    seed: int = 0,
    keys: tuple[str, str] = ("data.path", "data.split"),
) -> SFTDataset:
    """Loads, tokenizes, filters and (optionally) packs a supervised fine-tuning dataset.

    Args:
        tokenizer: a fast Transformers tokenizer.
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
        num_proc: processes for tokenization.
        seed: seed of the packed-sequence order.
        keys: the config keys that gave ``path`` and ``split``, named in errors (``data.eval_path``, ...).

    Returns:
        The dataset; ``.summary`` holds the counts and prints as one line.

    Raises:
        DataError: bad settings, unreadable data, a missing column or template, or no row left.
    """
    check_max_seq_length(max_seq_length)
    raw = load_rows(path, split, keys=keys)
    fields = {
        "messages_field": messages_field,
        "text_field": text_field,
        "instruction_field": instruction_field,
        "input_field": input_field,
        "response_field": response_field,
        "prompt_field": prompt_field,
        "completion_field": completion_field,
    }
    fmt = resolve_format(raw.column_names, fields)
    chat = ChatEncoder(tokenizer, chat_template) if len(raw) and _needs_chat(fmt, raw) else None
    encoder = RowEncoder(fmt, tokenizer, chat, max_seq_length, truncate)
    encoded = raw.map(
        encoder,
        remove_columns=raw.column_names,
        features=ENCODED_FEATURES,
        num_proc=num_proc,
        desc="tokenizing",
    )
    dropped = encoded["dropped"]
    reasons = Counter(reason for reason in dropped if reason)
    kept_rows = [i for i, reason in enumerate(dropped) if not reason]
    if not kept_rows:
        raise _all_dropped_error(keys[0], path, len(raw), reasons)
    kept = encoded.select(kept_rows)
    lengths = [len(ids) for ids in kept["input_ids"]]
    summary = DataSummary(
        rows_read=len(raw),
        rows_kept=len(kept_rows),
        dropped=dict(reasons),
        truncated=sum(kept["truncated"]),
        tokens=sum(lengths),
        trainable_tokens=sum(sum(t != IGNORE_INDEX for t in labels) for labels in kept["labels"]),
        max_seq_length=max_seq_length,
    )
    kept = kept.select_columns(["input_ids", "labels"])
    if not packing:
        return SFTDataset(kept, None, summary)
    bins = best_fit_decreasing(lengths, max_seq_length, seed=seed)
    summary = dataclasses.replace(summary, packed_sequences=len(bins))
    return SFTDataset(kept, bins, summary)
