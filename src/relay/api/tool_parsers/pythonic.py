"""Pythonic tool calls (Llama 3.2 / Llama 4 and others): the output is a Python list of calls,
`[get_weather(city="Paris"), now()]`, possibly wrapped in `<|python_start|>`...`<|python_end|>`.
An output that does not begin with one is all content, as vLLM's pythonic parser reads it.

Each call is parsed with Python's ast once its closing parenthesis arrives, and only literals
are taken as arguments (ast.literal_eval: strings, numbers, booleans, None, lists, dicts,
tuples); a call with anything else (a name, an expression, positional arguments) is no call,
and it and the rest of the output are content. A call's name and arguments therefore arrive
together, one call at a time.
"""

from __future__ import annotations

import ast
import json
import re

from relay.api.tool_parsers.events import CallArgs, CallName, Event

START, END = "<|python_start|>", "<|python_end|>"
# How the output must begin to be a list of calls: '[' then a (dotted) name and '('.
_OPENING = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_OPENING_SO_FAR = re.compile(r"(\[\s*([A-Za-z_][\w.]*\s*)?)?")


class PythonicParser:
    def __init__(self) -> None:
        self._state = "start"  # start | calls | after_list | content
        self._held = ""
        self._call = ""  # calls: the current call's text
        self._scan = _Brackets()
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            text = getattr(self, f"_on_{self._state}")(text, out)
        return out

    def _on_start(self, text: str, out: list[Event]) -> str:
        self._held += text
        head = self._held.lstrip()
        if head.startswith(START):
            head = head[len(START) :].lstrip()
        elif START.startswith(head):
            return ""
        if _OPENING.match(head):
            self._state, self._held = "calls", ""
            return head[1:]
        if _OPENING_SO_FAR.fullmatch(head):
            return ""  # may still open a list of calls
        self._state = "content"
        held, self._held = self._held, ""
        return held

    def _on_calls(self, text: str, out: list[Event]) -> str:
        if not self._call:
            text = text.lstrip(", \t\r\n")
            if not text:
                return ""
            if text[0] == "]":
                self._state = "after_list"
                return text[1:]
        end = self._scan.end_in(text)
        self._call += text if end < 0 else text[:end]
        if end < 0:
            return ""
        call_text, self._call, self._scan = self._call, "", _Brackets()
        call = _call(call_text)
        if call is None:  # no call: it and the rest of the output are content
            self._state = "content"
            return ("" if self._calls else "[") + call_text + text[end:]
        out += call
        self._calls += 1
        return text[end:]

    def _on_after_list(self, text: str, out: list[Event]) -> str:
        """After the list: whitespace and an end tag are dropped; anything else is content."""
        self._held += text
        head = self._held.lstrip()
        if END.startswith(head):
            return ""
        self._state, self._held = "content", ""
        return head[len(END) :] if head.startswith(END) else head

    def _on_content(self, text: str, out: list[Event]) -> str:
        out.append(text)
        return ""

    def finish(self) -> list[Event]:
        out: list[Event] = [self._held] if self._state == "start" and self._held else []
        self._held, self._call = "", ""
        return out


class _Brackets:
    """Where a call's text ends (its closing parenthesis), fed in pieces: tracks quoted
    strings (single or double quotes, backslash escapes) and bracket depth."""

    def __init__(self) -> None:
        self._depth = 0
        self._quote = ""
        self._escaped = False

    def end_in(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "'\"":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1


def _call(text: str) -> list[Event] | None:
    """`name(key=literal, ...)` as events, or None if it is anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return [
            CallName(name),
            CallArgs(json.dumps(arguments, ensure_ascii=False, allow_nan=False)),
        ]
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None  # a value that is no literal, or not JSON (a set, bytes, a complex number)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
