"""The Responses API's `input`: a string (one user message) or a list of items, read into the
chat messages the chat template renders (relay.api.chat_messages' shape). Errors name the
item's path as OpenAI writes it: `input[2].call_id`.

Items read:
- a message ({"type": "message"} or just a role): role user, assistant, system or developer
  (developer is the system role), content a string or a list of text parts (input_text,
  output_text, refusal: all read as text);
- function_call {call_id, name, arguments}: a call of the assistant turn it follows (calls in a
  row are one turn's calls, as chat templates render parallel calls);
- function_call_output {call_id, output}: a tool message answering that call;
- reasoning: skipped (chat templates drop earlier turns' reasoning).
Images, files, audio and item references are refused.
"""

from __future__ import annotations

from typing import Any

from relay.api.errors import bad, show

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad(
            "input", f"'input' must be a string or a non-empty list of items, got {show(value)}"
        )
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages answering it
    for i, item in enumerate(value):
        _read_item(item, f"input[{i}]", messages, names)
    return messages


def _read_item(item: Any, path: str, messages: list[dict[str, Any]], names: dict[str, str]) -> None:
    if not isinstance(item, dict):
        raise bad(path, f"'{path}' must be an object, got {show(item)}")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        messages.append(_message(item, path))
    elif kind == "function_call":
        call = _function_call(item, path)
        names[call["id"]] = call["function"]["name"]
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", path)
        output = _text(item.get("output"), f"{path}.output")
        message = {"role": "tool", "tool_call_id": call_id, "content": output}
        if call_id in names:
            message["name"] = names[call_id]
        messages.append(message)
    elif kind != "reasoning":
        raise bad(
            f"{path}.type",
            f"'{path}.type' must be message, function_call, function_call_output or reasoning; "
            f"{show(kind)} is not supported by this server",
        )


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad(
            f"{path}.role", f"'{path}.role' must be one of {', '.join(_ROLES)}, got {show(role)}"
        )
    content = _text(item.get("content"), f"{path}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(value: Any, path: str) -> str:
    """A string, or a list of text parts joined (the way chat content parts are)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(path, f"'{path}' must be a string or a list of text parts, got {show(value)}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise bad(f"{path}[{j}]", f"'{path}[{j}]' must be an object, got {show(part)}")
        if part.get("type") not in _TEXT_PARTS:
            raise bad(
                f"{path}[{j}].type",
                f"'{path}[{j}].type' must be input_text or output_text; "
                f"{show(part.get('type'))} is not supported by this server (text only)",
            )
        key = "refusal" if part["type"] == "refusal" else "text"
        texts.append(_string(part, key, f"{path}[{j}]", empty_ok=True))
    return "\n".join(texts)


def _function_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    call_id = _string(item, "call_id", path)
    name = _string(item, "name", path)
    arguments = _string(item, "arguments", path, empty_ok=True)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _string(item: dict[str, Any], key: str, path: str, empty_ok: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty_ok):
        what = "a string" if empty_ok else "a non-empty string"
        raise bad(f"{path}.{key}", f"'{path}.{key}' must be {what}, got {show(value)}")
    return value
