"""Preference rows in TRL's formats: ``prompt`` (optional), ``chosen`` and ``rejected``, each text (standard) or a
list of messages (conversational). Without a prompt column the prompt is implicit: the longest common prefix of
the chosen and rejected completions (whole messages for conversations; for text, cut before a space they share,
so each completion keeps its leading space)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import DataError, missing_column_error
from .formats import RowFormat
from .messages import IDENTICAL, MALFORMED, normalize_messages
from .template import DropRow

# data.<key> -> the default column; the prompt is optional (implicit when absent)
PREFERENCE_FIELDS = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}


@dataclass(frozen=True)
class PreferenceColumns:
    """The columns of a preference dataset (``prompt`` None: the prompt is implicit)."""

    prompt: str | None
    chosen: str
    rejected: str


def resolve_preference_columns(columns: Sequence[str], fields: dict[str, str | None]) -> PreferenceColumns:
    """The preference columns, from ``data.prompt_field`` / ``chosen_field`` / ``rejected_field`` or their
    default names.

    Raises:
        DataError: a configured column is missing, or there is no chosen or rejected column.
    """
    found: dict[str, str | None] = {}
    for key, default in PREFERENCE_FIELDS.items():
        given = fields.get(key)
        if given is not None and given not in columns:
            raise missing_column_error(key, given, columns)
        column = given or (default if default in columns else None)
        if column is None and key != "prompt_field":
            raise DataError(
                f"data.{key}: preference data (training.objective dpo, orpo, cpo, simpo or kto) needs a {default!r} "
                f"column, and this data has none (columns: {', '.join(columns) or '(none)'}); name it with "
                f"data.{key}, or give prompt/chosen/rejected rows (training.objective: sft takes SFT rows)"
            )
        found[key] = column
    return PreferenceColumns(found["prompt_field"], found["chosen_field"], found["rejected_field"])


def preference_format(columns: Sequence[str], fields: dict[str, str | None]) -> RowFormat:
    """The ``preference`` row format (roles ``prompt`` when there is one, ``chosen``, ``rejected``) that the row
    encoder and the token cache read; see ``resolve_preference_columns``."""
    found = resolve_preference_columns(columns, fields)
    roles = {"prompt": found.prompt, "chosen": found.chosen, "rejected": found.rejected}
    return RowFormat("preference", {role: column for role, column in roles.items() if column is not None})


def _common_prefix(chosen: Sequence[Any], rejected: Sequence[Any]) -> int:
    """The length of the longest common prefix of two sequences (strings or message lists)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def _implicit(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) with the prompt taken out of both completions."""
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _conversations(prompt: list, chosen: list, rejected: list) -> tuple[list, list, list]:
    """The three message lists with their roles normalised (each completion checked with its prompt)."""
    n = len(prompt)
    full_chosen = normalize_messages(prompt + chosen)
    full_rejected = normalize_messages(prompt + rejected)
    return full_chosen[:n], full_chosen[n:], full_rejected[n:]


def split_pair(row: dict, columns: PreferenceColumns) -> tuple[Any, Any, Any]:
    """A row's (prompt, chosen, rejected): all text, or all message lists (roles normalised).

    Raises:
        DropRow: the row mixes text and conversations, has an empty completion, or chosen equals rejected.
    """
    chosen, rejected = row[columns.chosen], row[columns.rejected]
    prompt = row[columns.prompt] if columns.prompt is not None else None
    if prompt is None:
        prompt, chosen, rejected = _implicit(chosen, rejected)
    kinds = {type(v) for v in (chosen, rejected)} | ({type(prompt)} if prompt else set())
    if kinds == {str}:
        parts = (prompt or "", chosen, rejected)
    elif kinds == {list}:
        parts = _conversations(prompt or [], chosen, rejected)
    else:
        raise DropRow(MALFORMED)
    if not parts[1] or not parts[2]:
        raise DropRow(MALFORMED)
    if parts[1] == parts[2]:
        raise DropRow(IDENTICAL)
    return parts
