"""Fixtures of the data-pipeline tests: the committed quickstart tokenizer and small data files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from data_helpers import QUICKSTART
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The character-level quickstart tokenizer (ChatML template, no generation tags)."""
    return AutoTokenizer.from_pretrained(QUICKSTART / "model")


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[[list[dict], str], str]:
    """Writes rows to a jsonl file in tmp_path and returns its path."""

    def write(rows: list[dict], name: str = "data.jsonl") -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    return write
