"""OpenAI tool calls on /v1/chat/completions: the `tools` and `tool_choice` fields, the
output constraint that forces a call, and the parsers that turn a model's text into calls.

How each tool_choice is served:
- "none": the tools are ignored entirely; they are not rendered into the prompt and the output
  is not searched for calls (a model shown tools tends to call them anyway).
- "auto" (the default when tools are given): the tools reach the chat template, the output is
  free, and Qwen2/Qwen3/Hermes-style blocks (`<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`) in it become calls; the rest, stripped, is the content.
- "required": the output is constrained to a JSON array of one or more
  {"name": <a tool's name>, "parameters": <its arguments>} objects.
- a named function: the output is constrained to that function's parameters schema; the
  output is the call's arguments.

Every parser here is pure: the whole-response parser is the streaming one fed the whole text,
so a streamed response reassembles to exactly the calls of the whole one.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from relay.api.fields import as_dict, bad, show

MAX_TOOLS = 128  # OpenAI's limit
AUTO, REQUIRED, NAMED = "auto", "required", "named"
# OpenAI allows [a-zA-Z0-9_-]; dots and colons are common in namespaced (MCP) tool names.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# msgpack's integer range: a larger one in a schema could not reach the tokenizer process.
_WIRE_INT = (-2**63, 2**64)


# ---- the request's tools -----------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else ANY_OBJECT

    def for_template(self) -> dict[str, Any]:
        """The OpenAI shape HF chat templates expect in their `tools` variable."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how it wants them used (never tool_choice "none": see module doc)."""
    tools: tuple[Tool, ...]
    mode: str  # AUTO | REQUIRED | NAMED
    named: str | None = None  # NAMED: the function that must be called

    @property
    def constrained(self) -> bool:
        return self.mode != AUTO

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match; None when it is free (auto)."""
        if self.mode == NAMED:
            return self._tool(self.named).arguments_schema
        if self.mode == REQUIRED:
            calls = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.arguments_schema},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return None

    def schema_param(self) -> str:
        """The API field a schema the grammar compiler refuses came from."""
        if self.mode == NAMED:
            return f"tools.{self._index(self.named)}.function.parameters"
        return "tools"

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.for_template() for t in self.tools]

    def _index(self, name: str | None) -> int:
        return next(i for i, t in enumerate(self.tools) if t.name == name)

    def _tool(self, name: str | None) -> Tool:
        return self.tools[self._index(name)]


def parse_tool_calling(body: dict[str, Any]) -> ToolCalling | None:
    """`tools` and `tool_choice`; None when no tool may be called (none given, or "none")."""
    tools = _tools(body.get("tools"))
    mode, named = _tool_choice(body.get("tool_choice"), tools)
    if mode == "none" or not tools:
        return None
    return ToolCalling(tuple(tools), mode, named)


def _tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", f"'tools' must be a list of tools, got {show(value)}")
    if len(value) > MAX_TOOLS:
        raise bad("tools", f"'tools' allows at most {MAX_TOOLS} tools, got {len(value)}")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        tool = _tool(item, f"tools.{i}")
        if any(t.name == tool.name for t in tools):
            raise bad(f"tools.{i}.function.name", f"'tools.{i}.function.name' repeats the tool name {tool.name!r}")
        tools.append(tool)
    return tools


def _tool(item: Any, param: str) -> Tool:
    item = as_dict(item, param)
    if item.get("type") != "function":
        raise bad(f"{param}.type", f"'{param}.type' must be \"function\", got {show(item.get('type'))}")
    function = as_dict(item.get("function"), f"{param}.function")
    name = _function_name(function.get("name"), f"{param}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{param}.function.description", f"'{param}.function.description' must be a string, "
                                                   f"got {show(description)}")
    parameters = function.get("parameters")
    if parameters is not None:
        as_dict(parameters, f"{param}.function.parameters")
        _check_wire_ints(parameters, f"{param}.function.parameters")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise bad(f"{param}.function.strict", f"'{param}.function.strict' must be a boolean")
    return Tool(name, description, parameters)


def _function_name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise bad(param, f"'{param}' must be 1 to 64 letters, digits, '_', '-', '.' or ':', got {show(value)}")
    return value


def _check_wire_ints(value: Any, param: str) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, int) and not _WIRE_INT[0] <= v < _WIRE_INT[1]:
            raise bad(param, f"'{param}' holds an integer too large for this server: {show(v)}")


def _tool_choice(value: Any, tools: list[Tool]) -> tuple[str, str | None]:
    """(mode, named function): mode is "none", AUTO, REQUIRED or NAMED."""
    if value is None:
        return (AUTO if tools else "none"), None
    if value in ("none", AUTO, REQUIRED):
        if value == REQUIRED and not tools:
            raise bad("tool_choice", "'tool_choice' \"required\" needs 'tools'")
        return value, None
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                 f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {show(value)}")
    function = as_dict(value.get("function"), "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not any(t.name == name for t in tools):
        raise bad("tool_choice.function.name", f"'tool_choice.function.name' must name one of 'tools', "
                                               f"got {show(name)}")
    return NAMED, name


def template_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` in the shape HF chat templates render: arguments
    as a dict where they are a JSON object (templates write `arguments | tojson`, which would
    quote a string a second time); anything else stays the string it was."""
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a list of tool calls, got {show(value)}")
    calls = []
    for j, call in enumerate(value):
        call = as_dict(call, f"{param}.{j}")
        function = as_dict(call.get("function"), f"{param}.{j}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{param}.{j}.function.name", f"'{param}.{j}.function.name' must be a non-empty string, "
                                                    f"got {show(name)}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            parsed = _json_object(arguments)
            arguments = arguments if parsed is None else parsed
        elif not isinstance(arguments, dict):
            raise bad(f"{param}.{j}.function.arguments", f"'{param}.{j}.function.arguments' must be a JSON "
                                                         f"string, got {show(arguments)}")
        out = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---- the model's output ------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=new_call_id, compare=False)

    @classmethod
    def of(cls, name: str, arguments: dict[str, Any]) -> "ToolCall":
        # One serialisation for every path, so streamed and whole responses agree.
        return cls(name, json.dumps(arguments, ensure_ascii=False))

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class StreamedCall:
    index: int  # the call's position among its choice's calls
    call: ToolCall


Piece = str | StreamedCall  # content text, or a complete call


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def parse_output(calling: ToolCalling, text: str, finish_reason: str | None) -> ParsedOutput:
    """A whole response: its content, its calls, and its finish reason ("tool_calls" when
    the model ended normally having called tools)."""
    stream = OutputStream(calling)
    pieces = stream.feed(text)
    rest, reason = stream.finish(finish_reason)
    pieces += rest
    content = "".join(p for p in pieces if isinstance(p, str))
    return ParsedOutput(content or None, [p.call for p in pieces if isinstance(p, StreamedCall)], reason)


class OutputStream:
    """One choice's output, fed as it streams; yields content and complete calls.

    A constrained (required / named) output is held whole and parsed at the end: its calls
    arrive in the last chunk, as deltas the openai client reassembles. An auto output streams
    its content as it comes, holding back only what may be the start of a <tool_call> block."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self._held = ""  # constrained: the output so far
        self._tags = TaggedCallParser()
        self._trim = _Trim()
        self._calls = 0

    def feed(self, text: str) -> list[Piece]:
        if self.calling.constrained:
            self._held += text
            return []
        return self._number(self._tags.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[Piece], str | None]:
        """The pieces still held, and the choice's finish reason."""
        if self.calling.constrained:
            calls = parse_constrained(self.calling, self._held)
            pieces = self._number(calls) if calls is not None else ([self._held] if self._held else [])
        else:
            pieces = self._number(self._tags.finish())
        if self._calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return pieces, finish_reason

    def _number(self, pieces: list[str | ToolCall]) -> list[Piece]:
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, ToolCall):
                out.append(StreamedCall(self._calls, p))
                self._calls += 1
            elif (text := p if self.calling.constrained else self._trim.push(p)):
                out.append(text)
        return out


