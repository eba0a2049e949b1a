"""What every API route shares: the error type and its OpenAI shape, JSON body decoding,
strictly typed field access, the sampling fields (ranges from relay.sampling_params.RANGES),
and the ParsedRequest that every parser produces.

Conventions shared by all parsers:
- A field that is absent or JSON null takes its default; many OpenAI clients send explicit
  nulls for "not set", and treating them as errors would break those clients.
- Types are strict: a bool is not an int, a numeric string is not a number.
- Unknown top-level fields are ignored (OpenAI SDKs pass vendor extras through), except
  inside SGLang's `sampling_params`, where a typo would otherwise be silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relay.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
    InvalidParam,
    Range,
    SamplingParams,
)

if TYPE_CHECKING:
    from relay.api.batched_prompts import Prompt
    from relay.api.tool_calls import ToolCalling

MAX_N = 16  # choices per request
MAX_INPUTS = 2048  # embeddings: inputs per request (OpenAI's limit)
# prompts in one completion request; each is a request in flight (--max-queued-requests)
MAX_PROMPTS = 256
_I32 = 2**31
# Real bodies nest a few levels (a JSON schema a dozen); deeper ones are attacks on parsers.
MAX_JSON_DEPTH = 64


# ---- errors ------------------------------------------------------------------------------

_DEFAULT_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class ProtocolError(Exception):
    """A request the server refuses; maps one-to-one onto an OpenAI error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _default_error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.type)

    def renamed(self, names: dict[str, str]) -> ProtocolError:
        """This error naming its field as `names` maps it: one prompt's of a batch (`prompt`
        as `prompt[2]`) or a pipeline stage's name as the route's (`prompt` as `text`)."""
        return ProtocolError(
            self.status, self.message, names.get(self.param, self.param), self.type
        )


def _default_error_type(status: int) -> str:
    if status >= 500:
        return "internal_server_error" if status == 500 else "server_error"
    return _DEFAULT_ERROR_TYPES.get(status, "invalid_request_error")


