"""Input tables (the CSVs of measured or published throughputs that harness.simulate and
harness.report read), read strictly and checked before anything is computed from them.

Every problem is a `ConfigError` of one line naming the file (`where`), the row, the
column and the value as the file has it (plain numbers and names: never a library's
repr), and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from harness.config.schema import ConfigError, first_line

MAX_GPUS = 1_000_000  # a GPU count past any cluster: a typo, or a number in the wrong column


def read_csv(path: str | Path) -> pd.DataFrame:
    """`path` as a table, every field under its header's column: a row with more fields
    than the header is a ValueError (pandas would silently make its first column an
    index and shift every name one column to the left)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.ParserWarning)
        try:
            return pd.read_csv(path, index_col=False)
        except pd.errors.ParserWarning:
            raise ValueError("a row has more fields than the header has columns") from None


def shown(value: object) -> str:
    """A cell as the user wrote it: a number plainly, text quoted, an empty cell so named."""
    if value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA:
        return "an empty value"  # pandas reads NaN, NA and null as empty too
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"{float(value):g}"
    return repr(str(value))


def read_table(where: str, path: str, *, read: Callable[[str], pd.DataFrame],
               columns: list[str], numeric: list[str], whole: Sequence[str] = ()
               ) -> pd.DataFrame:
    """`read(path)`, a table with `columns`, no empty cell in them, and rows whose `numeric`
    columns are positive, finite numbers (whole numbers up to MAX_GPUS in `whole`); else
    ConfigError naming `where`, the row (1 = the first under the header) and the problem."""
    fix = f"give a CSV with columns {', '.join(columns)} or a folder of measured results"
    try:
        table = read(path)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; {fix}") from None
    except (OSError, ValueError) as exc:  # parser and decode errors are ValueErrors
        raise ConfigError(f"{where} is unreadable ({first_line(exc, type(exc).__name__)}); "
                          f"{fix}") from None
    missing = [c for c in columns if c not in table.columns]
    if missing or table.empty:
        what = f"lacks columns {', '.join(missing)}" if missing else "has no rows"
        raise ConfigError(f"{where} {what}; {fix}")
    for col in columns:
        _check_column(where, table, col, numeric=col in numeric, whole=col in whole)
    return table


def _check_column(where: str, table: pd.DataFrame, col: str, *, numeric: bool,
                  whole: bool) -> None:
    """Check (and for `numeric`, convert) one column of `table` in place."""
    empty = table[col].isna().to_numpy()
    if empty.any():
        raise ConfigError(f"{where}: column {col} has an empty value (row {empty.argmax() + 1});"
                          " fill it in or drop the row")
    if not numeric:
        return
    values = pd.to_numeric(table[col], errors="coerce")
    bad = values.isna().to_numpy()
    if bad.any():
        raise ConfigError(f"{where}: column {col} has non-numeric value "
                          f"{shown(table[col][bad].iloc[0])} (row {bad.argmax() + 1}); fix it")
    numbers = values.to_numpy(dtype=float)
    bad = ~(numbers > 0) | ~np.isfinite(numbers)
    need = "a positive, finite number"
    if whole:
        bad |= (numbers % 1 != 0) | (numbers > MAX_GPUS)
        need = f"a positive whole number up to {MAX_GPUS}"
    if bad.any():
        raise ConfigError(f"{where}: column {col} has value {shown(numbers[bad][0])} "
                          f"(row {bad.argmax() + 1}); it must be {need}")
    table[col] = values


def duplicate(table: pd.DataFrame, key: list[str], *, where: str, first_row: int,
              unit: str = "row") -> str | None:
    """The message for the first set of rows of `table` with the same `key` (None: none):
    `where` and those rows (numbered from `first_row`, as `unit`s: "row" or "line"), and
    the key's values."""
    twice = table.duplicated(key, keep=False).to_numpy()
    if not twice.any():
        return None
    group = table.groupby(key, dropna=False, sort=False).ngroup().to_numpy()
    same = group == group[twice.argmax()]  # empty cells alike, as `duplicated` has them
    first = table.iloc[twice.argmax()]
    rows = [str(i + first_row) for i in np.flatnonzero(same)]
    listed = (", ".join(rows[:-1]) + " and " + rows[-1]) if len(rows) < 6 else \
        ", ".join(rows[:5]) + f" and {len(rows) - 5} more"
    cell = ", ".join(f"{k} {'(empty)' if pd.isna(first[k]) else shown(first[k]).strip(chr(39))}"
                     for k in key)
    return f"{where} has {len(rows)} rows for one cell ({cell}): {unit}s {listed}; keep one"
