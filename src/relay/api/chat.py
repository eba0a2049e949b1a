"""/v1/chat/completions: the request (messages, logprobs, tools, a reasoning parser, an output
constraint) and the response, whole or as streamed chunks; with tools or a reasoning parser, the
output is split into reasoning_content, content and tool calls (relay.api.chat_output)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from relay.api import sampling_fields
from relay.api import tool_calls as T
from relay.api.chat_messages import chat_template_kwargs, parse_messages
from relay.api.chat_output import ChatOutput, piece_delta, whole_message
from relay.api.errors import bad
from relay.api.json_body import require_object
from relay.api.openai_common import (
    OPENAI_RULES,
    SAMPLING_KEYS,
    common_fields,
    max_tokens_field,
    reject_unsupported,
    top_alternatives,
)
from relay.api.parsed_request import MAX_N, ParsedRequest
from relay.api.prompt_output import logprob
from relay.api.reasoning import REASONING_PARSERS
from relay.api.sampling_fields import sampling_kwargs, validated
from relay.api.serving import Usage
from relay.api.tool_parsers import HARMONY, NEEDS_SPECIAL_TOKENS
from relay.api.typed_fields import as_bool, as_int, opt, ranged
from relay.outputs import RequestOutput
from relay.sampling_params import MAX_NEW_TOKENS, MAX_TOP_LOGPROBS, Range, SamplingParams

# A chat answer has at least one token; a completion may have none (echo's prompt logprobs).
_CHAT_MAX_TOKENS = ranged("max_new_tokens", Range(1, MAX_NEW_TOKENS, integer=True))


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    want = opt(body, "logprobs", False, as_bool)
    top = opt(body, "top_logprobs", 0, lambda v, p: as_int(v, p, 0, MAX_TOP_LOGPROBS))
    if top and not want:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    return {"logprobs": want, "top_logprobs": top} if want else {}


def _refused(value: Any) -> bool:
    """The test of a field refused whatever its value."""
    return False


# The legacy `functions` / `function_call` pair is refused in any form, "none" and [] too (docs/api.md): a
# client that sends it expects its calls back in `function_call`, which this server never answers; use tools.
_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v is False,
    "functions": _refused,
    "function_call": _refused,
}


def parse_chat(
    body: Any,
    served_model: str,
    max_n: int = MAX_N,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str = "hermes",
) -> ParsedRequest:
    """POST /v1/chat/completions. Without max_tokens the answer may fill the context.
    reasoning_parser and tool_call_parser: the server's --reasoning-parser and
    --tool-call-parser (relay.api.reasoning, relay.api.tool_parsers)."""
    body = require_object(body)
    common = common_fields(body, served_model, max_n)
    reject_unsupported(body, _CHAT_UNSUPPORTED)
    messages = parse_messages(body.get("messages"))
    budget_key, max_tokens = max_tokens_field(
        body, ("max_completion_tokens", "max_tokens"), _CHAT_MAX_TOKENS
    )
    kwargs = sampling_kwargs(body, SAMPLING_KEYS, OPENAI_RULES)
    kwargs["max_new_tokens"] = max_tokens
    kwargs.update(_chat_logprobs(body))
    chat_kwargs = chat_template_kwargs(body)
    if chat_kwargs.get("enable_thinking") is False:
        reasoning_parser = (
            None  # the template closed an empty block in the prompt: all output is answer
        )
    if tool_call_parser == HARMONY:
        # gpt-oss's channels carry the reasoning: the harmony parser splits it off, tools or not.
        reasoning_parser = HARMONY
    tools = T.parse_tool_calling(body, tool_call_parser)
    grammar, param_names = _tool_constraint(
        tools, *sampling_fields.constraint(body, response_format=True)
    )
    if grammar and reasoning_parser in REASONING_PARSERS:
        # The constraint rules the answer after the reasoning, which runs free up to its close tag.
        grammar["reasoning_open"], grammar["reasoning_close"] = REASONING_PARSERS[
            reasoning_parser
        ].grammar_tags()
    if (
        (tools is not None or tool_call_parser == HARMONY)
        and tool_call_parser in NEEDS_SPECIAL_TOKENS
        and body.get("skip_special_tokens") is None
    ):
        kwargs["skip_special_tokens"] = False  # the format's markers are special tokens
    names = {
        "max_new_tokens": budget_key,
        "min_new_tokens": "min_tokens",
        "top_logprobs": "top_logprobs",
    }
    params = validated(
        SamplingParams(**kwargs, **grammar),
        names | param_names,
        vocab_size,
        max_constraint_bytes,
        max_constraint_depth,
        max_constraint_properties,
    )
    if tools is not None:
        chat_kwargs["tools"] = tools.template_tools()
    return ParsedRequest(
        params=params,
        messages=messages,
        chat_kwargs=chat_kwargs,
        param_names=param_names,
        tools=tools,
        reasoning=reasoning_parser,
        **common,
    )


def _tool_constraint(
    tools: T.ToolCalling | None, grammar: dict[str, str], param_names: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The output constraint: a forced tool call's schema replaces none the client gave, since
    only one grammar can rule the output. With "auto" a client's constraint stands, and calls
    are still read from its output."""
    if tools is None or not tools.constrained:
        return grammar, param_names
    if param_names:
        key = next(iter(param_names.values()))
        raise bad(
            key,
            f"'{key}' cannot be combined with tool_choice \"required\" or a named function, whose "
            "call already constrains the output",
        )
    if tools.native_forced:  # the call written in the parser's own format
        return {"structural_tag": tools.structural_tag()}, {"structural_tag": tools.schema_param()}
    return {"json_schema": json.dumps(tools.schema())}, {"json_schema": tools.schema_param()}


