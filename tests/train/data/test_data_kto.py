"""prepare_kto_dataset: TRL's unpaired rows (text and conversations) with their labels, preference pairs unpaired,
labels kept with their rows when rows are dropped, bad labels and columns named, and the widest batch row."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import trained_text

from loralei.train.build_data import pad_to_width
from loralei.train.data import DataError, make_collator
from loralei.train.data.kto import KTOCollator, prepare_kto_dataset
from loralei.train.data.preference_collate import PreferenceCollator

NO_FIELDS: dict[str, str | None] = {}


def prepare(tokenizer, path: str, **kwargs):
    settings = {"max_seq_length": 64, "fields": NO_FIELDS, **kwargs}
    return prepare_kto_dataset(tokenizer, path=path, **settings)


def conversation(word: str, answer: str, label: bool) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"upper: {word}"}],
        "completion": [{"role": "assistant", "content": answer}],
        "label": label,
    }


def example_text(tokenizer, ds, i: int) -> str:
    _, sequence, _ = ds[i]["example"]
    return trained_text(tokenizer, {"input_ids": sequence[0].tolist(), "labels": sequence[1].tolist()})


def test_unpaired_rows_keep_their_labels_and_train_the_completion(tokenizer, write_jsonl) -> None:
    """A row too long for max_seq_length is dropped, and the labels after it stay with their rows."""
    rows = [
        conversation("abc", "ABC", True),
        conversation("d" * 80, "D" * 80, True),
        conversation("efg", "efg", False),
        {"prompt": "upper: hij =", "completion": " HIJ", "label": True},
    ]
    ds = prepare(tokenizer, write_jsonl(rows))
    assert len(ds) == 3 and ds.desirable.tolist() == [True, False, True]
    assert [example_text(tokenizer, ds, i) for i in range(3)] == [
        "ABC<|im_end|>",
        "efg<|im_end|>",
        " HIJ<|im_end|>",
    ]
    s = ds.summary
    assert (s.rows_read, s.examples, s.desirable, s.dropped) == (4, 3, 2, {"too long": 1})
    assert str(s).startswith(
        "KTO data: 4 rows read, 1 dropped (1 too long), 0 truncated to 64 tokens; 3 examples (2 "
    )


def test_preference_pairs_are_unpaired_into_a_desirable_and_an_undesirable_example(
    tokenizer, write_jsonl
) -> None:
    rows = [
        {"prompt": f"upper: {w} =", "chosen": f" {w.upper()}", "rejected": f" {w}"} for w in ("ab", "cde")
    ]
    ds = prepare(tokenizer, write_jsonl(rows))
    assert ds.desirable.tolist() == [True, False, True, False]
    assert [example_text(tokenizer, ds, i) for i in range(4)] == [
        " AB<|im_end|>",
        " ab<|im_end|>",
        " CDE<|im_end|>",
        " cde<|im_end|>",
    ]
    assert "2 preference pairs read (each unpaired into its two completions)" in str(ds.summary)


def test_a_label_column_is_found_by_its_field(tokenizer, write_jsonl) -> None:
    rows = [{"q": "upper: ab =", "a": " AB", "good": True}, {"q": "upper: cd =", "a": " cd", "good": False}]
    fields = {"prompt_field": "q", "completion_field": "a", "label_field": "good"}
    ds = prepare(tokenizer, write_jsonl(rows), fields=fields)
    assert ds.desirable.tolist() == [True, False]


@pytest.mark.parametrize(
    ("rows", "fields", "message"),
    [
        (
            [
                {"prompt": "a", "completion": "b", "label": True},
                {"prompt": "c", "completion": "d", "label": "yes"},
            ],
            NO_FIELDS,
            r"^data\.label_field: row 1 of the 'label' column holds 'yes'; KTO's labels are true .* or false",
        ),
        (
            [{"prompt": "a", "completion": "b", "label": True}],
            {"label_field": "good"},
            r"^data\.label_field: .*'good'",
        ),
        (
            [{"prompt": "a", "completion": "b"}],
            NO_FIELDS,
            r"^data\.label_field: KTO data needs a 'label' column .*\(columns: prompt, completion\)",
        ),
    ],
    ids=["not-a-boolean", "missing-label-field", "no-label-no-pairs"],
)
def test_bad_labels_and_columns_are_named(tokenizer, write_jsonl, rows, fields, message) -> None:
    with pytest.raises(DataError, match=message):
        prepare(tokenizer, write_jsonl(rows), fields=fields)


def test_the_widest_row_bounds_every_batch_and_pads_them_to_one_width(tokenizer, write_jsonl) -> None:
    """A KL sequence (a long prompt with a long completion) can be wider than every example."""
    rows = [
        {"prompt": "upper: abcdefghijkl =", "completion": " A", "label": True},
        {"prompt": "upper: a =", "completion": " ABCDEFGHIJKLMNOPQRS", "label": False},
        {"prompt": "upper: bc =", "completion": " BC", "label": True},
    ]
    ds = prepare(tokenizer, write_jsonl(rows))
    base = make_collator(0, max_seq_length=64, pad_to_max_length=False, packed=False, attention_mask=True)
    collate = KTOCollator(PreferenceCollator(base), 64)
    batch = collate([ds[i] for i in range(3)])
    examples = max(len(ds[i]["example"][1][0]) for i in range(3))
    assert batch["input_ids"].shape[1] > examples and ds.widest_row() >= batch["input_ids"].shape[1]
    padded = pad_to_width(collate, ds.widest_row())
    assert {padded([ds[i], ds[j]])["input_ids"].shape[1] for i in range(3) for j in range(3)} == {
        ds.widest_row()
    }
    assert np.all(ds.desirable == [True, False, True])