class _Trim:
    """Strips a streamed text's leading and trailing whitespace as it streams: whitespace is
    held until text that is not whitespace follows it."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        text = self._pending + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._pending = text[len(body):]
        self._started = self._started or bool(body)
        return body


def parse_constrained(calling: ToolCalling, text: str) -> list[ToolCall] | None:
    """The calls in a constrained output; None if it does not parse (it was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if calling.mode == NAMED:
        return [ToolCall.of(calling.named, value)] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = [_required_call(v) for v in value]
    return None if any(c is None for c in calls) else calls


def _required_call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters")
    return ToolCall.of(value["name"], arguments) if isinstance(arguments, dict) else None


class TaggedCallParser:
    """Finds `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in a text fed in
    pieces. Text outside blocks comes out as soon as it cannot be the start of one; a block
    that does not hold a valid call comes out as text, tags and all."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False  # an open tag was read; the buffer holds the block after it

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    return out
                inner, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG):]
                self._inside = False
                call = _tagged_call(inner)
                out.append(call if call is not None else OPEN_TAG + inner + CLOSE_TAG)
            else:
                start = self._buffer.find(OPEN_TAG)
                if start < 0:
                    cut = len(self._buffer) - _partial_tag(self._buffer)
                    ready, self._buffer = self._buffer[:cut], self._buffer[cut:]
                    return out + ([ready] if ready else [])
                if start:
                    out.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN_TAG):]
                self._inside = True

    def finish(self) -> list[str | ToolCall]:
        """What is left at the end: an unclosed block, or a tail that looked like a tag, as text."""
        rest = (OPEN_TAG if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        return [rest] if rest else []


def _partial_tag(text: str) -> int:
    """The length of the longest end of text that is a proper prefix of the open tag."""
    for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


def _tagged_call(inner: str) -> ToolCall | None:
    try:
        value = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    # Most templates say "arguments"; some fine-tunes write "parameters".
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # a model that wrote the arguments as JSON text
        arguments = _json_object(arguments)
    return ToolCall.of(value["name"], arguments) if isinstance(arguments, dict) else None
