"""Every data problem is one line naming the setting, the value and the fix; data that every row would be dropped
from is found from a sample, before everything is tokenized."""

from __future__ import annotations

import pytest
from data_helpers import chat

from loralei.train.data import DataError, prepare_sft_dataset
from loralei.train.data.encode import BatchEncoder


def _prepare(tokenizer, path: str, **kw):
    return prepare_sft_dataset(tokenizer, path=path, **{"max_seq_length": 64, "packing": False, **kw})


def test_an_empty_file(tokenizer, tmp_path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("")
    with pytest.raises(
        DataError, match=r"^data\.path: '.*train\.jsonl' is empty \(0 bytes\); give a file with"
    ):
        _prepare(tokenizer, str(path))


@pytest.mark.parametrize(
    ("name", "text"), [("blank.jsonl", "\n\n"), ("list.json", "[]\n"), ("header.csv", "a,b\n")]
)
def test_a_file_without_rows(tokenizer, tmp_path, name, text) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(
        DataError, match=rf"^data\.path: '.*{name}' has no rows; give data with at least one row$"
    ):
        _prepare(tokenizer, str(path))


def test_a_slice_without_rows_names_the_split(tokenizer, write_jsonl) -> None:
    with pytest.raises(
        DataError, match=r"^data\.split: 'train\[2:2\]' selects no rows of '.*'; widen the slice$"
    ):
        _prepare(tokenizer, write_jsonl([chat("a", "b")] * 3), split="train[2:2]")


def test_a_column_empty_in_every_row(tokenizer, write_jsonl) -> None:
    path = write_jsonl([{"messages": None, "id": k} for k in range(3)])
    with pytest.raises(DataError) as err:
        _prepare(tokenizer, path)
    assert str(err.value) == (
        f"data.path: all 3 rows of {path!r} were dropped (3 empty); column 'messages' is empty in every such row: "
        "check data.messages_field"
    )


def test_rows_that_all_lack_the_configured_column(tokenizer, write_jsonl) -> None:
    path = write_jsonl([{"text": "hello"}, {"body": "x"}])
    with pytest.raises(DataError, match=r"^data\.text_field: column 'txt' is not in the data"):
        _prepare(tokenizer, path, text_field="txt")


def test_every_row_too_long_names_the_length_that_fits(tokenizer, write_jsonl) -> None:
    path = write_jsonl([chat("reverse: abcdefgh", "hgfedcba"), chat("reverse: abcdefghij", "jihgfedcba")])
    text = tokenizer.apply_chat_template(chat("reverse: abcdefgh", "hgfedcba")["messages"], tokenize=False)
    shortest = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(DataError) as err:
        _prepare(tokenizer, path, max_seq_length=16)
    assert str(err.value) == (
        f"data.path: all 2 rows of {path!r} were dropped (2 too long); the shortest row has {shortest} tokens: "
        f"raise training.max_seq_length to at least {shortest} or set data.truncate: true"
    )
    assert len(_prepare(tokenizer, path, max_seq_length=shortest)) == 1


def test_a_large_file_whose_sample_is_all_dropped_stops_before_tokenizing_it(
    tokenizer, write_jsonl, monkeypatch
) -> None:
    path = write_jsonl([chat(f"reverse: abcdefgh{k}", "hgfedcba") for k in range(5000)])
    encoded = []
    encode = BatchEncoder.encode
    monkeypatch.setattr(
        BatchEncoder, "encode", lambda self, rows: encoded.append(len(rows)) or encode(self, rows)
    )
    with pytest.raises(DataError) as err:
        _prepare(tokenizer, path, max_seq_length=16)
    assert sum(encoded) == 1000
    message = str(err.value)
    assert message.startswith(
        f"data.path: all 1,000 sampled rows of {path!r} (evenly spread over its 5,000) would be dropped "
        "(1,000 too long); the shortest sampled row has "
    )
    assert message.endswith("or set data.truncate: true")


def test_the_summary_line_names_every_reason(tokenizer, write_jsonl) -> None:
    rows = [
        chat("reverse: abc", "cba"),
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},
        chat("reverse: " + "a" * 60, "a" * 60),
        chat("reverse: " + "b" * 60, "b" * 60),
    ]
    line = str(_prepare(tokenizer, write_jsonl(rows)).summary)
    assert "6 rows read, 1 kept, 5 dropped (2 too long, 1 empty, 1 malformed, 1 no trainable token)" in line
