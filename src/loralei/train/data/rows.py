"""The raw rows handed to tokenization: the columns the row format reads, in one Arrow file.

The loaded split (a ``datasets.Dataset``, possibly a slice of a larger file) is written once to an Arrow IPC file
in the cache entry's temporary directory; the main process and every tokenization worker read their rows from it
with ``pyarrow`` alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from .formats import RowFormat

# Rows of a record batch of the rows file (a few MB of text): what a worker reads at a time.
BATCH_ROWS = 2048
# Optional columns of pretokenized rows, read when present.
_PRETOKENIZED_EXTRAS = ("labels", "attention_mask")


def needed_columns(fmt: RowFormat, columns: list[str]) -> list[str]:
    """The columns the format reads, in the order they appear in the data."""
    wanted = set(fmt.columns.values())
    if fmt.kind == "pretokenized":
        wanted.update(c for c in _PRETOKENIZED_EXTRAS if c in columns)
    return [c for c in columns if c in wanted]


def needs_chat(fmt: RowFormat, schema: pa.Schema) -> bool:
    """Whether rows of this format go through the chat template (prompt/completion only when they hold turns)."""
    if fmt.kind in ("messages", "instruction"):
        return True
    if fmt.kind != "prompt_completion":
        return False
    return any(pa.types.is_list(schema.field(fmt.columns[r]).type) for r in ("prompt", "completion"))


def write_rows(raw: Any, columns: list[str], path: Path) -> int:
    """Writes ``columns`` of a ``datasets.Dataset`` to an Arrow IPC file in record batches of ``BATCH_ROWS`` rows
    (the last one shorter); returns the number of rows."""
    tables = raw.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
    first = next(iter(tables))
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_file(sink, first.schema) as writer,
        tqdm(total=len(raw), desc="reading", unit=" rows", delay=1) as bar,
    ):
        for table in itertools.chain([first], tables):
            writer.write_batch(table.combine_chunks().to_batches()[0])
            bar.update(table.num_rows)
    return len(raw)


class RowFile:
    """Reads rows from a file written by ``write_rows``, a record batch at a time.

    The file is read, not memory-mapped: mapped pages stay in a process's resident memory once touched, and every
    worker would end up holding its whole shard.
    """

    def __init__(self, path: Path) -> None:
        self.reader = pa.ipc.open_file(pa.OSFile(str(path)))
        batches = self.reader.num_record_batches
        last = self.reader.get_batch(batches - 1).num_rows if batches else 0
        self.num_rows = (batches - 1) * BATCH_ROWS + last if batches else 0
        self.schema = self.reader.schema

    def rows(self, start: int, stop: int, size: int) -> Iterator[list[dict]]:
        """The rows ``[start, stop)`` as dicts, in lists of at most ``size``."""
        for batch_number in range(start // BATCH_ROWS, -(-stop // BATCH_ROWS)):
            base = batch_number * BATCH_ROWS
            batch = self.reader.get_batch(batch_number)
            for at in range(max(start, base), min(stop, base + batch.num_rows), size):
                yield batch.slice(at - base, min(size, stop - at)).to_pylist()

    def take(self, indices: np.ndarray) -> list[dict]:
        """The rows at (sorted) ``indices``, as dicts."""
        out: list[dict] = []
        for batch_number in np.unique(indices // BATCH_ROWS):
            batch = self.reader.get_batch(int(batch_number))
            inside = indices[indices // BATCH_ROWS == batch_number] - batch_number * BATCH_ROWS
            out += batch.take(pa.array(inside)).to_pylist()
        return out


def even_sample(rows: int, size: int) -> np.ndarray:
    """``size`` row indices spread evenly from the first row to the last (every row when there are fewer)."""
    if rows <= size:
        return np.arange(rows)
    return np.unique(np.linspace(0, rows - 1, size).round().astype(np.int64))
