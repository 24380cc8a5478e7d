"""Local paths and Hugging Face Hub names, checked before loading: a path that does not exist, or a hub name the
hub cannot serve now, fails in seconds with the fix, instead of after the loaders' network retries.

A name is meant as a local path when it starts with ``/``, ``./``, ``../`` or ``~``, or when its parent directory
exists (``models/nope`` beside an existing ``models/``). Any other name is a hub id. When the hub is unreachable
(``HF_HUB_OFFLINE`` set, or no answer from ``HF_ENDPOINT`` within a few seconds) a hub id must be in the local
Hugging Face cache, and is then loaded in Hugging Face's offline mode (:func:`offline`): from the cache at once,
instead of after the loaders' retries.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from .errors import ConfigError

# how a local path begins (data.path files too: train/data/load.py)
PATH_PREFIXES = ("/", "./", "../", "~")
# Data file suffix -> the `datasets` builder that reads it. A data name with one of these suffixes is a local file.
DATA_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_TIMEOUT_S = 3.0


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path (see the module docstring)."""
    if name.startswith(PATH_PREFIXES):
        return True
    parent = Path(name).parent
    return str(parent) != "." and parent.is_dir()


def data_file_builder(path: Path) -> str | None:
    """The `datasets` builder of a data file, from its suffix (None for other names)."""
    name = path.name.lower()
    return next((builder for suffix, builder in DATA_FILE_BUILDERS.items() if name.endswith(suffix)), None)


def missing_local_path(field: str, name: str, data_file: bool = False) -> str | None:
    """The problem with ``name`` when it is meant as a local path and does not exist (None otherwise: it exists,
    or it is a hub id). With ``data_file``, a name ending like a data file is a local path too.

    Args:
        field: the setting that gave the name, for the message.
        name: the name.
        data_file: whether ``name`` names a dataset.
    """
    path = Path(name).expanduser()
    if path.exists() or not (looks_like_path(name) or (data_file and data_file_builder(path))):
        return None
    example = "'HuggingFaceH4/ultrachat_200k'" if data_file else "'Qwen/Qwen3-0.6B'"
    return (
        f"{field}: no such file or directory: {name!r} (looked for {path.resolve()}); point it at an existing "
        f"local path, or give a Hugging Face Hub id such as {example}"
    )


@functools.cache
def hub_unreachable() -> str | None:
    """Why the hub cannot be reached now (``HF_HUB_OFFLINE``, or no answer within a few seconds), or None.
    Asked once per process."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{endpoint} gave no answer: {reason}"
    return None


def _cached(name: str, repo_type: str, revision: str | None) -> bool:
    try:
        huggingface_hub.snapshot_download(name, repo_type=repo_type, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return False
    return True


def check_source(
    field: str,
    name: str,
    repo_type: str = "model",
    revision: str | None = None,
    error: type[ConfigError] = ConfigError,
) -> bool:
    """Fails at once when ``name`` cannot be loaded: a local-looking path that does not exist, or a hub id that
    the hub cannot serve now and the local cache does not hold.

    Args:
        field: the setting that gave the name, for the message (``model.name_or_path``, ``data.path``, ...).
        name: a local directory or file, or a hub id.
        repo_type: "model" or "dataset".
        revision: the hub revision asked for (the cache must hold it).
        error: the error class to raise.

    Returns:
        Whether to load ``name`` in offline mode (:func:`offline`): a hub id the hub cannot serve now, which the
        local cache holds.

    Raises:
        ConfigError (or ``error``): what is missing, and how to point ``field`` at a local copy.
    """
    if Path(name).expanduser().exists():
        return False
    if (problem := missing_local_path(field, name)) is not None:
        raise error(problem)
    if (why := hub_unreachable()) is None:
        return False
    if _cached(name, repo_type, revision):
        return True
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    raise error(
        f"{field}: {name!r} is not a local path, and the Hugging Face Hub cannot be reached ({why}) while the "
        f"local cache holds no copy of it; download it where the hub is reachable (`hf download {name}{flag} "
        f"--local-dir DIR`), copy DIR here and set {field}: DIR"
    )


@contextlib.contextmanager
def offline(active: bool) -> Iterator[None]:
    """Hugging Face's offline mode inside the block when ``active``, as ``HF_HUB_OFFLINE=1`` sets it at start-up:
    Transformers and ``datasets`` (when imported) load from the local cache without asking the hub.
    ``local_files_only`` alone would not do: Transformers still asks the hub for some files (an adapter config),
    and ``datasets`` has no such switch."""
    if not active:
        yield
        return
    flags = [constants]
    if "datasets" in sys.modules:
        flags.append(sys.modules["datasets"].config)
    saved = [flag.HF_HUB_OFFLINE for flag in flags]
    for flag in flags:
        flag.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for flag, value in zip(flags, saved, strict=True):
            flag.HF_HUB_OFFLINE = value
