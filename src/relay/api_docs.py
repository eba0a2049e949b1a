"""The OpenAPI description of Relay's request bodies and error responses.

Handlers parse their bodies themselves (relay.protocol: OpenAI-compatible rules, errors
that name the field), so FastAPI cannot infer these schemas; they are declared here for
/openapi.json, which clients and API fuzzers (schemathesis) read. The ranges are the
parsers' own constants, so the documentation cannot drift from what is enforced.
"""
from __future__ import annotations

from typing import Any

from relay import protocol as P
from relay.sampling_params import MAX_TOP_LOGPROBS


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI clients send null for "not set"; every optional field accepts it."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    return {"type": "integer", **({"minimum": lo} if lo is not None else {}),
            **({"maximum": hi} if hi is not None else {})}


def _num(lo: float, hi: float, exclusive_lo: bool = False) -> dict[str, Any]:
    return {"type": "number", ("exclusiveMinimum" if exclusive_lo else "minimum"): lo, "maximum": hi}


_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": _int(0)}
_STOP = {"anyOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": P.MAX_STOP_STRINGS}]}

_SAMPLING = {
    "temperature": _num(0, 2), "top_p": _num(0, 1, exclusive_lo=True), "top_k": _int(-1),
    "min_p": _num(0, 1), "repetition_penalty": _num(0, 10, exclusive_lo=True),
    "frequency_penalty": _num(-2, 2), "presence_penalty": _num(-2, 2), "seed": _int(),
    "stop": _STOP, "stop_token_ids": {**_TOKEN_IDS, "maxItems": P.MAX_STOP_TOKEN_IDS},
    "min_tokens": _int(0, P.MAX_TOKENS_LIMIT), "ignore_eos": _BOOL, "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
}
_OPENAI_COMMON = {
    "model": _STR, "n": _int(1, 16), "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "max_tokens": _int(1, P.MAX_TOKENS_LIMIT), "priority": _int(), "user": _STR,
    **_SAMPLING,
}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": required,
            "properties": {k: v if k in required else _nullable(v) for k, v in properties.items()}}


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
    "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
    "name": _STR,
}}

BODIES: dict[str, dict[str, Any]] = {
    "completion": _object({
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1}]},
        "logprobs": _int(0, MAX_TOP_LOGPROBS), "echo": _BOOL, "best_of": _int(1, 16), "suffix": _STR,
        "logit_bias": {"type": "object"}, **_OPENAI_COMMON,
    }, ["prompt"]),
    "chat": _object({
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": _int(1, P.MAX_TOKENS_LIMIT), "logprobs": _BOOL,
        "top_logprobs": _int(0, MAX_TOP_LOGPROBS), "chat_template_kwargs": {"type": "object"},
        "add_generation_prompt": _BOOL, "response_format": {"type": "object"}, "tools": {"type": "array"},
        "tool_choice": {}, "logit_bias": {"type": "object"}, **_OPENAI_COMMON,
    }, ["messages"]),
    "generate": _object({
        "text": {"type": "string", "minLength": 1}, "input_ids": {**_TOKEN_IDS, "minItems": 1},
        "sampling_params": {"type": "object", "properties": {
            "max_new_tokens": _int(1, P.MAX_TOKENS_LIMIT), "min_new_tokens": _int(0, P.MAX_TOKENS_LIMIT),
            "n": _int(1, 16), "no_stop_trim": _BOOL, "sampling_seed": _int(),
            **{k: v for k, v in _SAMPLING.items() if k not in ("min_tokens", "include_stop_str_in_output")},
            "temperature": _num(0, 100)}},
        "stream": _BOOL, "rid": {"type": "string", "minLength": 1, "maxLength": 256},
        "return_logprob": _BOOL, "top_logprobs_num": _int(0, MAX_TOP_LOGPROBS), "priority": _int(),
    }, []),
    "abort": _object({"rid": {"type": "string", "minLength": 1}}, ["rid"]),
}


def request_body(kind: str) -> dict[str, Any]:
    """openapi_extra for a route whose JSON body is BODIES[kind]."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": BODIES[kind]}}}}


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {
    "object": {"const": "error"},
    "error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": _STR, "type": _STR, "param": _nullable(_STR), "code": {"type": "integer"}}}}}
_WHY = {400: "The request is malformed; `error.param` names the field.", 401: "Missing or wrong API key.",
        403: "Cross-origin request refused.", 404: "Unknown model or path.", 405: "Wrong method.",
        408: "The body did not arrive in time.", 413: "The body exceeds --max-request-body-bytes.",
        415: "The body is not JSON.", 500: "The server failed this request.",
        503: "Overloaded, unhealthy or shutting down.", 504: "A server process did not answer in time."}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": why, "content": {"application/json": {"schema": ERROR_SCHEMA}}} for code, why in _WHY.items()
}
METRICS_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format.", "content": {"text/plain": {"schema": _STR}}},
}
