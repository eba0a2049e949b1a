"""A chat choice's output searched for tool calls: content text, and calls streamed as OpenAI
streams them (a call's id and name first, then its arguments in pieces).

With tool_choice "auto" the output is free and the request's parser (--tool-call-parser,
relay.api.tool_parsers) finds calls in it as it streams. A constrained output (tool_choice
"required" or a named function) is JSON the grammar forced: held whole and parsed at the end,
its calls arriving in the last chunks; or, for a parser with a forced-call format of its own,
calls in that format, read by the parser as they stream. With parallel_tool_calls false only the first call is
kept (a forced call's grammar already allows only one).

The whole-response parser is the streaming one fed the whole text, so a streamed response
reassembles to exactly the calls of the whole one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from relay.api.reasoning import Reasoning
from relay.api.text_trim import Trim
from relay.api.tool_calls import NAMED, ToolCalling
from relay.api.tool_parsers import CallArgs, CallName, Event, Thought, make_parser
from relay.api.tool_parsers.harmony import HarmonyParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=new_call_id, compare=False)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's position among its choice's calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    index: int
    text: str


# Content text, a call's start, a piece of its arguments, or reasoning (harmony's analysis).
Piece = str | CallStart | ArgsPiece | Reasoning


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def assemble(pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
    """A choice's content and calls from its pieces."""
    calls: list[ToolCall] = []
    for p in pieces:
        if isinstance(p, CallStart):
            calls.append(ToolCall(p.name, "", p.id))
        elif isinstance(p, ArgsPiece):
            calls[p.index].arguments += p.text
    return "".join(p for p in pieces if isinstance(p, str)), calls


def parse_output(calling: ToolCalling, text: str, finish_reason: str | None) -> ParsedOutput:
    """A whole response: its content, its calls, and its finish reason ("tool_calls" when
    the model ended normally having called tools)."""
    stream = OutputStream(calling)
    pieces = stream.feed(text)
    rest, reason = stream.finish(finish_reason)
    content, calls = assemble(pieces + rest)
    return ParsedOutput(content or None, calls, reason)


class OutputStream:
    """One choice's output, fed as it streams; yields content and calls' pieces (and reasoning,
    for a format that carries it: harmony). An auto output, or a forced one written in the
    parser's own format, streams its content as it comes, holding back only what may start a
    call. calling None: a harmony output of a request without tools (its channels split, no
    calls read)."""

    def __init__(self, calling: ToolCalling | None):
        self.calling = calling
        self._held = ""  # constrained to JSON: the output so far
        if calling is None:
            self._parser = HarmonyParser(calls=False)
        elif calling.constrained and not calling.native_forced:
            self._parser = None
        else:
            self._parser = make_parser(calling.parser, calling.schemas())
        self._trim = Trim()
        self._reasoning = Trim()
        self._calls = 0
        self._dropping = False  # parallel_tool_calls false: a call past the first is being dropped

    def feed(self, text: str) -> list[Piece]:
        if self._parser is None:
            self._held += text
            return []
        return self._pieces(self._parser.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[Piece], str | None]:
        """The pieces still held, and the choice's finish reason."""
        if self._parser is None:
            events = parse_constrained(self.calling, self._held)
            pieces = (
                self._pieces(events) if events is not None else ([self._held] if self._held else [])
            )
        else:
            pieces = self._pieces(self._parser.finish())
        if self._calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return pieces, finish_reason

    def _pieces(self, events: list[Event]) -> list[Piece]:
        out: list[Piece] = []
        for e in events:
            if isinstance(e, CallName):
                self._dropping = self._calls >= 1 and not self.calling.parallel
                if not self._dropping:
                    out.append(CallStart(self._calls, new_call_id(), e.name))
                    self._calls += 1
            elif isinstance(e, CallArgs):
                if not self._dropping and e.text:
                    out.append(ArgsPiece(self._calls - 1, e.text))
            elif isinstance(e, Thought):
                if text := self._reasoning.push(e.text):
                    out.append(Reasoning(text))
            elif text := e if self._parser is None else self._trim.push(e):
                out.append(text)
        return out


def parse_constrained(calling: ToolCalling, text: str) -> list[Event] | None:
    """The calls in a constrained output; None if it does not parse (it was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if calling.mode == NAMED:
        return _call_events(calling.named, value) if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = [_required_call(v) for v in value]
    return None if any(c is None for c in calls) else [e for c in calls for e in c]


def _call_events(name: str, arguments: dict[str, Any]) -> list[Event]:
    # One serialisation for the whole and the streamed response.
    return [CallName(name), CallArgs(json.dumps(arguments, ensure_ascii=False))]


def _required_call(value: Any) -> list[Event] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters")
    return _call_events(value["name"], arguments) if isinstance(arguments, dict) else None
