"""Strictly typed access to a body's fields, shared by every parser: a field that is absent or
JSON null takes its default (many OpenAI clients send explicit nulls for "not set"); types are
strict: a bool is not an int, a numeric string is not a number. A wrong one is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.api.errors import bad, show
from relay.sampling_params import RANGES, Range

_I32 = 2**31


def as_int(value: Any, param: str, lo: int, hi: int, what: str | None = None) -> int:
    return _as(Range(lo, hi, integer=True, what=what), value, param)


def as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad(param, f"'{param}' must be a boolean, got {show(value)}")
    return value


def as_dict(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(param, f"'{param}' must be an object, got {show(value)}")
    return value


def as_token_ids(
    value: Any, param: str, allow_empty: bool, vocab_size: int | None = None
) -> list[int]:
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a list of token ids, got {show(value)}")
    if not value and not allow_empty:
        raise bad(param, f"'{param}' must not be empty")
    limit = vocab_size or _I32
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad(
                param, f"'{param}' must hold token ids (integers >= 0); item {i} is {show(t)}"
            )
        if t >= limit:
            raise bad(
                param, f"'{param}' item {i} is {show(t)}, outside the vocabulary [0, {limit})"
            )
    return value


def opt(body: dict[str, Any], key: str, default: Any, convert: Callable[[Any, str], Any]) -> Any:
    value = body.get(key)
    return default if value is None else convert(value, key)


def priority(body: dict[str, Any]) -> int:
    return opt(body, "priority", 0, lambda v, p: as_int(v, p, -_I32, _I32 - 1))


def _as(rule: Range, value: Any, param: str) -> Any:
    if not rule.holds(value):
        kind = "an integer" if rule.integer else "a number"
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (rule.integer and isinstance(value, float))
        ):
            raise bad(param, f"'{param}' must be {kind}, got {show(value)}")
        raise bad(param, f"'{param}' must be {rule.describe()}, got {show(value)}")
    return float(value) if not rule.integer else value


def ranged(name: str, rule: Range | None = None) -> Callable[[Any, str], Any]:
    rule = rule or RANGES[name]
    return lambda value, param: _as(rule, value, param)
