"""A chat request's messages and chat-template variables, as the tokenizer's chat template takes
them; /v1/chat/completions and /tokenize read them the same way."""

from __future__ import annotations

from typing import Any

from relay.api import tool_calls as T
from relay.api.errors import bad, show
from relay.api.typed_fields import as_bool, as_dict, opt

_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Keys of HF apply_chat_template that would collide with the tokenizer's own call or let a
# client swap in its own template; everything else reaches the template as a variable.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "add_special_tokens",  # /tokenize's own field; generation never adds them to a chat
    }
)


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(param, f"'{param}' must be a string or a list of text parts, got {show(content)}")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise bad(
                param,
                f'\'{param}\' part {j} must be {{"type": "text", "text": <string>}}; '
                "only text content is supported",
            )
        texts.append(part["text"])
    # Separate parts the way other HF-template servers do, so words do not run together.
    return "\n".join(texts)


def _message(msg: Any, i: int) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise bad(f"messages.{i}", f"'messages.{i}' must be an object, got {show(msg)}")
    role = msg.get("role")
    if role not in _CHAT_ROLES:
        raise bad(
            f"messages.{i}.role",
            f"'messages.{i}.role' must be one of {', '.join(_CHAT_ROLES)}, got {show(role)}",
        )
    content = msg.get("content")
    # An assistant turn may carry no content (it made tool calls); render it as empty.
    text = (
        ""
        if content is None and role == "assistant"
        else _content_text(content, f"messages.{i}.content")
    )
    # HF chat templates predate "developer"; it is OpenAI's new name for the system role.
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    for key in ("name", "tool_call_id"):
        if isinstance(msg.get(key), str):
            out[key] = msg[key]
    if role == "assistant" and msg.get("tool_calls"):
        out["tool_calls"] = T.template_tool_calls(msg["tool_calls"], f"messages.{i}.tool_calls")
    return out


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' must be a non-empty list of message objects")
    return [_message(m, i) for i, m in enumerate(value)]


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    extra = opt(body, "chat_template_kwargs", {}, as_dict)
    for key in extra:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad(f"chat_template_kwargs.{key}", f"'chat_template_kwargs.{key}' may not be set")
    kwargs = dict(extra)
    add = body.get("add_generation_prompt", kwargs.get("add_generation_prompt"))
    kwargs["add_generation_prompt"] = True if add is None else as_bool(add, "add_generation_prompt")
    return kwargs
