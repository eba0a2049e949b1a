"""The HTTP request/response layer: OpenAI-compatible and SGLang-native bodies.

Pure functions only: parsers turn a decoded JSON body into a ParsedRequest (or raise
ProtocolError carrying the HTTP status and the offending field), and builders turn engine
outputs into the dicts the server JSON-encodes. Nothing here touches a socket or a process,
so every rule is unit-testable and the HTTP server stays a thin router.

Conventions shared by all parsers:
- A field that is absent or JSON null takes its default; many OpenAI clients send explicit
  nulls for "not set", and treating them as errors would break those clients.
- Types are strict: a bool is not an int, a numeric string is not a number.
- Unknown top-level fields are ignored (OpenAI SDKs pass vendor extras through), except
  inside SGLang's `sampling_params`, where a typo would otherwise be silently ignored.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from relay.sampling_params import MAX_TOP_LOGPROBS, UNTIL_CONTEXT, InvalidParam, SamplingParams

# Anything above this is a client bug, not a real budget; rejecting it early keeps it
# out of the scheduler's arithmetic.
MAX_TOKENS_LIMIT = 1_000_000
# Chat requests without max_tokens mean "until the context is full". SamplingParams needs
# an int, so this sentinel stands in; the tokenizer process clamps it to the room left in
# the context once it knows the prompt length. ParsedRequest.max_tokens_default flags it.
MAX_TOKENS_UNSET = UNTIL_CONTEXT
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
GENERATE_DEFAULT_MAX_TOKENS = 128  # SGLang's default
# Values cross msgpack, which carries 64-bit integers at most.
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
# JSON has no -Infinity; OpenAI documents -9999.0 as its stand-in for "very unlikely".
_LOGPROB_FLOOR = -9999.0

_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Keys of HF apply_chat_template that would collide with the tokenizer's own call or let a
# client swap in its own template; everything else reaches the template as a variable.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


# ---------------------------------------------------------------- errors ----------------

_DEFAULT_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                        429: "rate_limit_error"}


class ProtocolError(Exception):
    """A request the server refuses; maps one-to-one onto an OpenAI error response."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _default_error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.type)


def _default_error_type(status: int) -> str:
    if status >= 500:
        return "internal_server_error"
    return _DEFAULT_ERROR_TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> dict[str, Any]:
    # The nested "error" object is what the openai client reads to build BadRequestError etc.
    return {"object": "error",
            "error": {"message": message, "type": type or _default_error_type(status),
                      "param": param, "code": status}}


def _bad(param: str | None, message: str) -> ProtocolError:
    return ProtocolError(400, message, param)


def _show(value: Any) -> str:
    # Bodies are attacker-sized; never echo a megabyte back in an error message.
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- JSON bodies ------------

# Real bodies nest a few levels (a JSON schema a dozen); deeper ones are attacks on parsers.
MAX_JSON_DEPTH = 64


