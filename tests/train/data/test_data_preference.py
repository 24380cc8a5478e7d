"""Preference data: TRL's formats (standard and conversational, explicit and implicit prompt) become pairs whose
labels are the completion only; too-long pairs are dropped or cut and counted; packing keeps a pair in one row;
the batch's sequence and pair ids; and the errors for data that is not preference data."""

from __future__ import annotations

import pytest
import torch

from loralei.train.data import DataError, make_collator
from loralei.train.data.preference import prepare_preference_dataset
from loralei.train.data.preference_collate import PreferenceCollator
from loralei.train.losses import IGNORE_INDEX
from loralei.train.preference.logps import PAIR_IDS, SEQUENCE_IDS

NO_FIELDS: dict[str, str | None] = {}


def conversation(word: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": f"upper: {word}"}, {"role": "assistant", "content": answer}]


def prepare(tokenizer, path: str, **kwargs):
    settings = {"max_seq_length": 64, "packing": False, "fields": NO_FIELDS, **kwargs}
    return prepare_preference_dataset(tokenizer, path=path, **settings)


def trained(tokenizer, sequence) -> str:
    ids, labels = sequence
    return tokenizer.decode(ids[labels != IGNORE_INDEX])


ROWS = {
    "conversational explicit": {
        "prompt": [{"role": "user", "content": "upper: abcde"}],
        "chosen": [{"role": "assistant", "content": "ABCDE"}],
        "rejected": [{"role": "assistant", "content": "abcde"}],
    },
    "conversational implicit": {
        "chosen": conversation("abcde", "ABCDE"),
        "rejected": conversation("abcde", "abcde"),
    },
    "standard explicit": {"prompt": "upper: abcde =", "chosen": " ABCDE", "rejected": " abcde"},
    "standard implicit": {"chosen": "upper: abcde = ABCDE", "rejected": "upper: abcde = abcde"},
}


@pytest.mark.parametrize("kind", list(ROWS))
def test_each_format_trains_the_completions_only(tokenizer, write_jsonl, kind) -> None:
    pair = prepare(tokenizer, write_jsonl([ROWS[kind]])).pairs[0]
    chosen, rejected = trained(tokenizer, pair.chosen), trained(tokenizer, pair.rejected)
    assert "upper" not in chosen + rejected  # the prompt is never trained
    assert chosen.strip().startswith("ABCDE") and rejected.strip().startswith("abcde")
    eos = tokenizer.eos_token
    assert chosen.rstrip().endswith(eos) and rejected.rstrip().endswith(eos)
    assert (
        len(pair.chosen[0]) - (pair.chosen[1] != IGNORE_INDEX).sum()
        == len(pair.rejected[0]) - (pair.rejected[1] != IGNORE_INDEX).sum()
    )  # the same prompt before each


def test_a_multi_turn_prompt_trains_only_the_last_answer(tokenizer, write_jsonl) -> None:
    row = {
        "prompt": [*conversation("first", "FIRST"), {"role": "user", "content": "upper: again"}],
        "chosen": [{"role": "assistant", "content": "AGAIN"}],
        "rejected": [{"role": "assistant", "content": "again"}],
    }
    pair = prepare(tokenizer, write_jsonl([row]), max_seq_length=128).pairs[0]
    assert "FIRST" not in trained(tokenizer, pair.chosen) and "AGAIN" in trained(tokenizer, pair.chosen)


def test_too_long_pairs_are_dropped_or_cut_and_counted(tokenizer, write_jsonl) -> None:
    long = {**ROWS["standard explicit"], "rejected": " " + "x" * 80}
    path = write_jsonl([ROWS["standard explicit"], long, {**ROWS["standard explicit"], "rejected": " ABCDE"}])
    dropped = prepare(tokenizer, path, max_seq_length=40)
    assert len(dropped.pairs) == 1
    assert dropped.summary.dropped == {"too long": 1, "chosen and rejected are identical": 1}
    cut = prepare(tokenizer, path, max_seq_length=40, truncate=True)
    assert len(cut.pairs) == 2 and cut.summary.truncated == 1
    assert len(cut.pairs[1].rejected[0]) == 40 and len(cut.pairs[1].chosen[0]) < 40  # the pair stays together


def test_packing_keeps_each_pair_in_one_row_and_the_batch_says_whose_tokens(tokenizer, write_jsonl) -> None:
    rows = [
        {"prompt": f"upper: {w} =", "chosen": f" {w.upper()}", "rejected": f" {w}"}
        for w in ("ab", "cdefg", "hij")
    ]
    ds = prepare(tokenizer, write_jsonl(rows), max_seq_length=32, packing=True)
    assert sorted(i for b in ds.bins for i in b) == [0, 1, 2]
    base = make_collator(0, max_seq_length=64, pad_to_max_length=False, packed=True, attention_mask=True)
    batch = PreferenceCollator(base)([ds[i] for i in range(len(ds))])
    order = [pair for item in (ds[i] for i in range(len(ds))) for pair, _, _ in item["pairs"]]
    assert batch[PAIR_IDS].tolist() == order
    sequences = batch[SEQUENCE_IDS]
    for k, index in enumerate(order):
        for side, (ids, _) in enumerate((ds.pairs[index].chosen, ds.pairs[index].rejected)):
            assert torch.equal(batch["input_ids"][sequences == 2 * k + side], torch.as_tensor(ids))
    assert bool((batch["input_ids"][sequences == -1] == 0).all())  # padding only


def test_unpacked_batches_put_each_sequence_in_its_own_row(tokenizer, write_jsonl) -> None:
    ds = prepare(tokenizer, write_jsonl([ROWS["standard explicit"], ROWS["conversational explicit"]]))
    base = make_collator(0, max_seq_length=64, pad_to_max_length=False, packed=False, attention_mask=True)
    batch = PreferenceCollator(base)([ds[0], ds[1]])
    assert batch["input_ids"].shape[0] == 4
    assert [int(row[row >= 0].unique()) for row in batch[SEQUENCE_IDS]] == [0, 1, 2, 3]


@pytest.mark.parametrize("packing", [False, True])
def test_padded_to_the_widest_row_every_batch_has_one_width(tokenizer, write_jsonl, packing) -> None:
    """With CUDA graphs on the runner's batches (``build_data.pad_to_width``): every batch as wide as the data's
    widest row, a pair's longer sequence (each sequence a row) or the fullest packed row."""
    from loralei.train.build_data import pad_to_width

    rows = [
        {"prompt": f"upper: {w} =", "chosen": f" {w.upper()}", "rejected": f" {w}{w}"}
        for w in ("ab", "cdefghij", "hij", "k")
    ]
    ds = prepare(tokenizer, write_jsonl(rows), max_seq_length=32, packing=packing)
    base = make_collator(0, max_seq_length=64 if packing else 32, pad_to_max_length=False, packed=packing,
                         attention_mask=True)  # fmt: skip
    items = [ds[i] for i in range(len(ds))]
    own = [PreferenceCollator(base)([item])["input_ids"].shape[1] for item in items]
    assert ds.widest_row() == max(own) and min(own) < max(own)
    assert ds.rows_per_item == (1 if packing else 2)
    collate = pad_to_width(PreferenceCollator(base), ds.widest_row())
    assert {collate([item])["input_ids"].shape[1] for item in items} == {ds.widest_row()}


def test_sft_rows_are_refused_naming_the_field(tokenizer, write_jsonl) -> None:
    with pytest.raises(DataError, match=r"data\.chosen_field: .*needs a 'chosen' column.*messages"):
        prepare(tokenizer, write_jsonl([{"messages": conversation("abcde", "ABCDE")}]))


def test_a_missing_rejected_column_is_named(tokenizer, write_jsonl) -> None:
    with pytest.raises(DataError, match=r"data\.rejected_field: .*'rejected' column"):
        prepare(tokenizer, write_jsonl([{"prompt": "a", "chosen": "b"}]))
    with pytest.raises(DataError, match=r"data\.rejected_field: column 'worse' is not in the data"):
        prepare(tokenizer, write_jsonl([ROWS["standard explicit"]]), fields={"rejected_field": "worse"})
