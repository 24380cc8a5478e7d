"""Reading the raw rows: local json / jsonl / parquet / csv files, data directories, or Hub dataset names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...hub import DATA_FILE_BUILDERS, check_source, data_file_builder, missing_local_path, offline
from .errors import DataError


def local_file_identity(path: str) -> dict[str, Any] | None:
    """What identifies a local data file's content without reading it: its resolved path, size and modification
    time (None when ``path`` is not an existing file: a directory or a Hub name)."""
    local = Path(path).expanduser()
    if not local.is_file():
        return None
    stat = local.stat()
    return {"file": str(local.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def load_rows(path: str, split: str = "train", *, keys: tuple[str, str] = ("data.path", "data.split")) -> Any:
    """Loads one split of a dataset with ``datasets.load_dataset``.

    Args:
        path: a local data file (``.json``, ``.jsonl``, ``.parquet``, ``.csv``, optionally ``.gz``), a local
            directory of such files, or a Hugging Face Hub dataset name.
        split: the split, with optional slicing such as ``"train[:100]"`` or ``"train[10%:]"``. Local files
            form the split ``"train"``.
        keys: the config keys that gave ``path`` and ``split``, named in errors (``data.eval_path``, ...).

    Returns:
        The rows as a ``datasets.Dataset`` (at least one).

    Raises:
        DataError: the file does not exist, is empty or has no rows, its type is unknown, the split does not
            exist, or loading failed.
    """
    import datasets

    path_key, split_key = keys
    local = Path(path).expanduser()
    _check_local(local, path, path_key)
    cached_only = not local.exists() and check_source(path_key, path, "dataset", error=DataError)
    try:
        if local.is_file():
            rows = datasets.load_dataset(data_file_builder(local), data_files=str(local), split=split)
        else:
            with offline(cached_only):
                rows = datasets.load_dataset(str(local) if local.exists() else path, split=split)
    except (ValueError, KeyError) as err:
        if "corresponds to no data" in str(err):
            raise _no_rows(keys, path, split) from None
        if "split" in str(err).lower():
            raise DataError(f"{split_key}: {split!r} cannot be read from {path!r}: {err}") from None
        raise DataError(f"{path_key}: cannot load {path!r}: {err}") from None
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        raise DataError(
            f"{path_key}: cannot load {path!r} ({type(err).__name__}: {err}); give an existing local file or a "
            "Hub dataset name you can reach"
        ) from None
    if len(rows) == 0:
        raise _no_rows(keys, path, split)
    return rows


def _check_local(local: Path, path: str, path_key: str) -> None:
    if (missing := missing_local_path(path_key, path, data_file=True)) is not None:
        raise DataError(missing)
    if local.is_file() and data_file_builder(local) is None:
        kinds = ", ".join(DATA_FILE_BUILDERS)
        raise DataError(
            f"{path_key}: cannot tell the format of {path!r}; use a file ending in one of {kinds}"
        )
    if local.is_file() and local.stat().st_size == 0:
        raise DataError(f"{path_key}: {path!r} is empty (0 bytes); give a file with at least one row")


def _no_rows(keys: tuple[str, str], path: str, split: str) -> DataError:
    if "[" in split:
        return DataError(f"{keys[1]}: {split!r} selects no rows of {path!r}; widen the slice")
    where = repr(path) if split == "train" else f"the split {split!r} of {path!r}"
    return DataError(f"{keys[0]}: {where} has no rows; give data with at least one row")
