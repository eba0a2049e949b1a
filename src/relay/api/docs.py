"""The OpenAPI description of Relay's request bodies and error responses.

Routes parse their bodies themselves (OpenAI-compatible rules, errors that name the field),
so FastAPI cannot infer these schemas; they are declared here for /openapi.json, which
clients and API fuzzers (schemathesis) read. The ranges come from the parsers' own table
(relay.sampling_params.RANGES), so the documentation cannot drift from what is enforced.
"""

from __future__ import annotations

from typing import Any

from relay.api.parsed_request import MAX_INPUTS, MAX_N, MAX_PROMPTS
from relay.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
    Range,
)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI clients send null for "not set"; every optional field accepts it."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    return {
        "type": "integer",
        **({"minimum": lo} if lo is not None else {}),
        **({"maximum": hi} if hi is not None else {}),
    }


def _ranged(name: str, rule: Range | None = None) -> dict[str, Any]:
    """The JSON schema of one of relay.sampling_params.RANGES."""
    rule = rule or RANGES[name]
    return {
        "type": "integer" if rule.integer else "number",
        ("exclusiveMinimum" if rule.lo_open else "minimum"): rule.lo,
        "maximum": rule.hi,
    }


_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": _int(0)}
_PROMPT_TEXT = {"type": "string", "minLength": 1}
_PROMPT_IDS = {**_TOKEN_IDS, "minItems": 1}
_STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "maxItems": MAX_STOP_STRINGS,
        },
    ]
}

# OpenAI's logit_bias: token ids as JSON keys -> a bias (ids past the vocabulary are a 400 too).
_LOGIT_BIAS = {
    "type": "object",
    "maxProperties": MAX_LOGIT_BIAS,
    "propertyNames": {"pattern": "^[0-9]{1,10}$"},
    "additionalProperties": {
        "type": "number",
        "minimum": LOGIT_BIAS_RANGE[0],
        "maximum": LOGIT_BIAS_RANGE[1],
    },
}

_SAMPLING = {
    **{
        name: _ranged(name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "seed",
        )
    },
    "stop": _STOP,
    "stop_token_ids": {**_TOKEN_IDS, "maxItems": MAX_STOP_TOKEN_IDS},
    "min_tokens": _ranged("min_new_tokens"),
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "logit_bias": _LOGIT_BIAS,
}
# A chat answer has at least one token (a completion may have none: max_tokens 0 with echo).
_CHAT_MAX_TOKENS = _ranged("max_new_tokens", Range(1, RANGES["max_new_tokens"].hi, integer=True))
_OPENAI_COMMON = {
    "model": _STR,
    "n": _int(1, MAX_N),
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "max_tokens": _ranged("max_new_tokens"),
    "priority": _int(),
    "user": _STR,
    **_SAMPLING,
    "temperature": _ranged("temperature", Range(0, 2)),
}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": {k: v if k in required else _nullable(v) for k, v in properties.items()},
    }


_GENERATE_SAMPLING = {
    "type": "object",
    "properties": {
        "max_new_tokens": _ranged("max_new_tokens"),
        "min_new_tokens": _ranged("min_new_tokens"),
        "n": _int(1, MAX_N),
        "no_stop_trim": _BOOL,
        "sampling_seed": _ranged("seed"),
        **{
            k: v
            for k, v in _SAMPLING.items()
            if k not in ("min_tokens", "include_stop_str_in_output")
        },
    },
}


def _per_prompt(schema: dict[str, Any]) -> dict[str, Any]:
    """A /generate field: one value, or (a batch) a list of one per prompt."""
    return {
        "anyOf": [
            schema,
            {"type": "array", "items": schema, "minItems": 1, "maxItems": MAX_PROMPTS},
        ]
    }


_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": _STR},
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        "name": _STR,
        "tool_calls": {"type": "array"},
        "tool_call_id": _STR,
    },
}

_ANTHROPIC_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [_STR, {"type": "array", "items": {"type": "object"}}]},
    },
}
_ANTHROPIC = {
    "model": _STR,
    "messages": {"type": "array", "items": _ANTHROPIC_MESSAGE, "minItems": 1},
    "max_tokens": _CHAT_MAX_TOKENS,
    "system": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
    "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "stream": _BOOL,
    "temperature": _ranged("temperature", Range(0, 1)),
    "top_p": _ranged("top_p"),
    "top_k": _ranged("top_k"),
    "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"type": "object"},
    "thinking": {"type": "object"},
    "metadata": {"type": "object"},
}

