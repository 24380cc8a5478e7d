"""prepare_kto_dataset: the examples of ``training.objective: kto``, each a prompt and one completion labelled
desirable or not, and the batches KTO reads.

The data is in TRL's unpaired preference format (``prompt``, ``completion`` and a boolean ``label``, text or
conversations) or a preference dataset (``prompt``, ``chosen``, ``rejected``), which is unpaired as TRL does: each
pair gives its chosen completion, desirable, and its rejected one, not. Unpaired rows go through the SFT rows'
machinery as prompt-completion rows (only the completion trained; a multi-turn prompt's answers are context) and
their labels are read from the data; pairs go through the preference machinery.

A batch holds each example beside its KL sequence: the example's prompt followed by the completion of the example
before it in the micro batch (the first takes the last one's), cut to ``max_seq_length``, as TRL pairs them, so
that KTO's KL term is estimated from the batch's own completions under other prompts. The two are a pair of the
preference batch layout (``preference_collate.py``), the example as the chosen sequence and the KL sequence as the
rejected one, and the batch says which examples are desirable (:data:`DESIRABLE`).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..preference.logps import DESIRABLE
from .dataset import TokenRows, prepare_sft_dataset
from .errors import DataError, missing_column_error
from .load import load_rows
from .preference import TokenPairs, prepare_preference_dataset
from .preference_collate import PreferenceCollator
from .template import IGNORE_INDEX

Sequence = tuple[np.ndarray, np.ndarray]  # (input_ids, labels)
# data.<key> -> the default column of the unpaired format
UNPAIRED_FIELDS = {"prompt_field": "prompt", "completion_field": "completion", "label_field": "label"}


@dataclass(frozen=True)
class KTOSummary:
    """Counts from ``prepare_kto_dataset``, printed as one line."""

    rows_read: int
    examples: int
    desirable: int
    dropped: dict[str, int]
    truncated: int
    tokens: int
    trainable_tokens: int
    max_seq_length: int
    paired: bool
    from_cache: bool = False

    def __str__(self) -> str:
        what = (
            "preference pairs read (each unpaired into its two completions)" if self.paired else "rows read"
        )
        reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]))
        line = (
            f"KTO data: {self.rows_read:,} {what}, {sum(self.dropped.values()):,} dropped"
            f"{f' ({reasons})' if reasons else ''}, {self.truncated:,} truncated to {self.max_seq_length} tokens; "
            f"{self.examples:,} examples ({self.desirable:,} desirable, {self.examples - self.desirable:,} "
            f"undesirable), {self.tokens:,} tokens, {self.trainable_tokens:,} trained"
        )
        return line + ("; tokens from the cache" if self.from_cache else "")


class _RowExamples:
    """The examples of unpaired rows: the kept SFT rows."""

    def __init__(self, rows: TokenRows) -> None:
        self.rows, self.lengths = rows, rows.lengths

    def __getitem__(self, i: int) -> Sequence:
        return self.rows.sample(i)


class _PairExamples:
    """The examples of unpaired pairs: example ``2p`` is pair ``p``'s chosen sequence, ``2p + 1`` its rejected."""

    def __init__(self, pairs: TokenPairs) -> None:
        self.pairs, self.lengths = pairs, pairs.lengths.reshape(-1)

    def __getitem__(self, i: int) -> Sequence:
        pair = self.pairs[i // 2]
        return pair.rejected if i % 2 else pair.chosen


class KTODataset(torch.utils.data.Dataset):
    """KTO's examples: ``ds[i]`` is ``{"example": (i, (input_ids, labels), desirable)}``.

    Args:
        examples: the examples' sequences (``examples[i]``) and their ``lengths``.
        desirable: each example's label.
        summary: the preparation counts.
        max_seq_length: the longest sequence (a KL sequence is cut to it).
    """

    # collated rows an item makes: the example and its KL sequence
    rows_per_item = 2

    def __init__(
        self, examples: Any, desirable: np.ndarray, summary: KTOSummary, max_seq_length: int
    ) -> None:
        self.examples, self.desirable, self.summary = examples, desirable, summary
        self.max_seq_length = max_seq_length

    def __len__(self) -> int:
        return len(self.desirable)

    def __getitem__(self, index: int) -> dict[str, tuple]:
        return {"example": (index, self.examples[index], bool(self.desirable[index]))}

    def widest_row(self) -> int:
        """A bound of the longest collated row: an example, or a KL sequence of the longest prompt and the longest
        completion, within ``max_seq_length``."""
        splits = np.array([prompt_length(self.examples[i][1]) for i in range(len(self))])
        lengths = np.asarray(self.examples.lengths)
        widest_kl = int(splits.max() + (lengths - splits).max())
        return max(int(lengths.max()), min(widest_kl, self.max_seq_length))


def prompt_length(labels: np.ndarray) -> int:
    """The tokens before a sequence's completion: those before its first trained one."""
    return int(np.argmax(labels != IGNORE_INDEX))


def kl_sequence(example: Sequence, other: Sequence, max_seq_length: int) -> Sequence:
    """``example``'s prompt followed by ``other``'s completion, cut to ``max_seq_length`` tokens."""
    (ids, labels), (other_ids, other_labels) = example, other
    p, q = prompt_length(labels), prompt_length(other_labels)
    return (
        np.concatenate([ids[:p], other_ids[q:]])[:max_seq_length],
        np.concatenate([labels[:p], other_labels[q:]])[:max_seq_length],
    )


@dataclass(frozen=True)
class KTOCollator:
    """Collates :class:`KTODataset` items: each example and its KL sequence (the prompt with the completion of the
    example before it in the batch) as a pair of the preference layout, and :data:`DESIRABLE` (a class: workers
    pickle it).

    Attributes:
        base: the preference collator (unpacked).
        max_seq_length: the longest KL sequence.
    """

    base: PreferenceCollator
    max_seq_length: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        examples = [feature["example"] for feature in features]
        pairs = [
            (index, sequence, kl_sequence(sequence, examples[k - 1][1], self.max_seq_length))
            for k, (index, sequence, _) in enumerate(examples)
        ]
        batch = self.base([{"pairs": [pair]} for pair in pairs])
        batch[DESIRABLE] = torch.tensor([desirable for _, _, desirable in examples], dtype=torch.bool)
        return batch


def prepare_kto_dataset(
    tokenizer: Any,
    *,
    path: str,
    split: str = "train",
    max_seq_length: int,
    fields: dict[str, str | None],
    chat_template: str | None = None,
    truncate: bool = False,
    num_proc: int | str | None = "auto",
    seed: int = 0,
    keys: tuple[str, str] = ("data.path", "data.split"),
) -> KTODataset:
    """Loads and tokenizes KTO's examples (module docstring), through the token cache.

    Args:
        tokenizer: a fast Transformers tokenizer (with a chat template for conversations).
        path: local json/jsonl/parquet/csv file or directory, or a Hub dataset name.
        split: split with optional slicing.
        max_seq_length: the longest sequence (prompt + completion), >= 2.
        fields: ``data.prompt_field``, ``completion_field``, ``label_field``, ``chosen_field``,
            ``rejected_field`` (None: the default column).
        chat_template: Jinja template (string or file) replacing the tokenizer's.
        truncate: cut sequences longer than ``max_seq_length`` instead of dropping them.
        num_proc: the most tokenization processes; ``"auto"`` (or None): the cores this process may use.
        seed: seed passed on to the preparation.
        keys: the config keys that gave ``path`` and ``split``, named in errors.

    Raises:
        DataError: unreadable data, neither a label column nor chosen / rejected columns, a label that is not a
            boolean, or no example left.
    """
    rows = load_rows(path, split, keys=keys)
    columns = rows.column_names
    label = fields.get("label_field")
    if label is not None and label not in columns:
        raise missing_column_error("label_field", label, columns)
    common = {
        "path": path, "split": split, "max_seq_length": max_seq_length, "chat_template": chat_template,
        "truncate": truncate, "num_proc": num_proc, "seed": seed, "keys": keys,
    }  # fmt: skip
    if (label := label or UNPAIRED_FIELDS["label_field"]) in columns:
        return _unpaired(tokenizer, fields, _labels(list(rows[label]), label), common)
    if fields.get("chosen_field") is None and "chosen" not in columns:
        raise DataError(
            f"data.label_field: KTO data needs a 'label' column (true for a desirable completion, false for "
            f"one that is not) beside 'prompt' and 'completion', or preference pairs (prompt, chosen, rejected), "
            f"and this data has neither (columns: {', '.join(columns) or '(none)'}); name the label column with "
            "data.label_field"
        )
    return _paired(tokenizer, fields, common)


def _unpaired(
    tokenizer: Any, fields: dict[str, str | None], labels: np.ndarray, common: dict[str, Any]
) -> KTODataset:
    """Unpaired rows: prompt-completion SFT rows, and their labels (one per row of the data)."""
    prompt, completion = (
        fields.get(key) or UNPAIRED_FIELDS[key] for key in ("prompt_field", "completion_field")
    )
    sft = prepare_sft_dataset(
        tokenizer, packing=False, prompt_field=prompt, completion_field=completion, **common
    )
    desirable = labels[sft.rows.index]
    s = sft.summary
    summary = KTOSummary(
        s.rows_read, s.rows_kept, int(desirable.sum()), s.dropped, s.truncated, s.tokens, s.trainable_tokens,
        s.max_seq_length, paired=False, from_cache=s.from_cache,
    )  # fmt: skip
    return KTODataset(_RowExamples(sft.rows), desirable, summary, common["max_seq_length"])


def _labels(values: SequenceOf[Any], column: str) -> np.ndarray:
    """The label column as booleans.

    Raises:
        DataError: a value that is not true or false, named with its row.
    """
    for row, value in enumerate(values):
        if not isinstance(value, (bool, np.bool_)):
            raise DataError(
                f"data.label_field: row {row} of the {column!r} column holds {value!r}; KTO's labels are true (a "
                "desirable completion) or false (an undesirable one)"
            )
    return np.asarray(values, dtype=bool)


def _paired(tokenizer: Any, fields: dict[str, str | None], common: dict[str, Any]) -> KTODataset:
    """Preference pairs, each unpaired into its chosen (desirable) and rejected (undesirable) examples."""
    pair_fields = {key: fields.get(key) for key in ("prompt_field", "chosen_field", "rejected_field")}
    pairs = prepare_preference_dataset(tokenizer, packing=False, fields=pair_fields, **common)
    desirable = np.tile([True, False], len(pairs.pairs))
    s = pairs.summary
    summary = KTOSummary(
        s.rows_read, 2 * s.pairs_kept, s.pairs_kept, s.dropped, s.truncated, s.tokens, s.trainable_tokens,
        s.max_seq_length, paired=True, from_cache=s.from_cache,
    )  # fmt: skip
    return KTODataset(_PairExamples(pairs.pairs), desirable, summary, common["max_seq_length"])