def decode_json_body(raw: bytes) -> Any:
    """A request body as JSON, refusing (400) what would break later stages: invalid UTF-8,
    nesting deeper than MAX_JSON_DEPTH, and strings that are not valid Unicode (JSON lets a
    lone surrogate like "\\ud800" through; no encoder downstream accepts it)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(None, "the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(None, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise _bad(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json_tree(body)
    return body


def _check_json_tree(body: Any) -> None:
    """Iteratively (no recursion to exhaust): depth and Unicode validity of every string."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _is_valid_unicode(value):
                raise _bad(path or None, f"'{path or 'body'}' is not valid Unicode (a lone surrogate?)")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _bad(path or None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            name = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_valid_unicode(key):
                raise _bad(path or None, f"a key in '{path or 'body'}' is not valid Unicode")
            stack.append((child, name, depth + 1))


def _is_valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_abort(body: Any) -> str:
    """POST /abort_request: the request id to end."""
    rid = _require_object(body).get("rid")
    if not isinstance(rid, str) or not rid:
        raise _bad("rid", "'rid' must be a non-empty string")
    return rid


# ---------------------------------------------------------------- parsed request ---------

@dataclass
class ParsedRequest:
    """One validated API request, ready to become an ipc GenerateReq.

    max_tokens_default: the client gave no token budget (chat only), so
    params.max_new_tokens holds MAX_TOKENS_UNSET and the tokenizer process must clamp it to
    the context room left after the prompt.
    """
    kind: str  # "completion" | "chat" | "generate"
    params: SamplingParams
    model: str = ""
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    echo: bool = False
    max_tokens_default: bool = False
    rid: str | None = None  # /generate only: a client-chosen request id


# ---------------------------------------------------------------- typed field access ------

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_int(value: Any, param: str, lo: int, hi: int, what: str | None = None) -> int:
    if not _is_int(value):
        raise _bad(param, f"'{param}' must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise _bad(param, f"'{param}' must be {what or f'an integer in [{lo}, {hi}]'}, got {_show(value)}")
    return value


def _as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(param, f"'{param}' must be a boolean, got {_show(value)}")
    return value


def _as_dict(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(param, f"'{param}' must be an object, got {_show(value)}")
    return value


def _as_token_ids(value: Any, param: str, allow_empty: bool, vocab_size: int | None = None) -> list[int]:
    if not isinstance(value, list):
        raise _bad(param, f"'{param}' must be a list of token ids, got {_show(value)}")
    if not value and not allow_empty:
        raise _bad(param, f"'{param}' must not be empty")
    limit = _I32_MAX + 1 if vocab_size is None else vocab_size
    for i, t in enumerate(value):
        if not _is_int(t) or t < 0:
            raise _bad(param, f"'{param}' must hold token ids (integers >= 0); item {i} is {_show(t)}")
        if t >= limit:
            raise _bad(param, f"'{param}' item {i} is {_show(t)}, outside the vocabulary [0, {limit})")
    return value


def _as_stop(value: Any, param: str) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _bad(param, f"'{param}' must be a string or a list of strings, got {_show(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(param, f"'{param}' allows at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise _bad(param, f"'{param}' must hold non-empty strings, got {_show(s)}")
    return list(stops)


def _as_stop_ids(value: Any, param: str) -> list[int]:
    ids = _as_token_ids(value, param, allow_empty=True)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise _bad(param, f"'{param}' allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return list(ids)


def _num_rule(check: Callable[[float], bool], what: str) -> Callable[[Any, str], float]:
    def convert(value: Any, param: str) -> float:
        if not _is_num(value):
            raise _bad(param, f"'{param}' must be a number, got {_show(value)}")
        if not check(value):
            raise _bad(param, f"'{param}' must be {what}, got {_show(value)}")
        return float(value)
    return convert


def _int_rule(lo: int, hi: int, what: str | None = None) -> Callable[[Any, str], int]:
    return lambda value, param: _as_int(value, param, lo, hi, what)


# SamplingParams field -> converter(value, param) that type- and range-checks one value.
# Ranges mirror SamplingParams.validate() so errors name the API field, not the internal one.
_FIELD_RULES: dict[str, Callable[[Any, str], Any]] = {
    "max_new_tokens": _int_rule(1, MAX_TOKENS_LIMIT),
    "min_new_tokens": _int_rule(0, MAX_TOKENS_LIMIT),
    "temperature": _num_rule(lambda x: 0 <= x <= 2, "in [0, 2]"),
    "top_p": _num_rule(lambda x: 0 < x <= 1, "in (0, 1]"),
    "top_k": _int_rule(-1, _I32_MAX, "-1 or 0 (off), or >= 1"),
    "min_p": _num_rule(lambda x: 0 <= x <= 1, "in [0, 1]"),
    "repetition_penalty": _num_rule(lambda x: 0 < x <= 10, "in (0, 10]"),
    "frequency_penalty": _num_rule(lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "presence_penalty": _num_rule(lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "seed": _int_rule(_I64_MIN, _I64_MAX, "a 64-bit integer"),
    "stop": _as_stop,
    "stop_token_ids": _as_stop_ids,
    "ignore_eos": _as_bool,
    "skip_special_tokens": _as_bool,
    "include_stop_str_in_output": _as_bool,
}
# SGLang's native API has never capped temperature at OpenAI's 2.
_GENERATE_FIELD_RULES = {**_FIELD_RULES, "temperature": _num_rule(lambda x: 0 <= x <= 100, "in [0, 100]")}

# OpenAI body key -> SamplingParams field (max_tokens and logprobs are handled apart).
_OPENAI_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop",
    # vLLM/SGLang extras that OpenAI SDKs pass through via extra_body
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "stop_token_ids": "stop_token_ids", "include_stop_str_in_output": "include_stop_str_in_output",
}
# SGLang sampling_params key -> SamplingParams field ("n" is handled apart).
_GENERATE_KEYS = {
    "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "seed": "seed", "sampling_seed": "seed", "no_stop_trim": "include_stop_str_in_output",
}


def _sampling_kwargs(body: dict[str, Any], keys: dict[str, str], rules: dict[str, Callable[[Any, str], Any]],
                     prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in keys.items():
        value = body.get(key)
        if value is not None:
            out[name] = rules[name](value, prefix + key)
    return out


def _validated(params: SamplingParams, names: dict[str, str], vocab_size: int | None) -> SamplingParams:
    """Run SamplingParams.validate(), reporting failures under the API's field names."""
    try:
        return params.validate(vocab_size)
    except InvalidParam as e:
        # Rename only in the "<field> <rule>" head: the ", got <value>" tail may quote user text.
        head, sep, tail = str(e).partition(", got ")
        head = re.sub(r"\w+", lambda m: names.get(m.group(), m.group()), head)
        raise _bad(names.get(e.field, e.field), head + sep + tail) from None


# ---------------------------------------------------------------- shared OpenAI fields ----

def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad(None, "request body must be a JSON object")
    return body


def _check_model(body: dict[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None:
        return served_model
    if not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {_show(model)}")
    if model != served_model:
        raise ProtocolError(404, f"The model `{model[:100]}` does not exist; this server serves `{served_model}`.",
                            "model", "not_found_error")
    return served_model


def _reject_unsupported(body: dict[str, Any], harmless: dict[str, Callable[[Any], bool]]) -> None:
    """Refuse fields whose effect we would silently drop; `harmless` says which values are no-ops."""
    for key, is_noop in harmless.items():
        value = body.get(key)
        if value is not None and not is_noop(value):
            raise _bad(key, f"'{key}' is not supported by this server")


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    stream = False if stream is None else _as_bool(stream, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include = _as_dict(options, "stream_options").get("include_usage")
    return stream, False if include is None else _as_bool(include, "stream_options.include_usage")


def _opt(body: dict[str, Any], key: str, default: Any, convert: Callable[[Any, str], Any]) -> Any:
    value = body.get(key)
    return default if value is None else convert(value, key)


def _priority(body: dict[str, Any], param: str = "priority") -> int:
    value = body.get("priority")
    return 0 if value is None else _as_int(value, param, _I32_MIN, _I32_MAX)


def _common_openai(body: dict[str, Any], served_model: str, max_n: int) -> dict[str, Any]:
    """Fields the two OpenAI endpoints share, as ParsedRequest keyword arguments."""
    model = _check_model(body, served_model)
    if _opt(body, "echo", False, _as_bool):
        raise _bad("echo", "'echo' is not supported by this server")
    stream, include_usage = _stream_fields(body)
    n = _opt(body, "n", 1, lambda v, p: _as_int(v, p, 1, max_n))
    return {"model": model, "stream": stream, "include_usage": include_usage, "n": n,
            "priority": _priority(body)}


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int | None]:
    """The first of `keys` that is set, and its value; every set key is type-checked."""
    given = [(k, _FIELD_RULES["max_new_tokens"](body[k], k)) for k in keys if body.get(k) is not None]
    return given[0] if given else (keys[0], None)


# ---------------------------------------------------------------- /v1/completions --------

def _prompt(value: Any, vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > 1:
            raise _bad("prompt", "batched prompts are not supported; use 'n' or send separate requests")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _bad("prompt", "'prompt' must not be empty")
        return value, None
    if isinstance(value, list):
        return None, _as_token_ids(value, "prompt", allow_empty=False, vocab_size=vocab_size)
    raise _bad("prompt", f"'prompt' must be a string or a list of token ids, got {_show(value)}")


def _completion_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    k = body.get("logprobs")
    if k is None:
        return {}
    return {"logprobs": True, "top_logprobs": _as_int(k, "logprobs", 0, MAX_TOP_LOGPROBS)}


_COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v == "",
    "logit_bias": lambda v: v == {},
}
_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}


def parse_completion(body: Any, served_model: str, max_n: int = 16, vocab_size: int | None = None
                     ) -> ParsedRequest:
    """POST /v1/completions. Token ids (prompt, stop_token_ids) are checked against
    vocab_size when it is given."""
    body = _require_object(body)
    common = _common_openai(body, served_model, max_n)
    _reject_unsupported(body, {**_COMPLETION_UNSUPPORTED, "best_of": lambda v: v == common["n"]})
    if body.get("prompt") is None:
        raise _bad("prompt", "'prompt' is required")
    text, input_ids = _prompt(body["prompt"], vocab_size)
    _, max_tokens = _max_tokens(body, ("max_tokens",))
    kwargs = _sampling_kwargs(body, _OPENAI_KEYS, _FIELD_RULES)
    kwargs["max_new_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    kwargs.update(_completion_logprobs(body))
    params = _validated(SamplingParams(**kwargs), _COMPLETION_NAMES, vocab_size)
    return ParsedRequest(kind="completion", params=params, text=text, input_ids=input_ids, **common)


# ---------------------------------------------------------------- /v1/chat/completions ---

def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"'{param}' must be a string or a list of text parts, got {_show(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(param, f"'{param}' part {j} must be {{\"type\": \"text\", \"text\": <string>}}; "
                              "only text content is supported")
        texts.append(part["text"])
    # Separate parts the way other HF-template servers do, so words do not run together.
    return "\n".join(texts)


def _message(msg: Any, i: int) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise _bad(f"messages.{i}", f"'messages.{i}' must be an object, got {_show(msg)}")
    role = msg.get("role")
    if role not in _CHAT_ROLES:
        raise _bad(f"messages.{i}.role", f"'messages.{i}.role' must be one of {', '.join(_CHAT_ROLES)}, "
                                         f"got {_show(role)}")
    content = msg.get("content")
    # An assistant turn may carry no content (it made tool calls); render it as empty.
    text = "" if content is None and role == "assistant" else _content_text(content, f"messages.{i}.content")
    # HF chat templates predate "developer"; it is OpenAI's new name for the system role.
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    for key in ("name", "tool_call_id"):
        if isinstance(msg.get(key), str):
            out[key] = msg[key]
    return out


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "'messages' must be a non-empty list of message objects")
    return [_message(m, i) for i, m in enumerate(value)]


def _chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    extra = _opt(body, "chat_template_kwargs", {}, _as_dict)
    for key in extra:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise _bad(f"chat_template_kwargs.{key}", f"'chat_template_kwargs.{key}' may not be set")
    kwargs = dict(extra)
    add = body.get("add_generation_prompt", kwargs.get("add_generation_prompt"))
    kwargs["add_generation_prompt"] = True if add is None else _as_bool(add, "add_generation_prompt")
    return kwargs


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    want = _opt(body, "logprobs", False, _as_bool)
    top = _opt(body, "top_logprobs", 0, lambda v, p: _as_int(v, p, 0, MAX_TOP_LOGPROBS))
    if top and not want:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    return {"logprobs": want, "top_logprobs": top} if want else {}


_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "function_call": lambda v: v in ("none", "auto"),
    "response_format": lambda v: v == {"type": "text"},
    "logit_bias": lambda v: v == {},
}


def parse_chat(body: Any, served_model: str, max_n: int = 16, vocab_size: int | None = None) -> ParsedRequest:
    """POST /v1/chat/completions."""
    body = _require_object(body)
    common = _common_openai(body, served_model, max_n)
    _reject_unsupported(body, _CHAT_UNSUPPORTED)
    messages = _messages(body.get("messages"))
    budget_key, max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    kwargs = _sampling_kwargs(body, _OPENAI_KEYS, _FIELD_RULES)
    kwargs["max_new_tokens"] = MAX_TOKENS_UNSET if max_tokens is None else max_tokens
    kwargs.update(_chat_logprobs(body))
    names = {"max_new_tokens": budget_key, "min_new_tokens": "min_tokens", "top_logprobs": "top_logprobs"}
    params = _validated(SamplingParams(**kwargs), names, vocab_size)
    return ParsedRequest(kind="chat", params=params, messages=messages, chat_kwargs=_chat_kwargs(body),
                         max_tokens_default=max_tokens is None, **common)


# ---------------------------------------------------------------- /generate (SGLang) -----

def _generate_input(body: dict[str, Any], vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise _bad("text", "give exactly one of 'text' or 'input_ids'")
    if text is not None:
        if isinstance(text, list):
            raise _bad("text", "batched 'text' is not supported; send separate requests")
        if not isinstance(text, str) or not text:
            raise _bad("text", f"'text' must be a non-empty string, got {_show(text)}")
        return text, None
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise _bad("input_ids", "batched 'input_ids' are not supported; send separate requests")
    return None, _as_token_ids(ids, "input_ids", allow_empty=False, vocab_size=vocab_size)


def _generate_sampling(raw: Any, max_n: int) -> tuple[dict[str, Any], int]:
    sp = {} if raw is None else _as_dict(raw, "sampling_params")
    for key in sp:
        if key not in _GENERATE_KEYS and key != "n":
            raise _bad(f"sampling_params.{key}", f"unknown sampling parameter 'sampling_params.{key}'")
    kwargs = _sampling_kwargs(sp, _GENERATE_KEYS, _GENERATE_FIELD_RULES, "sampling_params.")
    n = sp.get("n")
    n = 1 if n is None else _as_int(n, "sampling_params.n", 1, max_n)
    kwargs.setdefault("max_new_tokens", GENERATE_DEFAULT_MAX_TOKENS)
    return kwargs, n


def _generate_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    want = _opt(body, "return_logprob", False, _as_bool)
    top = _opt(body, "top_logprobs_num", 0, lambda v, p: _as_int(v, p, 0, MAX_TOP_LOGPROBS))
    # SGLang ignores top_logprobs_num unless return_logprob is set; do the same.
    return {"logprobs": True, "top_logprobs": top} if want else {}


def _rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise _bad("rid", f"'rid' must be a non-empty string of at most 256 characters, got {_show(rid)}")
    return rid


def parse_generate(body: Any, max_n: int = 16, vocab_size: int | None = None) -> ParsedRequest:
    """POST /generate, SGLang's native API (single request; no batches)."""
    body = _require_object(body)
    text, input_ids = _generate_input(body, vocab_size)
    kwargs, n = _generate_sampling(body.get("sampling_params"), max_n)
    kwargs.update(_generate_logprobs(body))
    names = {f: f"sampling_params.{f}" for f in _FIELD_RULES} | {"top_logprobs": "top_logprobs_num"}
    params = _validated(SamplingParams(**kwargs), names, vocab_size)
    return ParsedRequest(kind="generate", params=params, text=text, input_ids=input_ids, n=n,
                         stream=_opt(body, "stream", False, _as_bool), priority=_priority(body),
                         rid=_rid(body))


# ---------------------------------------------------------------- outputs ----------------

@dataclass
class ChoiceOutput:
    """One choice's output (whole, or one streamed delta of it).

    logprobs: None unless asked; else one entry per token,
    [token_id, token_text, logprob, top] with top None or a list of [token_id, token_text, logprob].
    """
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    matched_stop: Any = None  # the stop string or stop token id that ended it
    logprobs: list[list[Any]] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @classmethod
    def for_choices(cls, usages: list["Usage"]) -> "Usage":
        """One request's usage from its n choices: the shared prompt counts once (as OpenAI
        bills it) and its cached part is the least any choice found, so it never exceeds it."""
        return cls(prompt_tokens=usages[0].prompt_tokens,
                   completion_tokens=sum(u.completion_tokens for u in usages),
                   cached_tokens=min(u.cached_tokens for u in usages))

    def to_openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def _lp(x: Any) -> float:
    return float(x) if _is_num(x) else _LOGPROB_FLOOR


def _completion_logprobs_body(entries: list[list[Any]] | None, offset: int) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets, pos = [], offset
    for _, text, _, _ in entries:
        offsets.append(pos)
        pos += len(text)
    tops: list[dict[str, float]] | None = None
    if any(top is not None for *_, top in entries):
        # Legacy completions key alternatives by text; keep the likelier one on a text clash.
        tops = [{t: _lp(lp) for _, t, lp in reversed(top or [])} for *_, top in entries]
    return {"tokens": [e[1] for e in entries], "token_logprobs": [_lp(e[2]) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def _completion_choice(c: ChoiceOutput, offset: int = 0) -> dict[str, Any]:
    return {"index": c.index, "text": c.text, "logprobs": _completion_logprobs_body(c.logprobs, offset),
            "finish_reason": c.finish_reason}


def completion_response(rid: str, created: int, model: str, choices: list[ChoiceOutput],
                        usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(c) for c in choices], "usage": usage.to_openai()}


def completion_chunk(rid: str, created: int, model: str, choice_delta: ChoiceOutput,
                     text_offset: int = 0) -> dict[str, Any]:
    """A streamed completions delta; text_offset is how many characters this choice already
    streamed, so logprobs' text_offset keeps counting across chunks."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(choice_delta, text_offset)]}


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage is set; kind "completion" | "chat"."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage.to_openai()}


def _token_entry(token: str, logprob: Any) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def _chat_logprobs_body(entries: list[list[Any]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{**_token_entry(text, lp), "top_logprobs": [_token_entry(t, l) for _, t, l in top or []]}
                        for _, text, lp, top in entries]}


def chat_response(rid: str, created: int, model: str, choices: list[ChoiceOutput],
                  usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": _chat_logprobs_body(c.logprobs), "finish_reason": c.finish_reason}
                        for c in choices],
            "usage": usage.to_openai()}


def chat_chunk(rid: str, created: int, model: str, delta: ChoiceOutput, first: bool) -> dict[str, Any]:
    """A streamed chat delta; the first chunk of each choice announces the assistant role."""
    # A finishing chunk with no new text carries an empty delta, as OpenAI sends it.
    body: dict[str, Any] = {"role": "assistant"} if first else {}
    if first or delta.text:
        body["content"] = delta.text
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": delta.index, "delta": body, "logprobs": _chat_logprobs_body(delta.logprobs),
                         "finish_reason": delta.finish_reason}]}


def _sglang_finish(c: ChoiceOutput, usage: Usage) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": usage.completion_tokens}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    return {"type": c.finish_reason, "message": c.matched_stop}


def generate_response(rid: str, output: ChoiceOutput, usage: Usage, queue_time: float | None = None,
                      e2e_latency: float | None = None) -> dict[str, Any]:
    """SGLang's /generate shape. For streaming, pass the cumulative output so far: SGLang
    streams the whole text in every chunk, not a delta."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": _sglang_finish(output, usage),
                            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                            "cached_tokens": usage.cached_tokens}
    if queue_time is not None:
        meta["queue_time"] = queue_time
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if output.logprobs is not None:
        # SGLang orders each entry (logprob, token_id, text).
        meta["output_token_logprobs"] = [[_lp(lp), tid, text] for tid, text, lp, _ in output.logprobs]
        if any(top is not None for *_, top in output.logprobs):
            meta["output_top_logprobs"] = [[[_lp(l), t, s] for t, s, l in top or []]
                                           for *_, top in output.logprobs]
    return {"text": output.text, "output_ids": list(output.token_ids), "meta_info": meta}


# ---------------------------------------------------------------- SSE --------------------

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
