"""Row-format detection and configured fields."""

from __future__ import annotations

import pytest

from loralei.train.data import DataError
from loralei.train.data.formats import RowFormat, resolve_format

NO_FIELDS = dict.fromkeys(
    [
        "messages_field",
        "text_field",
        "instruction_field",
        "input_field",
        "response_field",
        "prompt_field",
        "completion_field",
    ]
)


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        (["messages", "id"], RowFormat("messages", {"messages": "messages"})),
        (["conversations"], RowFormat("messages", {"messages": "conversations"})),
        (["text"], RowFormat("text", {"text": "text"})),
        (
            ["prompt", "completion"],
            RowFormat("prompt_completion", {"prompt": "prompt", "completion": "completion"}),
        ),
        (
            ["instruction", "input", "output"],
            RowFormat("instruction", {"instruction": "instruction", "input": "input", "response": "output"}),
        ),
        (
            ["instruction", "response"],
            RowFormat("instruction", {"instruction": "instruction", "response": "response"}),
        ),
        (["input_ids", "labels", "text"], RowFormat("pretokenized", {"input_ids": "input_ids"})),
    ],
)
def test_detects_format_from_columns(columns, expected) -> None:
    assert resolve_format(columns, NO_FIELDS) == expected


def test_configured_field_wins_over_detection() -> None:
    fmt = resolve_format(["messages", "body"], {**NO_FIELDS, "text_field": "body"})
    assert fmt == RowFormat("text", {"text": "body"})
    fmt = resolve_format(["q", "a"], {**NO_FIELDS, "instruction_field": "q", "response_field": "a"})
    assert fmt == RowFormat("instruction", {"instruction": "q", "response": "a"})


def test_missing_configured_column_names_the_columns() -> None:
    with pytest.raises(DataError) as err:
        resolve_format(["messages", "id"], {**NO_FIELDS, "messages_field": "mesages"})
    message = str(err.value)
    assert "data.messages_field: column 'mesages' is not in the data" in message
    assert 'did you mean "messages"' in message
    assert "available columns: id, messages" in message


def test_incomplete_or_mixed_fields_are_errors() -> None:
    with pytest.raises(DataError, match=r"data\.response_field: needed for the instruction format"):
        resolve_format(["q", "a"], {**NO_FIELDS, "instruction_field": "q"})
    with pytest.raises(DataError, match="belong to different row formats"):
        resolve_format(["q", "a"], {**NO_FIELDS, "text_field": "q", "prompt_field": "a"})


def test_unknown_columns_are_an_error() -> None:
    with pytest.raises(
        DataError, match=r"cannot tell the row format from the columns body, id; .*data\.text_field"
    ):
        resolve_format(["body", "id"], NO_FIELDS)
