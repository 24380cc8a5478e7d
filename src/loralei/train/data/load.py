"""Reading the raw rows: local json / jsonl / parquet / csv files, data directories, or Hub dataset names."""

from __future__ import annotations

from pathlib import Path

import datasets

from ...hub import PATH_PREFIXES, check_source, offline
from .errors import DataError

# File suffix -> the `datasets` builder that reads it. A path with one of these suffixes is always local.
BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, builder in BUILDERS.items():
        if name.endswith(suffix):
            return builder
    return None


def _looks_local(path: str) -> bool:
    return path.startswith(PATH_PREFIXES) or _builder_for(Path(path)) is not None


def load_rows(
    path: str, split: str = "train", *, keys: tuple[str, str] = ("data.path", "data.split")
) -> datasets.Dataset:
    """Loads one split of a dataset with ``datasets.load_dataset``.

    Args:
        path: a local data file (``.json``, ``.jsonl``, ``.parquet``, ``.csv``, optionally ``.gz``), a local
            directory of such files, or a Hugging Face Hub dataset name.
        split: the split, with optional slicing such as ``"train[:100]"`` or ``"train[10%:]"``. Local files
            form the split ``"train"``.
        keys: the config keys that gave ``path`` and ``split``, named in errors (``data.eval_path``, ...).

    Returns:
        The rows as a ``datasets.Dataset``.

    Raises:
        DataError: the file does not exist, its type is unknown, the split does not exist, or loading failed.
    """
    path_key, split_key = keys
    local = Path(path).expanduser()
    if not local.exists() and _looks_local(path):
        raise DataError(
            f"{path_key}: file {path!r} does not exist; give an existing file or a Hub dataset name"
        )
    if local.is_file() and _builder_for(local) is None:
        kinds = ", ".join(BUILDERS)
        raise DataError(
            f"{path_key}: cannot tell the format of {path!r}; use a file ending in one of {kinds}"
        )
    cached_only = not local.exists() and check_source(path_key, path, "dataset", error=DataError)
    try:
        if local.is_file():
            return datasets.load_dataset(_builder_for(local), data_files=str(local), split=split)
        with offline(cached_only):
            return datasets.load_dataset(str(local) if local.exists() else path, split=split)
    except (ValueError, KeyError) as err:
        if "split" in str(err).lower():
            raise DataError(f"{split_key}: {split!r} cannot be read from {path!r}: {err}") from None
        raise DataError(f"{path_key}: cannot load {path!r}: {err}") from None
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        raise DataError(
            f"{path_key}: cannot load {path!r} ({type(err).__name__}: {err}); give an existing local file or a "
            "Hub dataset name you can reach"
        ) from None