# ---- the response ----------------------------------------------------------------------------


def _token_entry(token: str, lp: Any) -> dict[str, Any]:
    return {"token": token, "logprob": logprob(lp), "bytes": list(token.encode("utf-8"))}


def _chat_logprobs_body(r: RequestOutput) -> dict[str, Any] | None:
    if r.logprobs is None:
        return None
    return {
        "content": [
            {
                **_token_entry(text, lp),
                "top_logprobs": [_token_entry(t, lp_t) for _, t, lp_t in top_alternatives(r, k)],
            }
            for k, (text, lp) in enumerate(zip(r.token_texts or [], r.logprobs))
        ]
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: list[RequestOutput],
    tools: T.ToolCalling | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A whole chat answer; with tools, each choice's calls are parsed out of its text, and with
    a reasoning parser its reasoning is split off into reasoning_content."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_chat_choice(i, c, tools, reasoning) for i, c in enumerate(choices)],
        "usage": Usage.of(choices).to_openai(),
    }


def _chat_choice(
    index: int, r: RequestOutput, tools: T.ToolCalling | None, reasoning: str | None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": r.text}
    finish_reason = r.finish_reason
    if tools is not None or reasoning is not None:
        message, finish_reason = whole_message(tools, reasoning, r.text, r.finish_reason)
    return {
        "index": index,
        "message": message,
        "logprobs": _chat_logprobs_body(r),
        "finish_reason": finish_reason,
    }


def chat_chunk(
    rid: str, created: int, model: str, index: int, delta: RequestOutput, first: bool
) -> dict[str, Any]:
    """A streamed chat delta; the first chunk of each choice announces the assistant role."""
    # A finishing chunk with no new text carries an empty delta, as OpenAI sends it.
    body: dict[str, Any] = {"role": "assistant"} if first else {}
    if first or delta.text:
        body["content"] = delta.text
    return _chat_chunk(
        rid, created, model, index, body, _chat_logprobs_body(delta), delta.finish_reason
    )


def parsed_chat_chunks(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: RequestOutput,
    stream: ChatOutput,
    first: bool,
) -> list[dict[str, Any]]:
    """The chunks of one streamed record of a request whose output is parsed (tools, or a
    reasoning parser); none while the stream holds back everything so far: reasoning_content
    and content deltas, and calls as OpenAI streams them, a call's id and name with empty
    arguments, then its arguments in pieces. Constrained calls (tool_choice "required" or
    named) are held until the output ends, so they arrive in the last chunks."""
    pieces = stream.feed(delta.text)
    finish_reason = None
    if delta.finished:
        rest, finish_reason = stream.finish(delta.finish_reason)
        pieces += rest
    deltas = [piece_delta(piece) for piece in pieces]
    if first:
        deltas[:1] = [{"role": "assistant", **(deltas[0] if deltas else {})}]
    logprobs = _chat_logprobs_body(delta)
    if not deltas and (logprobs is not None or delta.finished):
        deltas = [{}]
    return [
        _chat_chunk(
            rid,
            created,
            model,
            index,
            d,
            logprobs if k == 0 else None,
            finish_reason if k == len(deltas) - 1 else None,
        )
        for k, d in enumerate(deltas)
    ]


def _chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
