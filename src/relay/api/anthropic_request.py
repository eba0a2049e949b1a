"""POST /v1/messages' body (Anthropic's Messages API), read as the chat completions request
it amounts to, and parsed by relay.api.chat.parse_chat: templates, tool grammars, the reasoning
parser are the chat route's own. A refusal names the Anthropic field, in Anthropic's dotted
path form (`messages.1.content.0.tool_use_id`).

Translated:
- system (a string or text blocks) -> a system message;
- user content: text blocks -> the user message; tool_result blocks -> tool messages before it
  (an is_error result's text is prefixed "Error: ", which chat templates cannot mark);
- assistant content: text, and tool_use blocks -> the turn's tool calls; thinking and
  redacted_thinking blocks are dropped (templates drop earlier turns' reasoning);
- tools {name, description, input_schema} -> function tools; tool_choice auto / any / tool /
  none -> "auto" / "required" / the named function / "none"; disable_parallel_tool_use ->
  parallel_tool_calls false;
- max_tokens (required), stop_sequences, temperature (0 to 1), top_p, top_k, stream, and
  chat's extra sampling fields (min_p, seed, ignore_eos, ...);
- output_config.format {"type": "json_schema", "schema"} -> response_format (structured
  output through the grammar, as chat's);
- thinking {"type": "disabled"} -> chat_template_kwargs enable_thinking false (the model's
  template closes the block: no reasoning); "enabled" reasons as the model does by default,
  budget_tokens not enforced.
Images, documents and server tools are refused.
"""

from __future__ import annotations

import json
from typing import Any

from relay.api.chat import parse_chat
from relay.api.errors import ProtocolError, bad, show
from relay.api.json_body import require_object
from relay.api.openai_common import SAMPLING_KEYS
from relay.api.parsed_request import ParsedRequest
from relay.api.renamed_fields import renamed, renamed_params, renames
from relay.api.typed_fields import as_bool, as_dict, opt, ranged
from relay.sampling_params import Range

