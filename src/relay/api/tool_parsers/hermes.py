"""Hermes / Qwen2 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks anywhere in the text; the text outside them is the content.

Text outside blocks comes out as soon as it cannot be the start of an open tag; a block that
holds no call comes out as text, tags and all.
"""

from __future__ import annotations

from relay.api.tool_parsers.events import Event, partial_suffix
from relay.api.tool_parsers.json_call import JsonCallReader

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class HermesParser:
    def __init__(self) -> None:
        self._text = ""  # outside a block: text held as it may start a tag
        self._call: JsonCallReader | None = None  # inside a block
        self._skipping = False  # after a block's call object: what is left of the block is dropped
        self._closing = ""  # the end of that text, held as it may start the close tag

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            if self._call is not None:
                text = self._in_block(text, out)
            elif self._skipping:
                text = self._skip_to_close(text)
            else:
                text = self._outside(text, out)
        return out

    def _outside(self, text: str, out: list[Event]) -> str:
        self._text += text
        start = self._text.find(OPEN_TAG)
        if start < 0:
            cut = len(self._text) - partial_suffix(self._text, OPEN_TAG)
            if cut:
                out.append(self._text[:cut])
            self._text = self._text[cut:]
            return ""
        if start:
            out.append(self._text[:start])
        rest, self._text = self._text[start + len(OPEN_TAG) :], ""
        self._call = JsonCallReader()
        return rest

    def _in_block(self, text: str, out: list[Event]) -> str:
        call = self._call
        events = call.feed(text)
        if not call.done:
            out += events
            return ""
        self._call = None
        if call.invalid:  # no call: the tag and what followed it are text
            out.append(OPEN_TAG + call.raw)
            return call.rest
        out += events
        self._skipping = True
        return call.rest

    def _skip_to_close(self, text: str) -> str:
        self._closing += text
        end = self._closing.find(CLOSE_TAG)
        if end < 0:
            self._closing = self._closing[
                len(self._closing) - partial_suffix(self._closing, CLOSE_TAG) :
            ]
            return ""
        rest, self._closing, self._skipping = self._closing[end + len(CLOSE_TAG) :], "", False
        return rest

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._call is not None:
            self._call.finish()
            if self._call.invalid:
                out.append(OPEN_TAG + self._call.raw)
            self._call = None
        if self._text:
            out.append(self._text)
            self._text = ""
        self._closing, self._skipping = "", False
        return out
