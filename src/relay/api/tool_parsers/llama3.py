"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
(several separated by ';'), possibly after `<|python_tag|>`. An output that does not begin with
a call object is all content, as vLLM's llama3_json parser reads it.
"""

from __future__ import annotations

from relay.api.tool_parsers.events import Event
from relay.api.tool_parsers.json_call import JsonCallReader

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser:
    def __init__(self) -> None:
        self._state = "start"  # start | calls | content
        self._held = ""  # start: the output so far; calls: text between objects
        self._call: JsonCallReader | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            text = getattr(self, f"_on_{self._state}")(text, out)
        return out

    def _on_start(self, text: str, out: list[Event]) -> str:
        """Decide once the output shows whether it opens with a call object."""
        self._held += text
        head = self._held.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(head):
            return ""  # nothing yet, or the tag arriving
        if not head:
            return ""
        if head[0] != "{":
            self._state = "content"
            held, self._held = self._held, ""
            return held
        self._state, self._held = "calls", ""
        return head

    def _on_calls(self, text: str, out: list[Event]) -> str:
        if self._call is None:
            text = (self._held + text).lstrip("; \t\r\n")
            self._held = ""
            if not text:
                return ""
            if text[0] != "{":  # text after the calls: content from here on
                self._state = "content"
                return text
            self._call = JsonCallReader()
        call = self._call
        events = call.feed(text)
        if not call.done:
            out += events
            return ""
        self._call = None
        if call.invalid:
            self._state = "content"
            return call.raw + call.rest
        out += events
        return call.rest

    def _on_content(self, text: str, out: list[Event]) -> str:
        out.append(text)
        return ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._call is not None:
            self._call.finish()
            if self._call.invalid:
                out.append(self._call.raw)
            self._call = None
        if self._state == "start" and self._held:
            out.append(self._held)
        self._held = ""
        return out
