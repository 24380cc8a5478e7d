"""Reading a run config: the YAML file, section aliases, and ``key=value`` command-line overrides."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .schema import SECTION_ALIASES, RunConfig, validate_config

# YAML 1.1 reads "1e-3" (no dot) as a string; a command line should mean the number.
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits ``training.max_steps=100`` into ``(["training", "max_steps"], 100)``.

    The value is parsed as YAML, so ``true``, ``1e-4``, ``[q_proj, v_proj]`` and ``null`` get their types.

    Raises:
        ConfigError: no ``=``, an empty key part, or a value that is not valid YAML.
    """
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(
            f"override {text!r} must look like dotted.key=value, e.g. training.max_steps=100 or lora.r=16"
        )
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    if isinstance(parsed, str) and _SCIENTIFIC.fullmatch(parsed):
        parsed = float(parsed)
    return parts, parsed


def _canonical_sections(raw: dict[str, Any], source: str) -> dict[str, Any]:
    out = dict(raw)
    for alias, name in SECTION_ALIASES.items():
        if alias in out:
            if name in out:
                raise ConfigError(f"{source}: both '{name}' and its alias '{alias}' are given; keep one")
            out[name] = out.pop(alias)
    return out


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns a copy of ``raw`` with each ``dotted.key=value`` set (creating sections as needed).

    Raises:
        ConfigError: a malformed override, or one that descends into a value that is not a section.
    """
    out = _deep_copy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        parts[0] = SECTION_ALIASES.get(parts[0], parts[0])
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None or child is False:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {text!r}: {where} is {child!r}, not a section with keys")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in raw.items()}


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Parses a YAML config file into a mapping with canonical section names.

    Raises:
        ConfigError: the file is missing, not valid YAML, or not a mapping at the top.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML:\n{exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return _canonical_sections(raw, str(path))


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads, overrides and validates a run config.

    Args:
        path: the YAML file. Relative paths inside it are relative to the current directory.
        overrides: ``dotted.key=value`` strings applied on top of the file.

    Returns:
        The validated config.

    Raises:
        ConfigError: any problem with the file or its values, all reported together.
    """
    raw = apply_overrides(read_yaml(path), overrides)
    return validate_config(raw, source=str(path))
