"""Row formats: which columns hold the data, detected from the columns or taken from the configured fields.

A format is one of ``messages`` (chat turns), ``prompt_completion``, ``instruction`` (instruction / input /
response), ``text`` (plain text, every token trained) and ``pretokenized`` (``input_ids`` [+ ``labels``,
``attention_mask``], used as they are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import DataError, missing_column_error


@dataclass(frozen=True)
class RowFormat:
    """A detected row format.

    Attributes:
        kind: ``"messages"``, ``"prompt_completion"``, ``"instruction"``, ``"text"`` or ``"pretokenized"``.
        columns: role in the format (``"messages"``, ``"prompt"``, ``"input"``, ...) -> column name; optional
            roles whose column is absent are left out.
    """

    kind: str
    columns: dict[str, str]


@dataclass(frozen=True)
class _Role:
    key: str  # the prepare_sft_dataset argument / YAML key that names this column
    defaults: tuple[str, ...]  # column names tried, in order, when the key is not given
    required: bool = True


# Detection order matters: pretokenized first (its rows may also carry text), plain text last.
FORMATS: dict[str, dict[str, _Role]] = {
    "pretokenized": {"input_ids": _Role("", ("input_ids",))},
    "messages": {"messages": _Role("messages_field", ("messages", "conversations"))},
    "prompt_completion": {
        "prompt": _Role("prompt_field", ("prompt",)),
        "completion": _Role("completion_field", ("completion",)),
    },
    "instruction": {
        "instruction": _Role("instruction_field", ("instruction",)),
        "input": _Role("input_field", ("input",), required=False),
        "response": _Role("response_field", ("response", "output")),
    },
    "text": {"text": _Role("text_field", ("text",))},
}
FIELD_KEYS = tuple(role.key for roles in FORMATS.values() for role in roles.values() if role.key)


def _fill(kind: str, given: dict[str, str], columns: Sequence[str]) -> RowFormat | _Role:
    """Completes one format from the given fields and the default column names.

    Returns the format, or the first required role whose column is missing.
    """
    found = {}
    for name, role in FORMATS[kind].items():
        column = given.get(role.key) or next((c for c in role.defaults if c in columns), None)
        if column is not None and column in columns:
            found[name] = column
        elif role.key in given:
            raise missing_column_error(role.key, given[role.key], columns)
        elif role.required:
            return role
    return RowFormat(kind, found)


def resolve_format(columns: Sequence[str], fields: dict[str, str | None]) -> RowFormat:
    """Picks the row format from the configured fields, or detects it from the column names.

    Args:
        columns: the dataset's column names.
        fields: ``{"messages_field": ..., "text_field": ..., ...}``; ``None`` values mean "not configured".

    Returns:
        The format and the column of each of its parts.

    Raises:
        DataError: a configured column is missing, fields of two formats are mixed, a format is incomplete, or
            no format fits the columns.
    """
    given = {key: value for key, value in fields.items() if value is not None}
    kinds = [kind for kind, roles in FORMATS.items() if any(r.key in given for r in roles.values())]
    if len(kinds) > 1:
        keys = ", ".join(f"data.{key}" for key in given)
        raise DataError(
            f"{keys}: these fields belong to different row formats ({' and '.join(kinds)}); set one"
        )
    for kind in kinds or FORMATS:
        fmt = _fill(kind, given, columns)
        if isinstance(fmt, RowFormat):
            return fmt
        if kinds:
            raise DataError(
                f"data.{fmt.key}: needed for the {kind} format; no default column {list(fmt.defaults)} exists, "
                f"so set it to one of the available columns: {', '.join(columns)}"
            )
    raise DataError(
        f"data: cannot tell the row format from the columns {', '.join(columns) or '(none)'}; name the column "
        f"with one of {', '.join(f'data.{key}' for key in FIELD_KEYS)}"
    )


def main_column(fmt: RowFormat) -> tuple[str, str]:
    """The setting that names a format's first column (``data.messages_field``, ...) and that column's name."""
    role, column = next(iter(fmt.columns.items()))
    key = FORMATS[fmt.kind][role].key
    return (f"data.{key}" if key else "data.path", column)
