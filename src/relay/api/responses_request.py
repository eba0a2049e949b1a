"""POST /v1/responses' body, read as the chat completions request it amounts to.

The body is translated field by field into a chat completions body (input items to messages,
function tools to chat tools, text.format to response_format, max_output_tokens to
max_completion_tokens) and parsed by relay.api.chat.parse_chat, so templates, tool grammars,
the reasoning parser and structured output are the chat route's own; a refusal names the
Responses field (relay.api.renamed_fields).

`previous_response_id` continues a stored conversation (relay.api.responses_store); its
instructions are not carried over, as OpenAI does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relay.api.chat import parse_chat
from relay.api.errors import ProtocolError, bad, show
from relay.api.json_body import require_object
from relay.api.openai_common import SAMPLING_KEYS
from relay.api.parsed_request import ParsedRequest
from relay.api.renamed_fields import renamed, renamed_params, renames
from relay.api.responses_items import input_messages
from relay.api.responses_store import ResponseStore
from relay.api.typed_fields import as_bool, as_dict, opt

# Chat field -> the Responses field it was translated from.
_RENAMES = renames(
    [
        (r"max_completion_tokens", "max_output_tokens"),
        (r"tools\.(\d+)\.function\.(\w+)", r"tools[\1].\2"),
        (r"tools\.(\d+)\.function", r"tools[\1]"),
        (r"tools\.(\d+)(.*)", r"tools[\1]\2"),
        (r"tool_choice\.function\.name", "tool_choice.name"),
        (r"tool_choice\.function", "tool_choice"),
        (r"response_format\.json_schema\.(\w+)", r"text.format.\1"),
        (r"response_format.*", "text.format"),
        (r"messages.*", "input"),
    ]
)
# Passed to the chat parser as they are: the Responses sampling fields, and the vendor extras
# (top_k, seed, stop, ...) an OpenAI SDK sends in extra_body, as on chat completions.
_PASSED = (
    "model",
    "stream",
    "parallel_tool_calls",
    "priority",
    "chat_template_kwargs",
    *SAMPLING_KEYS,
)


@dataclass
class ResponsesRequest:
    parsed: ParsedRequest
    # The conversation without instructions: with the answer appended, what the store keeps.
    conversation: list[dict[str, Any]]
    store: bool
    # Request fields the response object repeats back.
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses(
    body: Any,
    served_model: str,
    store: ResponseStore,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str = "hermes",
) -> ResponsesRequest:
    body = require_object(body)
    _refuse_unsupported(body)
    previous = _previous(body, store)
    conversation = previous + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"'instructions' must be a string, got {show(instructions)}")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = {key: body[key] for key in _PASSED if key in body}
    chat["messages"] = system + conversation
    chat["max_completion_tokens"] = body.get("max_output_tokens")
    chat["tools"] = _chat_tools(body.get("tools"))
    chat["tool_choice"] = _chat_tool_choice(body.get("tool_choice"))
    chat["response_format"] = _response_format(body.get("text"))
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
    # The tokenizer names the prompt `messages` when it cannot take it (too long for the
    # context, a template that fails on it): here the prompt is the input.
    parsed.param_names = {**renamed_params(parsed.param_names, _RENAMES), "messages": "input"}
    return ResponsesRequest(parsed, conversation, opt(body, "store", True, as_bool), _echo(body))


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields whose effect this server would silently drop."""
    if body.get("background"):
        raise bad("background", "'background' responses are not supported by this server")
    for key in ("conversation", "prompt", "max_tool_calls"):
        if body.get(key) is not None:
            raise bad(key, f"'{key}' is not supported by this server")
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "'top_logprobs' is not supported on /v1/responses")
    if body.get("truncation") not in (None, "disabled"):
        raise bad(
            "truncation",
            "'truncation' must be \"disabled\": this server refuses a prompt longer than the "
            "context instead of dropping items from it",
        )


def _previous(body: dict[str, Any], store: ResponseStore) -> list[dict[str, Any]]:
    response_id = body.get("previous_response_id")
    if response_id is None:
        return []
    if not isinstance(response_id, str):
        raise bad(
            "previous_response_id",
            f"'previous_response_id' must be a string, got {show(response_id)}",
        )
    messages = store.get(response_id)
    if messages is None:
        raise ProtocolError(
            404,
            f"Previous response with id {show(response_id)} not found: it was created with "
            f"store false, or evicted (this server keeps its last {store.max_responses} "
            "responses, in memory)",
            "previous_response_id",
        )
    return messages


def _chat_tools(value: Any) -> Any:
    """Function tools in chat's shape; any other tool type (web search, file search, ...) is
    refused."""
    if not isinstance(value, list):
        return value  # the chat parser refuses what is not a list
    tools = []
    for i, tool in enumerate(value):
        tool = as_dict(tool, f"tools[{i}]")
        if tool.get("type") != "function":
            raise bad(
                f"tools[{i}].type",
                f"'tools[{i}].type' must be \"function\"; {show(tool.get('type'))} tools are "
                "not supported by this server",
            )
        keys = ("name", "description", "parameters", "strict")
        tools.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return tools


def _chat_tool_choice(value: Any) -> Any:
    """{"type": "function", "name": ...} in chat's shape; the strings pass as they are."""
    if not isinstance(value, dict):
        return value
    if value.get("type") != "function":
        raise bad(
            "tool_choice.type",
            f"'tool_choice.type' must be \"function\"; {show(value.get('type'))} is not "
            "supported by this server",
        )
    return {"type": "function", "function": {"name": value.get("name")}}


def _response_format(text: Any) -> Any:
    """text.format (text, json_object, or json_schema with its schema at the top level) as
    chat's response_format."""
    if text is None:
        return None
    fmt = as_dict(text, "text").get("format")
    if fmt is None:
        return None
    fmt = as_dict(fmt, "text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _echo(body: dict[str, Any]) -> dict[str, Any]:
    """What the response object repeats of the request (parsed already: the types hold), its
    defaults filled in. `metadata`, `reasoning` and `user` are only checked and repeated:
    reasoning effort has no effect here (docs/api.md)."""
    text = body.get("text") or {}
    for key in ("metadata", "reasoning"):
        opt(body, key, None, as_dict)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", f"'user' must be a string, got {show(body['user'])}")
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": opt(body, "temperature", 1.0, lambda v, _: v),
        "top_p": opt(body, "top_p", 1.0, lambda v, _: v),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}},
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store") is not False,
        "truncation": "disabled",
        "user": body.get("user"),
    }
