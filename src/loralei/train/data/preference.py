"""prepare_preference_dataset: preference rows tokenized as pairs of sequences (prompt + chosen, prompt +
rejected) whose labels are the completion's tokens only, cut or dropped at ``max_seq_length`` a sequence, and kept
together: a dataset item is one pair, or with packing a row of whole pairs (each pair's two sequences side by side)
of at most ``2 × max_seq_length`` tokens, so a pair at its longest always fits one row."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .backend import TokenizerSpec
from .encode import NO_TRAINABLE, TOO_LONG
from .errors import DataError, check_max_seq_length
from .load import load_rows
from .pack import best_fit_decreasing
from .preference_rows import PREFERENCE_FIELDS, resolve_preference_columns, split_pair
from .template import IGNORE_INDEX, ChatRenderer, DropRow, chat_mask, load_chat_template

Sequence = tuple[np.ndarray, np.ndarray]  # (input_ids, labels)


@dataclass(frozen=True)
class EncodedPair:
    """A pair's two sequences, ``(input_ids, labels)`` each, labels -100 outside the completion."""

    chosen: Sequence
    rejected: Sequence

    def __len__(self) -> int:
        return len(self.chosen[0]) + len(self.rejected[0])


class PairEncoder:
    """Tokenizes a (prompt, completion): text as the tokenizer's ``prompt`` then ``completion`` + eos;
    conversations through the chat template, training only the completion's assistant turns.

    Args:
        tokenizer: a fast Transformers tokenizer.
        chat_template: ``data.chat_template`` (loaded at the first conversation).

    Raises:
        DataError: a slow tokenizer.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        spec = TokenizerSpec.of(tokenizer)
        if spec is None:
            raise DataError(
                "model.tokenizer: preference data needs a fast tokenizer; load it with use_fast=True"
            )
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.backend, self.eos = spec.build(), tokenizer.eos_token_id
        self._renderer: ChatRenderer | None = None

    def encode(self, prompt: Any, completion: Any) -> Sequence:
        """``(input_ids, labels)`` of the prompt followed by the completion; the first token is never a label.

        Raises:
            DropRow: the template rejects the conversation.
        """
        ids, trained = (
            self._chat(prompt, completion) if isinstance(completion, list) else self._text(prompt, completion)
        )
        trained[0] = False
        return ids, np.where(trained, ids, IGNORE_INDEX)

    def _text(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        head = self.backend.encode(prompt, add_special_tokens=True).ids
        tail = self.backend.encode(completion, add_special_tokens=False).ids
        if self.eos is not None and (not tail or tail[-1] != self.eos):
            tail = [*tail, self.eos]
        ids = np.asarray(head + tail, dtype=np.int64)
        return ids, np.arange(len(ids)) >= len(head)

    def _chat(self, prompt: list[dict], completion: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        if self._renderer is None:
            self._renderer = ChatRenderer(load_chat_template(self.tokenizer, self.chat_template))
        chat = self._renderer.render(prompt + completion)
        answers = sum(1 for m in completion if m["role"] == "assistant" and m["content"])
        # the prompt's own assistant turns (a multi-turn prompt) are context, not trained
        chat = dataclasses.replace(chat, spans=chat.spans[len(chat.spans) - answers :] if answers else [])
        encoding = self.backend.encode(chat.text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int64), chat_mask(encoding, chat)


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
        return line


class PreferenceDataset(torch.utils.data.Dataset):
    """Encoded pairs, one per item or packed: ``ds[i]`` is ``{"pairs": [(pair index, chosen, rejected), ...]}``
    with ``chosen`` and ``rejected`` ``(input_ids, labels)`` arrays.

    Args:
        pairs: the kept pairs.
        bins: the pair indices of each item.
        summary: the preparation counts.
    """

    def __init__(self, pairs: list[EncodedPair], bins: list[list[int]], summary: PreferenceSummary) -> None:
        self.pairs, self.bins, self.summary = pairs, bins, summary

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, list]:
        return {"pairs": [(i, self.pairs[i].chosen, self.pairs[i].rejected) for i in self.bins[index]]}


def _fit(sequence: Sequence, max_seq_length: int, truncate: bool) -> Sequence:
    """``sequence`` cut to ``max_seq_length`` (``truncate``).

    Raises:
        DropRow: too long and not truncated, or no label left.
    """
    ids, labels = sequence
    if len(ids) > max_seq_length:
        if not truncate:
            raise DropRow(TOO_LONG)
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
    if not (labels != IGNORE_INDEX).any():
        raise DropRow(NO_TRAINABLE)
    return ids, labels


def _encode_rows(
    rows: Any, columns: Any, encoder: PairEncoder, limit: int, truncate: bool
) -> tuple[list, Counter]:
    """The kept pairs and the drop reasons (``"truncated"`` counts the pairs cut)."""
    pairs, counts = [], Counter()
    for row in rows:
        try:
            prompt, chosen, rejected = split_pair(row, columns)
            whole = EncodedPair(encoder.encode(prompt, chosen), encoder.encode(prompt, rejected))
            pair = EncodedPair(_fit(whole.chosen, limit, truncate), _fit(whole.rejected, limit, truncate))
        except DropRow as drop:
            counts[drop.args[0]] += 1
            continue
        counts["truncated"] += len(pair) < len(whole)
        pairs.append(pair)
    return pairs, counts


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
    seed: int = 0,
    keys: tuple[str, str] = ("data.path", "data.split"),
) -> PreferenceDataset:
    """Loads and tokenizes a preference dataset (TRL's formats, see ``preference_rows``) in this process.

    Args:
        tokenizer: a fast Transformers tokenizer (with a chat template for conversations).
        path: local json/jsonl/parquet/csv file or directory, or a Hub dataset name.
        split: split with optional slicing.
        max_seq_length: the longest sequence (prompt + one completion), >= 2.
        packing: pack whole pairs best-fit-decreasing into rows of ``2 × max_seq_length`` tokens.
        fields: ``data.prompt_field``, ``chosen_field``, ``rejected_field`` (None: the default column).
        chat_template: Jinja template (string or file) replacing the tokenizer's.
        truncate: cut sequences longer than ``max_seq_length`` instead of dropping their pair.
        seed: seed of the packed-row order.
        keys: the config keys that gave ``path`` and ``split``, named in errors.

    Returns:
        The dataset; ``.summary`` prints as one line.

    Raises:
        DataError: unreadable data, no chosen or rejected column, or no pair left.
    """
    check_max_seq_length(max_seq_length)
    rows = load_rows(path, split, keys=keys)
    columns = resolve_preference_columns(rows.column_names, {k: fields.get(k) for k in PREFERENCE_FIELDS})
    pairs, counts = _encode_rows(
        rows, columns, PairEncoder(tokenizer, chat_template), max_seq_length, truncate
    )
    truncated = counts.pop("truncated", 0)
    if not pairs:
        reasons = ", ".join(f"{n} {why}" for why, n in counts.most_common())
        raise DataError(
            f"{keys[0]}: no pair of {path!r} is left ({reasons}); raise training.max_seq_length, set "
            "data.truncate: true, or check the chosen/rejected columns"
        )
    summary = PreferenceSummary(
        rows_read=len(rows),
        pairs_kept=len(pairs),
        dropped=dict(counts),
        truncated=truncated,
        tokens=sum(len(p) for p in pairs),
        trainable_tokens=sum(
            int((s[1] != IGNORE_INDEX).sum()) for p in pairs for s in (p.chosen, p.rejected)
        ),
        max_seq_length=max_seq_length,
    )
    if not packing:
        return PreferenceDataset(pairs, [[i] for i in range(len(pairs))], summary)
    bins = best_fit_decreasing([len(p) for p in pairs], 2 * max_seq_length, seed=seed)
    return PreferenceDataset(pairs, bins, dataclasses.replace(summary, packed_rows=len(bins)))
