"""The token cache: tokenized rows kept on disk between runs, keyed by what decides the tokens.

An entry is a directory ``<cache root>/tokens/<key>/`` of flat arrays (``arrays.py``) and a ``meta.json`` holding
the key's parts. The key covers the data source (for a local file its resolved path, size and modification time,
else the loaded dataset's fingerprint), the split, the configured data fields, the tokenizer (a hash of its
serialized state and special tokens), the chat template, ``ENCODING_VERSION`` and whether the rows are SFT rows or
preference pairs; not ``max_seq_length``, ``packing`` or ``data.truncate``, which are applied to the cached rows
afterwards.

An entry is filled in a temporary directory next to it and renamed into place when complete, so an interrupted
run never leaves a half entry that a later one trusts; of two processes filling the same key, the first rename
wins and the other uses it. The cache root is ``$LORALEI_CACHE_DIR``, else ``$XDG_CACHE_HOME/loralei``, else
``~/.cache/loralei``; removing it (or its ``tokens`` directory) clears the cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .arrays import TokenArrays
from .errors import DataError

CACHE_ENV = "LORALEI_CACHE_DIR"
META_FILE = "meta.json"
# Errors that mean the cache directory cannot take the entry (as opposed to errors of the data itself).
_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def cache_root() -> Path:
    """Where loralei keeps its caches (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "loralei"


def cache_key(parts: dict[str, Any]) -> str:
    """The entry name for a key's parts (a hash of their JSON)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _tokens_dir() -> Path:
    return cache_root() / "tokens"


def lookup(parts: dict[str, Any]) -> tuple[TokenArrays, dict[str, Any]] | None:
    """The cached rows for this key and their ``meta.json``, or None when there are none (or they are unreadable)."""
    entry = _tokens_dir() / cache_key(parts)
    try:
        meta = json.loads((entry / META_FILE).read_text())
        return (TokenArrays.load(entry), meta) if meta.get("key") == parts else None
    except (OSError, ValueError):
        return None


@contextmanager
def building(parts: dict[str, Any] | None) -> Iterator[Path]:
    """A fresh directory to fill an entry in; removed on the way out (``publish`` moves it first on success).

    Args:
        parts: the key's parts; None for rows that are not cached (a directory under the system's temp dir).

    Raises:
        DataError: the cache directory cannot be created or written.
    """
    try:
        if parts is None:
            tmp = Path(tempfile.mkdtemp(prefix="loralei-tokens-"))
        else:
            _tokens_dir().mkdir(parents=True, exist_ok=True)
            tmp = _tokens_dir() / f".tmp-{cache_key(parts)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
    except OSError as err:
        raise _unwritable(err) from None
    try:
        yield tmp
    except OSError as err:
        if err.errno not in _UNWRITABLE:
            raise
        raise _unwritable(err) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unwritable(err: OSError) -> DataError:
    return DataError(
        f"{CACHE_ENV}: cannot write the token cache under {cache_root()} ({err.strerror or err}); free some space "
        f"or set {CACHE_ENV} to a writable directory"
    )


def publish(tmp: Path, parts: dict[str, Any], meta: dict[str, Any]) -> TokenArrays:
    """Writes ``meta.json`` into a filled directory and renames it into place; returns the entry's arrays.

    When another process published the same key first, its entry is used and ``tmp`` is left to be removed.
    """
    (tmp / META_FILE).write_text(json.dumps({**meta, "key": parts}, indent=1, default=str))
    entry = _tokens_dir() / cache_key(parts)
    for _ in range(2):
        try:
            tmp.rename(entry)
            return TokenArrays.load(entry)
        except OSError:  # the entry exists: filled meanwhile by another process, or unreadable
            if (found := lookup(parts)) is not None:
                return found[0]
            _remove(entry)
    return TokenArrays.load(tmp, mmap=False)  # keeps failing: use the rows without caching them


def _remove(entry: Path) -> None:
    """Removes a broken entry: renamed away first, so no reader sees it half removed."""
    trash = entry.with_name(f".trash-{uuid.uuid4().hex[:8]}")
    try:
        entry.rename(trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
