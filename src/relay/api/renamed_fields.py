"""An error about a chat completions field, reported under the name the client sent it by.

The Responses and Messages routes translate their bodies into a chat completions body and let
relay.api.chat parse it (one parser, one set of rules); a refusal then names a chat field
(`max_completion_tokens`, `tools.0.function.parameters`), which each route maps back to its
own (`max_output_tokens`, `tools[0].parameters`) with a table of patterns.
"""

from __future__ import annotations

import re

from relay.api.errors import ProtocolError

Renames = list[tuple[re.Pattern[str], str]]


def renames(table: list[tuple[str, str]]) -> Renames:
    """(regex over the chat field's whole name, replacement) pairs, tried in order."""
    return [(re.compile(pattern), replacement) for pattern, replacement in table]


def rename(param: str | None, table: Renames) -> str | None:
    if param is None:
        return None
    for pattern, replacement in table:
        if pattern.fullmatch(param):
            return pattern.sub(replacement, param)
    return param


def renamed(e: ProtocolError, table: Renames) -> ProtocolError:
    """e naming the client's field, in its param and where its message quotes the field."""
    param = rename(e.param, table)
    message = e.message
    if param != e.param:
        message = message.replace(f"'{e.param}'", f"'{param}'")
    return ProtocolError(e.status, message, param, e.type)


def renamed_params(names: dict[str, str], table: Renames) -> dict[str, str]:
    """A request's SamplingParams field -> API field map with the client's names (errors found
    past the http process, such as a schema the grammar compiler refuses, use it)."""
    return {field: rename(param, table) or param for field, param in names.items()}
