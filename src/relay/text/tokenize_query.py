"""What /tokenize and /detokenize ask the tokenizer process (relay.api.tokenization parses it from a
body; ipc.messages.TokenizeCall carries it there with the call's id)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenizeQuery:
    """kind "tokenize" (text, or chat messages through the template) or "detokenize" (tokens)."""

    kind: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tokens: list[int] | None = None
