"""Tokenizing a data source once: the token cache's rows when it has them, else every row encoded and cached.

A cold start encodes an evenly spread sample of the rows first (in this process): if the settings would drop every
sampled row, it stops within seconds with the counts by reason and the fix, instead of after tokenizing everything.
The sample also times the encoding: the rows are then split into contiguous shards, one per worker process, when
that pays for the workers' start (about a second), else encoded here.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import cache, progress
from .arrays import PartWriter, TokenArrays, id_dtype, join_parts
from .backend import SlowTokenizer, TokenizerSpec
from .encode import ENCODING_VERSION
from .errors import DataError
from .formats import RowFormat, resolve_format
from .load import load_rows, local_file_identity
from .preference_rows import preference_format
from .rows import RowFile, even_sample, needed_columns, needs_chat, write_rows
from .shard import BATCH_ROWS, EncodeJob, encode_shard
from .template import load_chat_template, template_identity
from .workers import run_workers

SAMPLE_ROWS = 1_000
# Workers start in about a second each; below this much encoding (as timed on the sample) one process is faster.
MIN_PARALLEL_SECONDS = 3.0
ROWS_FILE = "rows.arrow"


@dataclass(frozen=True)
class DataSource:
    """Where rows come from and how they are read.

    Attributes:
        path: a local file or directory, or a Hub dataset name.
        split: the split (with optional slicing).
        keys: the settings that gave ``path`` and ``split``, named in errors.
        fields: ``{"messages_field": ..., ...}`` as configured (None: detect).
        chat_template: ``data.chat_template`` (None: the tokenizer's).
        pairs: preference rows (prompt, chosen, rejected), each encoded as two sequences, rather than SFT rows.
    """

    path: str
    split: str
    keys: tuple[str, str]
    fields: dict[str, str | None]
    chat_template: str | None
    pairs: bool = False

    def row_format(self, columns: list[str]) -> RowFormat:
        """The format of rows with these columns (``preference`` for pairs).

        Raises:
            DataError: the configured fields do not fit the columns.
        """
        return preference_format(columns, self.fields) if self.pairs else resolve_format(columns, self.fields)


@dataclass(frozen=True)
class Tokenized:
    """Encoded rows and where they came from."""

    arrays: TokenArrays
    fmt: RowFormat
    from_cache: bool


# Checks encoded rows (all of them, or the sample): (arrays, rows in the data, sampled, format) -> raises or not.
Check = Callable[[TokenArrays, int, bool, RowFormat], None]


def resolve_workers(setting: int | str | None) -> int:
    """``training.preprocessing_num_workers``: ``auto`` (or None) is the cores this process may use.

    Raises:
        DataError: neither ``auto`` nor a positive integer.
    """
    if setting is None or setting == "auto":
        return usable_cores()
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise DataError(
            f"training.preprocessing_num_workers: must be auto or an integer >= 1, got {setting!r}"
        )
    return setting


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its CPU affinity, lowered to a container's CPU quota (cgroup v2
    ``cpu.max``) when it has one (a container often sees every core of its host but may use a few)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def tokenize_source(tokenizer: Any, source: DataSource, *, workers: int, check: Check) -> Tokenized:
    """The encoded rows of a data source, from the token cache or encoded now (and then cached).

    Args:
        tokenizer: the Transformers tokenizer.
        source: the data.
        workers: the most worker processes to encode with.
        check: run on the sample's rows before encoding all of them (and on all rows when they are the sample).

    Returns:
        The encoded rows, their format, and whether they came from the cache.

    Raises:
        DataError: unreadable data, a bad field or template, every sampled row dropped, or a failed worker.
    """
    spec = TokenizerSpec.of(tokenizer)
    parts = None
    if spec is not None and (local := local_file_identity(source.path)) is not None:
        parts = _key_parts(source, local, spec, tokenizer)
        if (found := _cached(parts)) is not None:
            return found
    raw = load_rows(source.path, source.split, keys=source.keys)
    if spec is not None and parts is None:
        # datasets names a loaded dataset's content by this fingerprint (a hash of its files and operations)
        parts = _key_parts(source, {"fingerprint": raw._fingerprint}, spec, tokenizer)
        if (found := _cached(parts)) is not None:
            return found
    fmt = source.row_format(raw.column_names)
    with cache.building(parts) as tmp:
        write_rows(raw, needed_columns(fmt, raw.column_names), tmp / ROWS_FILE)
        del raw  # read from the Arrow file from here on; the loaded dataset's mapped pages are let go
        job = _job(tmp, fmt, tokenizer, spec, source.chat_template)
        _encode(job, SlowTokenizer(tokenizer) if spec is None else None, workers, check)
        meta = {"encoding_version": ENCODING_VERSION, "format": asdict(fmt), "ids_dtype": job.ids_dtype}
        arrays = cache.publish(tmp, parts, meta) if parts is not None else TokenArrays.load(tmp, mmap=False)
    return Tokenized(arrays, fmt, from_cache=False)


def _cached(parts: dict[str, Any]) -> Tokenized | None:
    found = cache.lookup(parts)
    return None if found is None else Tokenized(found[0], RowFormat(**found[1]["format"]), from_cache=True)


def _key_parts(source: DataSource, origin: dict, spec: TokenizerSpec, tokenizer: Any) -> dict[str, Any]:
    return {
        "encoding_version": ENCODING_VERSION,
        "rows": "preference pairs" if source.pairs else "sft",
        "source": origin,
        "split": source.split,
        "fields": source.fields,
        "tokenizer": spec.digest(),
        "chat_template": template_identity(tokenizer, source.chat_template),
    }


def _job(
    tmp: Path, fmt: RowFormat, tokenizer: Any, spec: TokenizerSpec | None, chat_template: str | None
) -> EncodeJob:
    """The encoding job of the rows written to ``tmp``: one shard of every row."""
    table = RowFile(tmp / ROWS_FILE)
    chat = load_chat_template(tokenizer, chat_template) if needs_chat(fmt, table.schema) else None
    backend_size = spec.build().get_vocab_size(with_added_tokens=True) if spec is not None else 0
    return EncodeJob(
        rows=str(tmp / ROWS_FILE),
        out=str(tmp),
        fmt=asdict(fmt),
        tokenizer=spec.to_json() if spec is not None else None,
        chat=chat.to_json() if chat is not None else None,
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=len(tokenizer),
        keep_labels=fmt.kind == "pretokenized" and "labels" in table.schema.names,
        ids_dtype=id_dtype(max(len(tokenizer), backend_size)).str,
        shards=[[0, table.num_rows]],
    )


def _encode(job: EncodeJob, slow_tokenizer: Any, workers: int, check: Check) -> None:
    """Encodes every row of the job into its directory: an evenly spread sample first, checked, then the rest.

    Args:
        job: the encoding job.
        slow_tokenizer: the tokenizer to encode with when it has no fast backend (then all in this process).
        workers: the most worker processes.
        check: run on the sample (see ``tokenize_source``).
    """
    out, ids = Path(job.out), np.dtype(job.ids_dtype)
    table = RowFile(Path(job.rows))
    encoder = job.encoder(tokenizer=slow_tokenizer)
    sample = even_sample(table.num_rows, SAMPLE_ROWS)
    every_row = len(sample) == table.num_rows
    sample_dir = out if every_row else out / "sample"
    sample_dir.mkdir(exist_ok=True)
    started = time.perf_counter()
    with PartWriter(sample_dir, 0, ids, job.keep_labels) as writer:
        for at in range(0, len(sample), BATCH_ROWS):
            writer.write(encoder.encode(table.take(sample[at : at + BATCH_ROWS])))
    seconds = (time.perf_counter() - started) * table.num_rows / len(sample)
    join_parts(sample_dir, 1, ids, job.keep_labels)
    check(TokenArrays.load(sample_dir, mmap=False), table.num_rows, not every_row, RowFormat(**job.fmt))
    if not every_row:
        shutil.rmtree(sample_dir)
        parallel = workers if slow_tokenizer is None and seconds >= MIN_PARALLEL_SECONDS else 1
        _encode_all(job, table, encoder, parallel)
    Path(job.rows).unlink()


def _encode_all(job: EncodeJob, table: RowFile, encoder: Any, workers: int) -> None:
    """Encodes every row: in ``workers`` processes over contiguous shards, or here when that is 1."""
    rows = table.num_rows
    shards = min(workers, max(1, rows // SAMPLE_ROWS))
    bounds = np.linspace(0, rows, shards + 1).round().astype(int).tolist()
    job.shards = [[start, stop] for start, stop in itertools.pairwise(bounds)]
    out = Path(job.out)
    if shards > 1:
        job.save(out / "job.json")
        run_workers(out / "job.json", shards, rows, out)
        (out / "job.json").unlink()
    else:
        with progress.bar(total=rows, desc="tokenizing", unit=" rows") as bar:
            encode_shard(job, 0, table, encoder, bar.update)
    join_parts(out, shards, np.dtype(job.ids_dtype), job.keep_labels)
