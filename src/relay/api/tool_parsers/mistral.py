"""Mistral tool calls: text, then `[TOOL_CALLS]` and either a JSON array of
{"name": ..., "arguments": {...}} objects (tokenizers before v11) or, from v11 on, one
`name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]`. Both are what vLLM's mistral
parser reads. `[TOOL_CALLS]` is a special token: requests parsed with this format are
detokenized with skip_special_tokens off so that it reaches the text.
"""

from __future__ import annotations

import re

from relay.api.tool_parsers.events import CallName, Event, partial_suffix
from relay.api.tool_parsers.json_call import JsonCallReader

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class MistralParser:
    def __init__(self) -> None:
        self._state = "text"  # text | after_bot | array | name | args | content
        self._held = ""
        self._call: JsonCallReader | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            text = getattr(self, f"_on_{self._state}")(text, out)
        return out

    def _on_text(self, text: str, out: list[Event]) -> str:
        self._held += text
        start = self._held.find(BOT)
        if start < 0:
            cut = len(self._held) - partial_suffix(self._held, BOT)
            if cut:
                out.append(self._held[:cut])
            self._held = self._held[cut:]
            return ""
        if start:
            out.append(self._held[:start])
        rest, self._held, self._state = self._held[start + len(BOT) :], "", "after_bot"
        return rest

    def _on_after_bot(self, text: str, out: list[Event]) -> str:
        text = (self._held + text).lstrip()
        self._held = ""
        if not text:
            return ""
        if text[0] == "[":
            self._state = "array"
            return text[1:]
        self._state = "name"
        return text

    def _on_array(self, text: str, out: list[Event]) -> str:
        """Call objects separated by ',' up to the array's ']'."""
        if self._call is None:
            text = text.lstrip(", \t\r\n")
            if not text:
                return ""
            if text[0] == "]":
                self._state = "text"
                return text[1:]
            self._call = JsonCallReader()
        call = self._call
        events = call.feed(text)
        out += events if not call.invalid else []
        if not call.done:
            return ""
        self._call = None
        if call.invalid:
            self._state = "content"
            return call.raw + call.rest
        return call.rest

    def _on_name(self, text: str, out: list[Event]) -> str:
        """v11: the name up to [ARGS]."""
        self._held += text
        end = self._held.find(ARGS)
        if end < 0:
            head = self._held[: len(self._held) - partial_suffix(self._held, ARGS)]
            if head and not _NAME.fullmatch(head):
                return self._no_call()
            return ""
        name, rest = self._held[:end].strip(), self._held[end + len(ARGS) :]
        if not _NAME.fullmatch(name):
            return self._no_call()
        out.append(CallName(name))
        self._held, self._state, self._call = "", "args", JsonCallReader()
        self._call.start_at_arguments()
        return rest

    def _no_call(self) -> str:
        self._state = "content"
        held, self._held = BOT + self._held, ""
        return held

    def _on_args(self, text: str, out: list[Event]) -> str:
        call = self._call
        out += call.feed(text)
        if not call.done:
            return ""
        self._call, self._state = None, "text"
        return call.rest

    def _on_content(self, text: str, out: list[Event]) -> str:
        out.append(text)
        return ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._call is not None:
            self._call.finish()
            if self._call.invalid and self._state == "array":
                out.append(self._call.raw)
            self._call = None
        if self._state == "name":
            out.append(BOT + self._held)
        elif self._held and self._state in ("text", "after_bot"):
            out.append(self._held if self._state == "text" else BOT + self._held)
        self._held = ""
        return out
