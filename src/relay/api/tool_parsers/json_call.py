"""One `{"name": <string>, "arguments": <object>}` call object (or "parameters"), read as it
streams: its name as soon as the name and the arguments key are read, then the arguments
object's text as it arrives, exactly as the model wrote it from its '{' to its '}'.

An object in another order (arguments first), or arguments that are not an object (a JSON
string holding the object, as some fine-tunes write), is held until it closes and parsed
whole; one that is no call at all comes back as its text for the caller to treat as content.
"""

from __future__ import annotations

import json

import regex

from relay.api.tool_parsers.events import CallArgs, CallName, Event

# The head of a call object up to its arguments' value: matched on a prefix of the text, and
# (partial=True) to tell "may still become one" from "is not one".
_HEAD = regex.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9A-Fa-f]{4}))*)"\s*,'
    r'\s*"(?:arguments|parameters)"\s*:'
)


class JsonDepth:
    """Where a JSON value's text ends, fed in pieces: tracks strings and bracket depth."""

    def __init__(self, depth: int = 0):
        self.depth = depth
        self._in_string = False
        self._escaped = False
        self.started = False

    def end_in(self, text: str) -> int:
        """The index just past the character of text that closes the value; -1 if none does."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self.depth == 0:
                        return i + 1  # a bare string value ends here
                continue
            if ch == '"':
                self._in_string, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1


class JsonCallReader:
    """Feed text until `done`; `rest` is then the text after the object. `invalid` (with
    `raw`: all the text it took) when the object was no call."""

    def __init__(self) -> None:
        self.raw = ""  # everything taken so far, for an object that turns out to be no call
        self._head_text = ""
        self._state = "head"  # head | before_args | args | value | tail | whole
        self._depth: JsonDepth | None = None
        self.named = False  # a CallName was yielded: this is a call whatever follows
        self.done = False
        self.invalid = False
        self.rest = ""
        self._args_only = False

    def start_at_arguments(self) -> None:
        """Read only an arguments value (its call named by the caller): done when it ends."""
        self._state, self.named, self._args_only = "before_args", True, True

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        out: list[Event] = []
        while text and not self.done:
            text = getattr(self, f"_on_{self._state}")(text, out)
        if self.done:
            self.raw = self.raw[: len(self.raw) - len(text)]
            self.rest = text
        return out

    def _on_head(self, text: str, out: list[Event]) -> str:
        self._head_text += text
        m = _HEAD.match(self._head_text)
        if m is not None:
            out.append(CallName(json.loads(f'"{m.group(1)}"')))
            self.named, self._state = True, "before_args"
            return self._head_text[m.end() :]
        if _HEAD.match(self._head_text, partial=True) is None:
            self._state, self._depth = "whole", JsonDepth()
            held, self._head_text = self._head_text, ""
            return held
        return ""

    def _on_before_args(self, text: str, out: list[Event]) -> str:
        text = text.lstrip()
        if not text:
            return ""
        self._depth = JsonDepth()
        if text[0] == "{":
            self._state = "args"
        else:  # a string (or other value): held until it ends, then given whole
            self._state, self._value_text = "value", ""
        return text

    def _on_args(self, text: str, out: list[Event]) -> str:
        end = self._depth.end_in(text)
        piece = text if end < 0 else text[:end]
        if piece:
            out.append(CallArgs(piece))
        if end < 0:
            return ""
        return self._arguments_end(text[end:])

    def _arguments_end(self, rest: str) -> str:
        self._state, self._depth = "tail", JsonDepth(1)
        self.done = self._args_only
        return rest

    def _on_value(self, text: str, out: list[Event]) -> str:
        end = self._depth.end_in(text)
        self._value_text += text if end < 0 else text[:end]
        if end < 0:
            return ""
        out.append(CallArgs(_arguments_text(self._value_text)))
        return self._arguments_end(text[end:])

    def _on_tail(self, text: str, out: list[Event]) -> str:
        """The rest of the call object after its arguments, up to its closing brace."""
        end = self._depth.end_in(text)
        if end < 0:
            return ""
        self.done = True
        return text[end:]

    def _on_whole(self, text: str, out: list[Event]) -> str:
        end = self._depth.end_in(text)
        if end < 0:
            return ""
        self.done = True
        call = _call(self.raw[: len(self.raw) - len(text) + end])
        if call is None:
            self.invalid = True
        else:
            out += call
        return text[end:]

    def finish(self) -> None:
        """The output ended inside the object: a call already named stays (its arguments cut
        short); anything else is no call."""
        if not self.named:
            self.invalid = True


def _arguments_text(value_text: str) -> str:
    """Arguments given as a JSON string holding the object: the object's text."""
    try:
        value = json.loads(value_text)
    except ValueError:
        return value_text
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(text: str) -> list[Event] | None:
    """A whole call object's events, or None if it is no call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # a model that wrote the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return [CallName(value["name"]), CallArgs(json.dumps(arguments, ensure_ascii=False))]