def error_body(
    status: int, message: str, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    # The nested "error" object is what the openai client reads to build BadRequestError etc.
    return {
        "object": "error",
        "error": {
            "message": message,
            "type": type or _default_error_type(status),
            "param": param,
            "code": status,
        },
    }


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape (/v1/messages): the message names the field at fault."""
    kind = _ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


def bad(param: str | None, message: str) -> ProtocolError:
    return ProtocolError(400, message, param)


def show(value: Any) -> str:
    # Bodies are attacker-sized; never echo a megabyte back in an error message.
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- JSON bodies -------------------------------------------------------------------------


def decode_json_body(raw: bytes) -> Any:
    """A request body as JSON, refusing (400) what would break later stages: invalid UTF-8,
    nesting deeper than MAX_JSON_DEPTH, strings that are not valid Unicode (JSON lets a
    lone surrogate like "\\ud800" through; no encoder downstream accepts it) and integers the
    wire cannot carry."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(None, "the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer of over 4,300 digits
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json_tree(body)
    return body


# Integers the wire (msgpack) carries: a JSON number outside them, in a field passed through
# whole (chat_template_kwargs, a tool's schema), failed the request's encoding with a 500.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


def _check_json_tree(body: Any) -> None:
    """Iteratively (no recursion to exhaust): depth, Unicode validity of every string, and every
    integer within what the wire carries."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _is_valid_unicode(value):
                raise bad(
                    path or None, f"'{path or 'body'}' is not valid Unicode (a lone surrogate?)"
                )
            continue
        if isinstance(value, int) and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
            raise bad(path or None, f"'{path or 'body'}' is an integer outside the 64-bit range")
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad(path or None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str) and not _is_valid_unicode(key):
                raise bad(path or None, f"a key in '{path or 'body'}' is not valid Unicode")
            stack.append((child, (f"{path}.{key}" if path else str(key))[:200], depth + 1))


def _is_valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    return body


# ---- the parsed request --------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """One validated API request, ready to become an ipc GenerateReq."""

    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    rid: str | None = None  # /generate's client-chosen id; a batched completion's id per prompt
    # SamplingParams field -> the API field it came from, for errors found past the http
    # process (a grammar that does not parse is found by the tokenizer).
    param_names: dict[str, str] = field(default_factory=dict)
    tools: ToolCalling | None = None  # chat: the tools the model may call, and how
    reasoning: str | None = None  # chat: the --reasoning-parser that splits reasoning_content off
    echo: bool = False  # completions: the prompt comes first in the answer
    prompt_logprobs: int | None = None  # completions (vLLM's): the prompt's logprobs, top N
    inputs: list[str | list[int]] | None = None  # embeddings: one text or token ids per choice
    # completions: a list of several prompts, each its own request (relay.api.batched_prompts);
    # text and input_ids are the first's
    prompts: list[Prompt] | None = None


# ---- typed field access --------------------------------------------------------------------


def as_int(value: Any, param: str, lo: int, hi: int, what: str | None = None) -> int:
    return _as(Range(lo, hi, integer=True, what=what), value, param)


def as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad(param, f"'{param}' must be a boolean, got {show(value)}")
    return value


def as_dict(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(param, f"'{param}' must be an object, got {show(value)}")
    return value


def as_token_ids(
    value: Any, param: str, allow_empty: bool, vocab_size: int | None = None
) -> list[int]:
    if not isinstance(value, list):
        raise bad(param, f"'{param}' must be a list of token ids, got {show(value)}")
    if not value and not allow_empty:
        raise bad(param, f"'{param}' must not be empty")
    limit = vocab_size or _I32
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad(
                param, f"'{param}' must hold token ids (integers >= 0); item {i} is {show(t)}"
            )
        if t >= limit:
            raise bad(
                param, f"'{param}' item {i} is {show(t)}, outside the vocabulary [0, {limit})"
            )
    return value


def opt(body: dict[str, Any], key: str, default: Any, convert: Callable[[Any, str], Any]) -> Any:
    value = body.get(key)
    return default if value is None else convert(value, key)


def priority(body: dict[str, Any]) -> int:
    return opt(body, "priority", 0, lambda v, p: as_int(v, p, -_I32, _I32 - 1))


def _as(rule: Range, value: Any, param: str) -> Any:
    if not rule.holds(value):
        kind = "an integer" if rule.integer else "a number"
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (rule.integer and isinstance(value, float))
        ):
            raise bad(param, f"'{param}' must be {kind}, got {show(value)}")
        raise bad(param, f"'{param}' must be {rule.describe()}, got {show(value)}")
    return float(value) if not rule.integer else value


def ranged(name: str, rule: Range | None = None) -> Callable[[Any, str], Any]:
    rule = rule or RANGES[name]
    return lambda value, param: _as(rule, value, param)


def _as_stop(value: Any, param: str) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise bad(param, f"'{param}' must be a string or a list of strings, got {show(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(param, f"'{param}' allows at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise bad(param, f"'{param}' must hold non-empty strings, got {show(s)}")
    return list(stops)


def _as_stop_ids(value: Any, param: str) -> list[int]:
    ids = as_token_ids(value, param, allow_empty=True)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(param, f"'{param}' allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return list(ids)


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def _as_logit_bias(value: Any, param: str) -> dict[int, float]:
    """OpenAI's logit_bias: {"<token id>": bias}, JSON keys being strings; the ids' vocabulary
    check is SamplingParams.validate's (it knows the model)."""
    biases = as_dict(value, param)
    if len(biases) > MAX_LOGIT_BIAS:
        raise bad(param, f"'{param}' allows at most {MAX_LOGIT_BIAS} tokens, got {len(biases)}")
    rule, (lo, hi) = Range(*LOGIT_BIAS_RANGE), LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, bias in biases.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad(
                param, f"'{param}' keys must be token ids (decimal integers >= 0), got {show(key)}"
            )
        if not rule.holds(bias):
            raise bad(
                param,
                f"'{param}' values must be numbers in [{lo:g}, {hi:g}]; token {key} has {show(bias)}",
            )
        out[int(key)] = float(bias)
    return out


# SamplingParams field -> converter(value, param) that type- and range-checks one value.
FIELD_RULES: dict[str, Callable[[Any, str], Any]] = {
    **{name: ranged(name) for name in RANGES},
    "stop": _as_stop,
    "stop_token_ids": _as_stop_ids,
    "ignore_eos": as_bool,
    "skip_special_tokens": as_bool,
    "include_stop_str_in_output": as_bool,
    "logit_bias": _as_logit_bias,
}


def sampling_kwargs(
    body: dict[str, Any],
    keys: dict[str, str],
    rules: dict[str, Callable[[Any, str], Any]],
    prefix: str = "",
) -> dict[str, Any]:
    """SamplingParams keyword arguments from the API keys present in body (key -> field)."""
    return {
        name: rules[name](body[key], prefix + key)
        for key, name in keys.items()
        if body.get(key) is not None
    }


def validated(
    params: SamplingParams,
    names: dict[str, str],
    vocab_size: int | None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> SamplingParams:
    """Run SamplingParams.validate(), reporting failures under the API's field names."""
    try:
        return params.validate(
            vocab_size, max_constraint_bytes, max_constraint_depth, max_constraint_properties
        )
    except InvalidParam as e:
        # Rename only in the "<field> <rule>" head: the ", got <value>" tail may quote user text.
        head, sep, tail = str(e).partition(", got ")
        head = re.sub(r"\w+", lambda m: names.get(m.group(), m.group()), head)
        raise bad(names.get(e.field, e.field), head + sep + tail) from None


# ---- constrained decoding ------------------------------------------------------------------

# API key -> SamplingParams constraint: SGLang's names, and vLLM's guided_* ones.
CONSTRAINT_KEYS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
}
ANY_JSON_OBJECT = '{"type": "object"}'


def constraint(
    body: dict[str, Any], prefix: str = "", response_format: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """The output constraint a body asks for, as (SamplingParams kwargs, {field: API key});
    at most one of the constraint keys and (OpenAI routes) a JSON response_format."""
    given: dict[str, tuple[str, str]] = {}
    for key, kind in CONSTRAINT_KEYS.items():
        value = body.get(key)
        if value is None:
            continue
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            what = (
                "a JSON schema (an object or its JSON text)"
                if kind == "json_schema"
                else "a non-empty string"
            )
            raise bad(prefix + key, f"'{prefix + key}' must be {what}, got {show(value)}")
        given[prefix + key] = (kind, value)
    if response_format:
        given.update(_response_format(body.get("response_format")))
    if len(given) > 1:
        raise bad(list(given)[1], f"give at most one output constraint; got {', '.join(given)}")
    return {kind: text for kind, text in given.values()}, {
        kind: key for key, (kind, _) in given.items()
    }


def _response_format(value: Any) -> dict[str, tuple[str, str]]:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if value is None:
        return {}
    rf = as_dict(value, "response_format")
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": ("json_schema", ANY_JSON_OBJECT)}
    if kind != "json_schema":
        raise bad(
            "response_format.type",
            "'response_format.type' must be one of text, json_object, json_schema, "
            f"got {show(kind)}",
        )
    spec = as_dict(rf.get("json_schema"), "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:
        return {"response_format.json_schema": ("json_schema", ANY_JSON_OBJECT)}
    as_dict(schema, "response_format.json_schema.schema")
    if spec.get("strict") is not None:
        as_bool(spec["strict"], "response_format.json_schema.strict")  # always strict here
    return {"response_format.json_schema.schema": ("json_schema", json.dumps(schema))}
