"""The error the data pipeline raises for bad data settings or unusable data."""

from __future__ import annotations

from collections.abc import Iterable

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
