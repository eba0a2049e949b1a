"""The one table writer: markdown tables of result records, a column per (header, value) pair, so that
every subcommand's table pastes into docs/benchmarks.md as it is printed."""

from __future__ import annotations

from typing import Any

# (header, a record's key or a function of the record[, decimals of a float: 1 unless given])
Column = tuple  # tuple[str, str | Callable[[dict[str, Any]], Any]] or that and an int


def fmt(value: Any, digits: int = 1) -> str:
    """None as an en dash (not measured), floats with thousands separators and `digits` decimals."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def cell(record: dict[str, Any], column: Column) -> str:
    _, value, *digits = column
    return fmt(record.get(value) if isinstance(value, str) else value(record), *digits)


def markdown(records: list[dict[str, Any]], columns: list[Column]) -> str:
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in records]
    return "\n".join(lines)
