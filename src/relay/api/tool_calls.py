"""OpenAI tool calls on /v1/chat/completions: the `tools`, `tool_choice` and
`parallel_tool_calls` fields, and the output constraint that forces a call. The output side
(turning a model's text into calls) is relay.api.tool_output, over relay.api.tool_parsers.

How each tool_choice is served:
- "none": the tools are ignored entirely; they are not rendered into the prompt and the output
  is not searched for calls (a model shown tools tends to call them anyway).
- "auto" (the default when tools are given): the tools reach the chat template, the output is
  free, and the server's tool-call parser (--tool-call-parser, relay.api.tool_parsers)
  finds calls in it; the rest, stripped, is the content.
- "required": the output is constrained to a JSON array of one or more
  {"name": <a tool's name>, "parameters": <its arguments>} objects (exactly one with
  parallel_tool_calls false).
- a named function: the output is constrained to that function's parameters schema; the
  output is the call's arguments.
  A parser with a format of its own for forced calls (qwen3_coder, deepseek_v3 / _v31,
  harmony: tool_parsers.FORCED_CALL_FORMATS) constrains both to calls written in that format
  instead (a structural tag), and reads them with the parser as it would an "auto" output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from relay.api.errors import bad, show
from relay.api.tool_parsers import FORCED_CALL_FORMATS
from relay.api.typed_fields import as_dict

MAX_TOOLS = 128  # OpenAI's limit
AUTO, REQUIRED, NAMED = "auto", "required", "named"
# OpenAI allows [a-zA-Z0-9_-]; dots and colons are common in namespaced (MCP) tool names.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# msgpack's integer range: a larger one in a schema could not reach the tokenizer process.
_WIRE_INT = (-(2**63), 2**64)


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
    parser: str = "hermes"  # the output format calls are read in (relay.api.tool_parsers)
    parallel: bool = True  # parallel_tool_calls: false keeps at most one call

    @property
    def constrained(self) -> bool:
        return self.mode != AUTO

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match; None when it is free (auto)."""
        if self.mode == NAMED:
            return self._tool(self.named).arguments_schema
        if self.mode == REQUIRED:
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "parameters": t.arguments_schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            array = {
                "type": "array",
                "minItems": 1,
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            }
            return array if self.parallel else {**array, "maxItems": 1}
        return None

    @property
    def native_forced(self) -> bool:
        """A forced call is written in the parser's own format (structural_tag), not as JSON."""
        return self.constrained and self.parser in FORCED_CALL_FORMATS

    def structural_tag(self) -> str:
        """The xgrammar structural tag (JSON text) of a forced call in the parser's format."""
        tools = [(t.name, t.arguments_schema) for t in self.tools]
        named = self.named if self.mode == NAMED else None
        fmt = FORCED_CALL_FORMATS[self.parser](tools, named, self.parallel)
        return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)

    def schemas(self) -> dict[str, Any]:
        """Each tool's parameters schema, by name (for parsers that convert arguments by it)."""
        return {t.name: t.arguments_schema for t in self.tools}

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


def parse_tool_calling(body: dict[str, Any], parser: str = "hermes") -> ToolCalling | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`; None when no tool may be called (none
    given, or "none"). parser: the server's --tool-call-parser."""
    tools = _tools(body.get("tools"))
    mode, named = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(
            "parallel_tool_calls", f"'parallel_tool_calls' must be a boolean, got {show(parallel)}"
        )
    if mode == "none" or not tools:
        return None
    return ToolCalling(tuple(tools), mode, named, parser, parallel is not False)


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
            raise bad(
                f"tools.{i}.function.name",
                f"'tools.{i}.function.name' repeats the tool name {tool.name!r}",
            )
        tools.append(tool)
    return tools


def _tool(item: Any, param: str) -> Tool:
    item = as_dict(item, param)
    if item.get("type") != "function":
        raise bad(
            f"{param}.type", f"'{param}.type' must be \"function\", got {show(item.get('type'))}"
        )
    function = as_dict(item.get("function"), f"{param}.function")
    name = _function_name(function.get("name"), f"{param}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(
            f"{param}.function.description",
            f"'{param}.function.description' must be a string, got {show(description)}",
        )
    parameters = function.get("parameters")
    if parameters is not None:
        as_dict(parameters, f"{param}.function.parameters")
        _check_wire_ints(parameters, f"{param}.function.parameters")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise bad(f"{param}.function.strict", f"'{param}.function.strict' must be a boolean")
    return Tool(name, description, parameters)


def _function_name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise bad(
            param,
            f"'{param}' must be 1 to 64 letters, digits, '_', '-', '.' or ':', got {show(value)}",
        )
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
        raise bad(
            "tool_choice",
            '\'tool_choice\' must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {show(value)}',
        )
    function = as_dict(value.get("function"), "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not any(t.name == name for t in tools):
        raise bad(
            "tool_choice.function.name",
            f"'tool_choice.function.name' must name one of 'tools', got {show(name)}",
        )
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
            raise bad(
                f"{param}.{j}.function.name",
                f"'{param}.{j}.function.name' must be a non-empty string, got {show(name)}",
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            parsed = _json_object(arguments)
            arguments = arguments if parsed is None else parsed
        elif not isinstance(arguments, dict):
            raise bad(
                f"{param}.{j}.function.arguments",
                f"'{param}.{j}.function.arguments' must be a JSON string, got {show(arguments)}",
            )
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
