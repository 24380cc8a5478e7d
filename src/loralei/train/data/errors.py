"""The error the data pipeline raises for bad data settings or unusable data."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...errors import ConfigError, did_you_mean


class DataError(ConfigError):
    """The dataset, a data field, the chat template or a packing setting cannot be used as configured."""


def missing_column_error(key: str, column: str, columns: Iterable[str]) -> DataError:
    """Builds the error for a configured field that names no column of the data.

    Args:
        key: the setting that named the column, e.g. ``"messages_field"``.
        column: the column name it gave.
        columns: the columns the data has.

    Returns:
        A DataError naming the setting, the value, the closest column and every available column.
    """
    available = sorted(columns)
    return DataError(
        f"data.{key}: column {column!r} is not in the data{did_you_mean(column, available)}; "
        f"available columns: {', '.join(available) or '(none)'}"
    )


def check_max_seq_length(max_seq_length: Any) -> None:
    """Checks ``training.max_seq_length``: an integer >= 2 (bools are not integers here).

    Raises:
        DataError: naming the key and the value.
    """
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 2:
        raise DataError(
            f"training.max_seq_length: must be an integer >= 2, got {max_seq_length!r} (a sample needs a prompt "
            "token and a trained token)"
        )