_RENAMES = renames(
    [
        (r"stop", "stop_sequences"),
        (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
        (r"tools\.(\d+)\.function\.(\w+)", r"tools.\1.\2"),
        (r"tools\.(\d+)\.function", r"tools.\1"),
        (r"tool_choice\.function\.name", "tool_choice.name"),
        (r"tool_choice.*", "tool_choice"),
        (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
        (r"response_format\.json_schema\.schema", "output_config.format.schema"),
        (r"response_format.*", "output_config.format"),
        (r"messages.*", "messages"),
    ]
)
_TEMPERATURE = ranged("temperature", Range(0, 1))  # Anthropic's range
# Passed to the chat parser as they are: Anthropic's sampling fields, and the vendor extras
# (min_p, seed, ignore_eos, ...) a client sends in extra_body, as on chat completions.
# `stop` is Anthropic's stop_sequences.
_PASSED = (
    "model",
    "stream",
    "priority",
    "chat_template_kwargs",
    *(key for key in SAMPLING_KEYS if key != "stop"),
)


def parse_anthropic(
    body: Any,
    served_model: str,
    counting: bool = False,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str = "hermes",
) -> ParsedRequest:
    """counting: /v1/messages/count_tokens, which takes no max_tokens."""
    body = require_object(body)
    for key in ("container", "mcp_servers"):
        if body.get(key):
            raise bad(key, f"'{key}' is not supported by this server")
    if not counting and body.get("max_tokens") is None:
        raise bad("max_tokens", "'max_tokens' is required")
    opt(body, "temperature", None, _TEMPERATURE)
    opt(body, "metadata", None, as_dict)
    chat = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    chat["max_tokens"] = None if counting else body.get("max_tokens")
    chat["stop"] = body.get("stop_sequences")
    chat["tools"] = _chat_tools(body.get("tools"))
    chat.update(_tool_choice(body.get("tool_choice")))
    chat["response_format"] = _output_format(body.get("output_config"))
    if _thinking_disabled(body.get("thinking")):
        kwargs = opt(body, "chat_template_kwargs", {}, as_dict)
        chat["chat_template_kwargs"] = {**kwargs, "enable_thinking": False}
    try:
        parsed = parse_chat(
            chat,
            served_model,
            max_n=1,
            vocab_size=vocab_size,
            max_constraint_bytes=max_constraint_bytes,
            max_constraint_depth=max_constraint_depth,
            max_constraint_properties=max_constraint_properties,
            reasoning_parser=reasoning_parser,
            tool_call_parser=tool_call_parser,
        )
    except ProtocolError as e:
        raise renamed(e, _RENAMES) from None
    parsed.param_names = renamed_params(parsed.param_names, _RENAMES)
    return parsed


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    text = value if isinstance(value, str) else _texts(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", f"'messages' must be a non-empty list of messages, got {show(value)}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        path = f"messages.{i}"
        message = as_dict(message, path)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{path}.role", f"'{path}.role' must be user or assistant, got {show(role)}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad(
                f"{path}.content",
                f"'{path}.content' must be a string or a list of blocks, got {show(content)}",
            )
        elif role == "user":
            out += _user_turn(content, f"{path}.content")
        else:
            out.append(_assistant_turn(content, f"{path}.content"))
    return out


def _blocks(content: list[Any], path: str, allowed: tuple[str, ...]):
    """(block, its path) for each block, its type one of allowed."""
    for j, block in enumerate(content):
        block = as_dict(block, f"{path}.{j}")
        if block.get("type") not in allowed:
            raise bad(
                f"{path}.{j}.type",
                f"'{path}.{j}.type' must be one of {', '.join(allowed)}; "
                f"{show(block.get('type'))} is not supported by this server",
            )
        yield block, f"{path}.{j}"


def _user_turn(content: list[Any], path: str) -> list[dict[str, Any]]:
    """Tool results as tool messages, then the text (Anthropic puts results first)."""
    results, texts = [], []
    for block, where in _blocks(content, path, ("text", "tool_result")):
        if block["type"] == "text":
            texts.append(_string(block, "text", where))
            continue
        call_id = _string(block, "tool_use_id", where, empty_ok=False)
        result = block.get("content", "")
        text = result if isinstance(result, str) else _texts(result, f"{where}.content")
        if opt(block, "is_error", False, lambda v, _: as_bool(v, f"{where}.is_error")):
            text = "Error: " + text
        results.append({"role": "tool", "tool_call_id": call_id, "content": text})
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_turn(content: list[Any], path: str) -> dict[str, Any]:
    texts, calls = [], []
    kinds = ("text", "tool_use", "thinking", "redacted_thinking")
    for block, where in _blocks(content, path, kinds):
        if block["type"] == "text":
            texts.append(_string(block, "text", where))
        elif block["type"] == "tool_use":
            arguments = as_dict(block.get("input"), f"{where}.input")
            call_id = _string(block, "id", where, empty_ok=False)
            name = _string(block, "name", where, empty_ok=False)
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _texts(value: Any, path: str) -> str:
    if not isinstance(value, list):
        raise bad(path, f"'{path}' must be a string or a list of text blocks, got {show(value)}")
    return "\n".join(
        _string(block, "text", where) for block, where in _blocks(value, path, ("text",))
    )


def _string(block: dict[str, Any], key: str, path: str, empty_ok: bool = True) -> str:
    value = block.get(key)
    if not isinstance(value, str) or (not value and not empty_ok):
        what = "a string" if empty_ok else "a non-empty string"
        raise bad(f"{path}.{key}", f"'{path}.{key}' must be {what}, got {show(value)}")
    return value


def _chat_tools(value: Any) -> Any:
    if not isinstance(value, list):
        return value  # the chat parser refuses what is not a list
    tools = []
    for i, tool in enumerate(value):
        tool = as_dict(tool, f"tools.{i}")
        if tool.get("type") not in (None, "custom"):
            raise bad(
                f"tools.{i}.type",
                f"'tools.{i}.type' {show(tool.get('type'))}: only custom tools (name, "
                "input_schema) are supported by this server",
            )
        if tool.get("input_schema") is None:
            raise bad(f"tools.{i}.input_schema", f"'tools.{i}.input_schema' is required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls for the chat body."""
    if value is None:
        return {}
    choice = as_dict(value, "tool_choice")
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise bad(
            "tool_choice.type",
            f"'tool_choice.type' must be auto, any, tool or none, got {show(kind)}",
        )
    disable = opt(
        choice,
        "disable_parallel_tool_use",
        False,
        lambda v, _: as_bool(v, "tool_choice.disable_parallel_tool_use"),
    )
    if disable:
        out["parallel_tool_calls"] = False
    return out


def _output_format(value: Any) -> dict[str, Any] | None:
    """output_config.format {"type": "json_schema", "schema"} as chat's response_format (the
    same grammar path); output_config.effort has no effect here."""
    if value is None:
        return None
    fmt = as_dict(value, "output_config").get("format")
    if fmt is None:
        return None
    fmt = as_dict(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise bad(
            "output_config.format.type",
            f"'output_config.format.type' must be json_schema, got {show(fmt.get('type'))}",
        )
    if fmt.get("schema") is None:
        raise bad("output_config.format.schema", "'output_config.format.schema' is required")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


_THINKING = ("enabled", "disabled", "adaptive", "between_tools")


def _thinking_disabled(value: Any) -> bool:
    if value is None:
        return False
    kind = as_dict(value, "thinking").get("type")
    if kind not in _THINKING:
        raise bad(
            "thinking.type",
            f"'thinking.type' must be one of {', '.join(_THINKING)}, got {show(kind)}",
        )
    return kind == "disabled"
