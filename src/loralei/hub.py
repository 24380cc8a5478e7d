"""Local paths and Hugging Face Hub names, checked before loading: a path that does not exist, or a hub name the
hub cannot serve now, fails in seconds with the fix, instead of after the loaders' network retries.

A name is meant as a local path when it starts with ``/``, ``./``, ``../`` or ``~``, or when its parent directory
exists (``models/nope`` beside an existing ``models/``). Any other name is a hub id. When the hub is unreachable
(``HF_HUB_OFFLINE`` set, or no answer from ``HF_ENDPOINT`` within a few seconds) a hub id must be in the local
Hugging Face cache.
"""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from .errors import ConfigError

# how a local path begins (data.path files too: train/data/load.py)
PATH_PREFIXES = ("/", "./", "../", "~")
_TIMEOUT_S = 3.0


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path (see the module docstring)."""
    if name.startswith(PATH_PREFIXES):
        return True
    parent = Path(name).parent
    return str(parent) != "." and parent.is_dir()


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
) -> None:
    """Fails at once when ``name`` cannot be loaded: a local-looking path that does not exist, or a hub id that
    the hub cannot serve now and the local cache does not hold.

    Args:
        field: the setting that gave the name, for the message (``model.name_or_path``, ``data.path``, ...).
        name: a local directory or file, or a hub id.
        repo_type: "model" or "dataset".
        revision: the hub revision asked for (the cache must hold it).
        error: the error class to raise.

    Raises:
        ConfigError (or ``error``): what is missing, and how to point ``field`` at a local copy.
    """
    path = Path(name).expanduser()
    if path.exists():
        return
    if looks_like_path(name):
        raise error(
            f"{field}: no such file or directory: {name!r} (looked for {path.resolve()}); point it at an existing "
            "local path, or give a Hugging Face Hub id such as 'Qwen/Qwen3-0.6B'"
        )
    if (why := hub_unreachable()) is None or _cached(name, repo_type, revision):
        return
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    raise error(
        f"{field}: {name!r} is not a local path, and the Hugging Face Hub cannot be reached ({why}) while the "
        f"local cache holds no copy of it; download it where the hub is reachable (`hf download {name}{flag} "
        f"--local-dir DIR`), copy DIR here and set {field}: DIR"
    )