BODIES: dict[str, dict[str, Any]] = {
    "completion": _object(
        {
            "prompt": {
                "anyOf": [
                    _PROMPT_TEXT,
                    _PROMPT_IDS,
                    {
                        "type": "array",
                        "items": {"anyOf": [_PROMPT_TEXT, _PROMPT_IDS]},
                        "minItems": 1,
                        "maxItems": MAX_PROMPTS,
                    },
                ]
            },
            "logprobs": _ranged("top_logprobs"),
            "echo": _BOOL,
            "prompt_logprobs": _ranged("prompt_top_logprobs"),
            "best_of": _int(1, MAX_N),
            "suffix": _STR,
            **_OPENAI_COMMON,
        },
        ["prompt"],
    ),
    "chat": _object(
        {
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
            "max_completion_tokens": _CHAT_MAX_TOKENS,
            "logprobs": _BOOL,
            "top_logprobs": _ranged("top_logprobs"),
            "chat_template_kwargs": {"type": "object"},
            "add_generation_prompt": _BOOL,
            "response_format": {"type": "object"},
            "tools": {"type": "array"},
            "tool_choice": {},
            "parallel_tool_calls": _BOOL,
            **_OPENAI_COMMON,
            "max_tokens": _CHAT_MAX_TOKENS,
        },
        ["messages"],
    ),
    # One prompt, or a batch (SGLang's): a list of prompts, and each per-prompt field one value
    # for all or a list of one per prompt.
    "generate": _object(
        {
            "text": _per_prompt(_PROMPT_TEXT),
            "input_ids": _per_prompt(_PROMPT_IDS),
            "sampling_params": _per_prompt(_GENERATE_SAMPLING),
            "stream": _BOOL,
            "rid": _per_prompt({"type": "string", "minLength": 1, "maxLength": 256}),
            "return_logprob": _per_prompt(_BOOL),
            "top_logprobs_num": _per_prompt(_ranged("top_logprobs")),
            "logprob_start_len": _per_prompt(_ranged("logprob_start_len")),
            "priority": _int(),
        },
        [],
    ),
    "abort": _object({"rid": {"type": "string", "minLength": 1}}, ["rid"]),
    # vLLM's: a text or a chat, one of the two.
    "tokenize": _object(
        {
            "model": _STR,
            "prompt": _STR,
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
            "add_special_tokens": _BOOL,
            "add_generation_prompt": _BOOL,
            "continue_final_message": _BOOL,
            "chat_template_kwargs": {"type": "object"},
            "tools": {"type": "array"},
            "tool_choice": {},
            "return_token_strs": _BOOL,
        },
        [],
    ),
    "detokenize": _object({"model": _STR, "tokens": _TOKEN_IDS}, ["tokens"]),
    # OpenAI's: a text, texts, token ids, or lists of token ids (an --is-embedding server).
    "embeddings": _object(
        {
            "input": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "minItems": 1,
                        "maxItems": MAX_INPUTS,
                    },
                    {**_TOKEN_IDS, "minItems": 1},
                    {
                        "type": "array",
                        "items": {**_TOKEN_IDS, "minItems": 1},
                        "minItems": 1,
                        "maxItems": MAX_INPUTS,
                    },
                ]
            },
            "model": _STR,
            "encoding_format": {"enum": ["float", "base64"]},
            "dimensions": _int(1),
            "user": _STR,
        },
        ["input"],
    ),
    # OpenAI's Responses API (relay.api.responses): input a string or a list of items.
    "responses": _object(
        {
            "model": _STR,
            "input": {
                "anyOf": [_STR, {"type": "array", "items": {"type": "object"}, "minItems": 1}]
            },
            "instructions": _STR,
            "previous_response_id": _STR,
            "store": _BOOL,
            "stream": _BOOL,
            "max_output_tokens": _CHAT_MAX_TOKENS,
            "temperature": _ranged("temperature", Range(0, 2)),
            "top_p": _ranged("top_p"),
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {},
            "parallel_tool_calls": _BOOL,
            "text": {"type": "object", "properties": {"format": {"type": "object"}}},
            "reasoning": {"type": "object"},
            "metadata": {"type": "object"},
            "include": {"type": "array", "items": _STR},
            "truncation": {"enum": ["disabled"]},
            "user": _STR,
        },
        ["input"],
    ),
    # Anthropic's Messages API (relay.api.anthropic_messages).
    "messages": _object(_ANTHROPIC, ["model", "messages", "max_tokens"]),
    "count_tokens": _object(
        {k: v for k, v in _ANTHROPIC.items() if k != "max_tokens"}, ["model", "messages"]
    ),
}


def request_body(kind: str) -> dict[str, Any]:
    """openapi_extra for a route whose JSON body is BODIES[kind]."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": BODIES[kind]}}}
    }


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "object": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": _nullable(_STR),
                "code": {"type": "integer"},
            },
        },
    },
}
_WHY = {
    400: "The request is malformed; `error.param` names the field.",
    401: "Missing or wrong API key.",
    403: "Cross-origin request refused.",
    404: "Unknown model or path.",
    405: "Wrong method.",
    408: "The body did not arrive in time.",
    413: "The body exceeds --max-request-body-bytes.",
    415: "The body is not JSON.",
    500: "The server failed this request.",
    503: "Overloaded, unhealthy or shutting down.",
    504: "A server process did not answer in time.",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": why, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    for code, why in _WHY.items()
}
# Anthropic's error shape (/v1/messages): the message names the field at fault.
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": _STR, "message": _STR},
        },
    },
}
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": why, "content": {"application/json": {"schema": ANTHROPIC_ERROR_SCHEMA}}}
    for code, why in _WHY.items()
}
METRICS_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format.",
        "content": {"text/plain": {"schema": _STR}},
    }
}
