"""Imports the module named in ``LORALEI_BENCH_PREIMPORT`` (Unsloth) before anything else of the process: Unsloth
patches Transformers, PEFT and TRL when imported, so it must come first. A script imports this module first; a
failed import is kept in ``ERROR`` for the script to report as its row's error."""

from __future__ import annotations

import importlib
import os

NAME = os.environ.get("LORALEI_BENCH_PREIMPORT")
ERROR: str | None = None
if NAME:
    try:
        importlib.import_module(NAME)
    except Exception as err:
        ERROR = f"{type(err).__name__} importing {NAME}: {err}"
