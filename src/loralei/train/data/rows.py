"""The raw rows handed to tokenization: the columns the row format reads, in one Arrow file.

The loaded split (a ``datasets.Dataset``, possibly a slice of a larger file) is written once to an Arrow IPC file
in the cache entry's temporary directory; the main process and every tokenization worker read their rows from it
with ``pyarrow`` alone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from . import progress
from .formats import RowFormat

# Rows of a record batch of the rows file (a few MB of text): what a worker reads at a time.
BATCH_ROWS = 2048
# The metadata key naming the columns written as JSON text.
_JSON_KEY = b"loralei.json_columns"
# Optional columns of pretokenized rows, read when present.
_PRETOKENIZED_EXTRAS = ("labels", "attention_mask")


def needed_columns(fmt: RowFormat, columns: list[str]) -> list[str]:
    """The columns the format reads, in the order they appear in the data."""
    wanted = set(fmt.columns.values())
    if fmt.kind == "pretokenized":
        wanted.update(c for c in _PRETOKENIZED_EXTRAS if c in columns)
    return [c for c in columns if c in wanted]


def needs_chat(fmt: RowFormat, schema: pa.Schema) -> bool:
    """Whether rows of this format go through the chat template (prompt/completion and preference rows only when
    they hold turns, or may: a column of JSON values)."""
    if fmt.kind in ("messages", "instruction"):
        return True
    if fmt.kind not in ("prompt_completion", "preference"):
        return False
    columns = [
        fmt.columns[role] for role in ("prompt", "completion", "chosen", "rejected") if role in fmt.columns
    ]
    return any(pa.types.is_list(schema.field(c).type) or c in _json_columns(schema) for c in columns)


def write_rows(raw: Any, columns: list[str], path: Path) -> int:
    """Writes ``columns`` of a ``datasets.Dataset`` to an Arrow IPC file in record batches of ``BATCH_ROWS`` rows
    (the last one shorter); returns the number of rows.

    A column that ``datasets`` decodes on reading (e.g. its ``Json`` type, for values whose structure varies from
    row to row: messages of ShareGPT and role/content rows in one file) is written decoded, as JSON text, and
    named in the file's metadata; ``RowFile`` parses it back.
    """
    from datasets.features.features import require_decoding

    as_json = [c for c in columns if require_decoding(raw.features[c])]
    tables = raw.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
    decoded = raw.select_columns(as_json).iter(batch_size=BATCH_ROWS) if as_json else itertools.repeat({})
    first, first_values = next(iter(tables)), next(iter(decoded))
    schema = _as_json(first, first_values).schema.with_metadata({_JSON_KEY: json.dumps(as_json)})
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_file(sink, schema) as writer,
        progress.bar(total=len(raw), desc="reading", unit=" rows") as bar,
    ):
        # decoded never ends when no column needs it: the tables end the loop
        pairs = zip(itertools.chain([first], tables), itertools.chain([first_values], decoded), strict=False)
        for table, values in pairs:
            batch = _as_json(table, values).combine_chunks().to_batches()[0]
            writer.write_batch(batch.replace_schema_metadata(schema.metadata))
            bar.update(table.num_rows)
    return len(raw)


def _as_json(table: pa.Table, values: dict[str, list]) -> pa.Table:
    for name, column in values.items():
        text = pa.array([json.dumps(v, default=str) for v in column], pa.string())
        table = table.set_column(table.schema.get_field_index(name), name, text)
    return table


def _json_columns(schema: pa.Schema) -> list[str]:
    return json.loads((schema.metadata or {}).get(_JSON_KEY, b"[]"))


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
        self.json_columns = _json_columns(self.schema)

    def rows(self, start: int, stop: int, size: int) -> Iterator[list[dict]]:
        """The rows ``[start, stop)`` as dicts, in lists of at most ``size``."""
        for batch_number in range(start // BATCH_ROWS, -(-stop // BATCH_ROWS)):
            base = batch_number * BATCH_ROWS
            batch = self.reader.get_batch(batch_number)
            for at in range(max(start, base), min(stop, base + batch.num_rows), size):
                yield self._decoded(batch.slice(at - base, min(size, stop - at)))

    def take(self, indices: np.ndarray) -> list[dict]:
        """The rows at (sorted) ``indices``, as dicts."""
        out: list[dict] = []
        for batch_number in np.unique(indices // BATCH_ROWS):
            batch = self.reader.get_batch(int(batch_number))
            inside = indices[indices // BATCH_ROWS == batch_number] - batch_number * BATCH_ROWS
            out += self._decoded(batch.take(pa.array(inside)))
        return out

    def _decoded(self, batch: pa.RecordBatch) -> list[dict]:
        rows = batch.to_pylist()
        for row in rows:
            for column in self.json_columns:
                row[column] = json.loads(row[column])
        return rows


def even_sample(rows: int, size: int) -> np.ndarray:
    """``size`` row indices spread evenly from the first row to the last (every row when there are fewer)."""
    if rows <= size:
        return np.arange(rows)
    return np.unique(np.linspace(0, rows - 1, size).round().astype(np.int64))
