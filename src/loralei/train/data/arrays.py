"""The tokenized rows as flat arrays, written in parts (one per worker) and joined into ``.npy`` files.

A directory of encoded rows holds, one ``.npy`` file each:

* ``ids`` (``[tokens]``, uint16 when every id fits, else int32) and ``trained`` (``[tokens]`` bool): every row's
  tokens, one after the other, and whether each is trained;
* ``labels`` (``[tokens]`` int32), only for pretokenized data with its own labels column;
* ``offsets`` (``[rows + 1]`` int64): row ``i`` is ``ids[offsets[i]:offsets[i + 1]]``;
* ``reasons`` (``[rows]`` uint8): 0 for an encoded row, else 1 + the position of its drop reason in ``REASONS``;
* ``counts`` (``[rows]`` int64): the trained tokens of each row.

Nothing here imports torch: tokenization workers write parts too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from . import progress
from .encode import EncodedRow
from .messages import REASONS
from .template import IGNORE_INDEX

# Per-token arrays, then per-row arrays, with their dtypes (ids: see id_dtype).
TOKEN_ARRAYS = {"trained": np.dtype(bool), "labels": np.dtype(np.int32)}
ROW_ARRAYS = {"lengths": np.dtype(np.int64), "reasons": np.dtype(np.uint8), "counts": np.dtype(np.int64)}


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every token id below ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


class PartWriter:
    """Appends encoded rows to the part files of one shard (``part-<shard>.<array>``) in ``directory``.

    Args:
        directory: where the parts go.
        shard: this writer's shard number.
        ids: the dtype of token ids.
        labels: whether rows carry their own labels.
    """

    def __init__(self, directory: Path, shard: int, ids: np.dtype, labels: bool) -> None:
        names = {"ids": ids, **TOKEN_ARRAYS, **ROW_ARRAYS}
        if not labels:
            del names["labels"]
        self.dtypes = names
        self.files = {name: (directory / f"part-{shard}.{name}").open("wb") for name in names}

    def write(self, results: Sequence[EncodedRow | str]) -> None:
        """Appends a batch: each result is a row's tokens or its drop reason."""
        rows = [r for r in results if not isinstance(r, str)]
        arrays = {
            "reasons": [0 if not isinstance(r, str) else REASONS.index(r) + 1 for r in results],
            "lengths": [0 if isinstance(r, str) else len(r.ids) for r in results],
            "counts": [0 if isinstance(r, str) else int(np.count_nonzero(r.trained)) for r in results],
        }
        if rows:
            arrays["ids"] = np.concatenate([r.ids for r in rows])
            arrays["trained"] = np.concatenate([r.trained for r in rows])
            if "labels" in self.files:
                arrays["labels"] = np.concatenate([r.labels for r in rows])
        for name, values in arrays.items():
            self.files[name].write(np.asarray(values).astype(self.dtypes[name], copy=False).tobytes())

    def close(self) -> None:
        """Closes the part files."""
        for f in self.files.values():
            f.close()

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def join_parts(directory: Path, shards: int, ids: np.dtype, labels: bool) -> None:
    """Joins the shards' part files, in shard order, into the ``.npy`` files, and removes the parts."""
    names = {"ids": ids, **TOKEN_ARRAYS, "reasons": ROW_ARRAYS["reasons"], "counts": ROW_ARRAYS["counts"]}
    if not labels:
        del names["labels"]
    parts = {name: [directory / f"part-{k}.{name}" for k in range(shards)] for name in names}
    total = sum(p.stat().st_size for files in parts.values() for p in files)
    with progress.bar(total=total, desc="writing the token cache", unit="B", unit_scale=True) as bar:
        for name, dtype in names.items():
            _join(directory / f"{name}.npy", parts[name], dtype, bar.update)
    lengths = [np.fromfile(directory / f"part-{k}.lengths", dtype=np.int64) for k in range(shards)]
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    np.save(directory / "offsets.npy", offsets)
    for k in range(shards):
        (directory / f"part-{k}.lengths").unlink()


def _join(dest: Path, parts: list[Path], dtype: np.dtype, advance: Callable[[int], Any]) -> None:
    total = sum(p.stat().st_size for p in parts) // dtype.itemsize
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (total,)}
    with dest.open("wb") as out:
        np.lib.format.write_array_header_1_0(out, header)
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 22):
                    out.write(chunk)
                    advance(len(chunk))
            part.unlink()


@dataclass
class TokenArrays:
    """Encoded rows (see the module docstring), in memory or memory-mapped from ``path``.

    A memory-mapped instance pickles as its path (DataLoader workers map the files again instead of copying them).
    """

    ids: np.ndarray
    trained: np.ndarray
    labels: np.ndarray | None
    offsets: np.ndarray
    reasons: np.ndarray
    counts: np.ndarray
    path: Path | None = None

    @classmethod
    def load(cls, path: Path, mmap: bool = True) -> TokenArrays:
        """Opens the arrays in ``path`` (memory-mapped, or read into memory with ``mmap=False``)."""
        mode = "r" if mmap else None
        labels = path / "labels.npy"
        return cls(
            ids=np.load(path / "ids.npy", mmap_mode=mode),
            trained=np.load(path / "trained.npy", mmap_mode=mode),
            labels=np.load(labels, mmap_mode=mode) if labels.exists() else None,
            offsets=np.load(path / "offsets.npy"),
            reasons=np.load(path / "reasons.npy"),
            counts=np.load(path / "counts.npy"),
            path=path if mmap else None,
        )

    def __getstate__(self) -> dict:
        return {"path": self.path} if self.path is not None else dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(TokenArrays.load(state["path"]).__dict__ if len(state) == 1 else state)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens in each row (0 for a dropped row)."""
        return np.diff(self.offsets)

    def sample(self, row: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``length`` tokens of a row: ``(input_ids, labels)`` as int64 arrays."""
        at = slice(int(self.offsets[row]), int(self.offsets[row]) + length)
        ids = self.ids[at].astype(np.int64)
        if self.labels is not None:
            return ids, self.labels[at].astype(np.int64)
        return ids, np.where(self.trained[at], ids, IGNORE_INDEX)
