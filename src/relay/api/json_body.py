"""A request body decoded as JSON, refusing (400) what would break later stages."""

from __future__ import annotations

import json
from typing import Any

from relay.api.errors import bad

# Real bodies nest a few levels (a JSON schema a dozen); deeper ones are attacks on parsers.
MAX_JSON_DEPTH = 64


def decode_json_body(raw: bytes) -> Any:
    """A request body as JSON, refusing (400) what would break later stages: invalid UTF-8,
    nesting deeper than MAX_JSON_DEPTH, strings that are not valid Unicode (JSON lets a
    lone surrogate like "\\ud800" through; no encoder downstream accepts it) and integers the
    wire cannot carry."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(None, "the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer of over 4,300 digits
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json_tree(body)
    return body


# Integers the wire (msgpack) carries: a JSON number outside them, in a field passed through
# whole (chat_template_kwargs, a tool's schema), failed the request's encoding with a 500.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


def _check_json_tree(body: Any) -> None:
    """Iteratively (no recursion to exhaust): depth, Unicode validity of every string, and every
    integer within what the wire carries."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _is_valid_unicode(value):
                raise bad(
                    path or None, f"'{path or 'body'}' is not valid Unicode (a lone surrogate?)"
                )
            continue
        if isinstance(value, int) and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
            raise bad(path or None, f"'{path or 'body'}' is an integer outside the 64-bit range")
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad(path or None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str) and not _is_valid_unicode(key):
                raise bad(path or None, f"a key in '{path or 'body'}' is not valid Unicode")
            stack.append((child, (f"{path}.{key}" if path else str(key))[:200], depth + 1))


def _is_valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    return body
