"""Encoding one contiguous shard of the rows into part files: in the main process, or as a tokenization worker.

A worker is started by ``workers.py`` with the path of an ``EncodeJob`` (JSON) and its shard number; it reports
the rows it has done, one number a line, on its standard output, and leaves when that pipe closes (its parent is
gone). Ctrl-C is the main process's to handle: workers ignore SIGINT and are stopped by it.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .arrays import PartWriter
from .backend import TokenizerSpec
from .encode import BatchEncoder
from .formats import RowFormat
from .rows import RowFile
from .template import ChatRenderer, ChatTemplate

# Rows tokenized together: a tokenizers Encoding holds ~100 bytes a token, so a batch of long rows is tens of MB.
BATCH_ROWS = 64


@dataclass
class EncodeJob:
    """What every shard of one tokenization needs (plain data: workers read it as JSON).

    Attributes:
        rows: the Arrow file of the rows (``rows.write_rows``).
        out: the directory the part files go to.
        fmt: the row format (``RowFormat`` fields).
        tokenizer: the ``TokenizerSpec`` fields (None for a slow tokenizer, encoded in the main process only).
        chat: the ``ChatTemplate`` fields, for formats that render conversations.
        eos_token_id: appended to plain texts and completions.
        vocab_size: pretokenized ids must be below it.
        keep_labels: store pretokenized rows' own labels.
        ids_dtype: the dtype token ids are stored in.
        shards: ``[start, stop)`` row ranges, one per shard.
    """

    rows: str
    out: str
    fmt: dict[str, Any]
    tokenizer: dict[str, Any] | None
    chat: dict[str, Any] | None
    eos_token_id: int | None
    vocab_size: int
    keep_labels: bool
    ids_dtype: str
    shards: list[list[int]] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """Writes the job as JSON."""
        path.write_text(json.dumps(asdict(self)))

    def encoder(self, tokenizer: Any = None, batched: bool = False) -> BatchEncoder:
        """The row encoder (``tokenizer``: the tokenizer to use when ``self.tokenizer`` is None)."""
        return BatchEncoder(
            fmt=RowFormat(**self.fmt),
            tokenizer=TokenizerSpec(**self.tokenizer).build() if self.tokenizer is not None else tokenizer,
            chat=ChatRenderer(ChatTemplate(**self.chat)) if self.chat is not None else None,
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
            keep_labels=self.keep_labels,
            batched=batched,
        )


def encode_shard(
    job: EncodeJob, shard: int, rows: RowFile, encoder: BatchEncoder, progress: Callable[[int], Any]
) -> None:
    """Encodes the rows of one shard, batch by batch, into part files in ``job.out``.

    Args:
        job: the tokenization.
        shard: which of ``job.shards``.
        rows: the rows.
        encoder: the row encoder.
        progress: called with the number of rows of each batch done.
    """
    start, stop = job.shards[shard]
    with PartWriter(Path(job.out), shard, np.dtype(job.ids_dtype), job.keep_labels) as writer:
        for batch in rows.rows(start, stop, BATCH_ROWS):
            writer.write(encoder.encode(batch))
            progress(len(batch))


def _report(rows: int) -> None:
    print(rows, flush=True)


def main(argv: list[str]) -> None:
    """A worker's entry: ``argv`` is ``[job.json, shard]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job = EncodeJob(**json.loads(Path(argv[0]).read_text()))
    try:
        encode_shard(job, int(argv[1]), RowFile(Path(job.rows)), job.encoder(batched=True), _report)
    except BrokenPipeError:  # the main process is gone: nobody wants the rest
        sys.exit(1)
