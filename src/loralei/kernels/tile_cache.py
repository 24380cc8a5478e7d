"""A small JSON file of autotuned kernel tiles, so a search runs once per machine and shape, not once per process.

The file maps string keys (a kernel's shape key, which includes the GPU name and the torch and triton versions,
so a changed machine or library searches again) to the winning tile, a dict of ints. It lives in
``$LORALEI_CACHE_DIR`` if set, else ``~/.cache/loralei``. Writes go to a temporary file that is then renamed
over the old one, so a reader never sees half a file; a file that does not parse is ignored (and replaced at the
next write).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The directory of loralei's cache files (``$LORALEI_CACHE_DIR`` or ``~/.cache/loralei``), read now."""
    env = os.environ.get("LORALEI_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "loralei"


def key_string(key: tuple) -> str:
    """The file's key for a tuple of names and numbers, e.g. ``("H200", "2.8", 4096) -> "H200|2.8|4096"``."""
    return "|".join(str(part) for part in key)


def load(path: Path) -> dict[str, dict[str, int]]:
    """The tiles stored in ``path``.

    Args:
        path: the JSON file.

    Returns:
        Key -> tile; empty when the file is missing, unreadable or not a JSON object of objects.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, unreadable, or corrupt (e.g. an interrupted older writer)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def store(path: Path, key: str, tile: dict[str, int]) -> None:
    """Adds ``key -> tile`` to the file at ``path``, atomically; entries others wrote meanwhile are kept.

    Args:
        path: the JSON file (its directory is created if needed).
        key: the entry's key (see :func:`key_string`).
        tile: the tile, e.g. ``{"BLOCK_M": 128, ..., "num_warps": 8}``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = load(path)  # re-read: another process may have added keys since this one loaded the file
    entries[key] = tile
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
