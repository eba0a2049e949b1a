"""Whitespace trimmed off a text that streams."""

from __future__ import annotations


class Trim:
    """Strips a streamed text's leading and trailing whitespace as it streams: whitespace is
    held until text that is not whitespace follows it (and dropped if none ever does)."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        text = self._pending + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._pending = text[len(body) :]
        self._started = self._started or bool(body)
        return body
