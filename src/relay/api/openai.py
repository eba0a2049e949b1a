"""OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models.

Each route reads top to bottom: parse the body (a 4xx naming the field when it is bad),
submit it, answer whole or as SSE chunks. The parsers and builders are pure functions.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request

from relay.api import batched_prompts
from relay.api import fields as F
from relay.api import tool_calls as T
from relay.api.chat_output import ChatOutput, piece_delta, whole_message
from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.fields import ParsedRequest, ProtocolError, bad, show
from relay.api.prompt_output import (
    PromptView,
    echo_logprobs,
    legacy_top,
    logprob,
    vllm_prompt_logprobs,
)
from relay.api.reasoning import REASONING_PARSERS
from relay.api.serving import (
    SSE_DONE,
    Choice,
    EngineClient,
    Usage,
    error_response,
    refuse_if_embedding,
    sse,
    streamed,
    whole,
)
from relay.api.tool_parsers import NEEDS_SPECIAL_TOKENS
from relay.outputs import RequestOutput
from relay.sampling_params import MAX_NEW_TOKENS, MAX_TOP_LOGPROBS, Range, SamplingParams
from relay.text.tokenize_query import TokenizeQuery

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
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
# OpenAI caps temperature at 2 (SGLang's native API does not).
_RULES = {**F.FIELD_RULES, "temperature": F.ranged("temperature", Range(0, 2))}
# A chat answer has at least one token; a completion may have none (echo's prompt logprobs).
_CHAT_MAX_TOKENS = F.ranged("max_new_tokens", Range(1, MAX_NEW_TOKENS, integer=True))
# OpenAI body key -> SamplingParams field (max_tokens and logprobs are handled apart).
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
    # vLLM/SGLang extras that OpenAI SDKs pass through via extra_body
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "logit_bias": "logit_bias",
}


# ---- routes --------------------------------------------------------------------------------


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post(
        "/v1/completions", openapi_extra=request_body("completion"), responses=ERROR_RESPONSES
    )
    async def completions(request: Request):
        return await _serve(request, client, parse_completion, "completion")

    @app.post("/v1/chat/completions", openapi_extra=request_body("chat"), responses=ERROR_RESPONSES)
    async def chat_completions(request: Request):
        parse = functools.partial(
            parse_chat,
            reasoning_parser=client.reasoning_parser,
            tool_call_parser=client.tool_call_parser,
        )
        return await _serve(request, client, parse, "chat")

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": client.served_model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "relay",
                    "max_model_len": client.context_len,
                }
            ],
        }


async def _serve(
    request: Request, client: EngineClient, parse: Callable[..., ParsedRequest], kind: str
):
    try:
        refuse_if_embedding(client)
        parsed = parse(
            F.decode_json_body(await request.body()),
            client.served_model,
            vocab_size=client.vocab_size,
            max_constraint_bytes=client.max_constraint_bytes,
            max_constraint_depth=client.max_constraint_depth,
            max_constraint_properties=client.max_constraint_properties,
        )
        if parsed.prompts is not None:  # several prompts: relay.api.batched_prompts
            return await batched_prompts.serve(request, client, parsed)
        view = await prompt_view(client, parsed) if kind == "completion" else None
        api = client.submit(parsed, kind)
    except ProtocolError as e:
        return error_response(e)
    created, model = int(time.time()), client.served_model
    if parsed.stream:
        return await streamed(
            client,
            api,
            request,
            lambda outs: _events(outs, kind, api.rid, created, model, parsed, view),
        )
    done = await whole(client, api, request)
    if not isinstance(done, list):
        return done
    if kind == "completion":
        return completion_response(api.rid, created, model, done, view)
    return chat_response(api.rid, created, model, done, parsed.tools, parsed.reasoning)


async def prompt_view(client: EngineClient, parsed: ParsedRequest) -> PromptView:
    """What a completion shows of its prompt; a token-id prompt's text for echo comes from the
    tokenizer process (special tokens included, as /detokenize gives it)."""
    text = parsed.text
    if parsed.echo and text is None:
        try:
            out = await client.tokenizer_call(TokenizeQuery("detokenize", tokens=parsed.input_ids))
        except ProtocolError as e:
            # The parser checked the ids; a refusal now is about their number: the prompt's.
            raise ProtocolError(e.status, e.message, e.param and "prompt", e.type) from None
        text = out["prompt"]
    return PromptView(
        echo_text=text if parsed.echo else None,
        echo_logprobs=parsed.params.top_logprobs
        if parsed.echo and parsed.params.logprobs
        else None,
        prompt_logprobs=parsed.prompt_logprobs,
    )


async def _events(
    outs: AsyncIterator[Choice],
    kind: str,
    rid: str,
    created: int,
    model: str,
    parsed: ParsedRequest,
    view: PromptView | None = None,
) -> AsyncIterator[bytes]:
    started = [False] * parsed.n
    offsets = [0] * parsed.n  # text_offset of each choice's next chunk (completions logprobs)
    last: list[RequestOutput | None] = [None] * parsed.n
    parsing = parsed.tools is not None or parsed.reasoning is not None
    outputs = (
        [ChatOutput(parsed.tools, parsed.reasoning) for _ in range(parsed.n)] if parsing else None
    )
    async for index, r in outs:
        if r.error is not None:
            yield sse(F.error_body(r.status, r.error, r.param))
            return
        if kind == "completion":
            prompt = None if started[index] else view  # the prompt comes in the first chunk
            chunk = completion_chunk(rid, created, model, index, r, offsets[index], prompt)
            yield sse(chunk)
            offsets[index] += len(chunk["choices"][0]["text"])
        elif outputs is None:
            yield sse(chat_chunk(rid, created, model, index, r, first=not started[index]))
        else:
            for chunk in parsed_chat_chunks(
                rid, created, model, index, r, outputs[index], first=not started[index]
            ):
                yield sse(chunk)
        started[index], last[index] = True, r
    if parsed.include_usage:
        yield sse(usage_chunk(kind, rid, created, model, Usage.of(last)))
    yield SSE_DONE


# ---- parsing -------------------------------------------------------------------------------


def check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {show(model)}")
    if model != served_model:
        raise ProtocolError(
            404,
            f"The model `{model[:100]}` does not exist; this server serves `{served_model}`.",
            "model",
            "not_found_error",
        )


def _reject_unsupported(
    body: dict[str, Any], unsupported: dict[str, Callable[[Any], bool]]
) -> None:
    """Refuse fields whose effect we would silently drop; each field's test says which of its
    values ask for nothing (and pass); absent or null always passes."""
    for key, is_noop in unsupported.items():
        value = body.get(key)
        if value is not None and not is_noop(value):
            raise bad(key, f"'{key}' is not supported by this server")


def _refused(value: Any) -> bool:
    """The test of a field refused whatever its value."""
    return False


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = F.opt(body, "stream", False, F.as_bool)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return stream, F.opt(
        F.as_dict(options, "stream_options"),
        "include_usage",
        False,
        lambda v, _: F.as_bool(v, "stream_options.include_usage"),
    )


def _common(body: dict[str, Any], served_model: str, max_n: int) -> dict[str, Any]:
    """Fields the two endpoints share, as ParsedRequest keyword arguments."""
    check_model(body, served_model)
    stream, include_usage = _stream_fields(body)
    return {
        "stream": stream,
        "include_usage": include_usage,
        "priority": F.priority(body),
        "n": F.opt(body, "n", 1, lambda v, p: F.as_int(v, p, 1, max_n)),
    }


def _max_tokens(
    body: dict[str, Any], keys: tuple[str, ...], rule: Callable[[Any, str], Any]
) -> tuple[str, int | None]:
    """The first of `keys` that is set, and its value; every set key is checked by rule."""
    given = [(k, rule(body[k], k)) for k in keys if body.get(k) is not None]
    return given[0] if given else (keys[0], None)


def _completion_logprobs(body: dict[str, Any], echo: bool) -> dict[str, Any]:
    """logprobs N: the output tokens' (and with echo the prompt's) with the N likeliest;
    vLLM's prompt_logprobs M: the prompt's with the M likeliest. The prompt's are computed
    once, with the larger top list."""
    k = F.opt(body, "logprobs", None, lambda v, p: F.as_int(v, p, 0, MAX_TOP_LOGPROBS))
    m = F.opt(body, "prompt_logprobs", None, lambda v, p: F.as_int(v, p, 0, MAX_TOP_LOGPROBS))
    out: dict[str, Any] = {} if k is None else {"logprobs": True, "top_logprobs": k}
    prompt_tops = [n for n in (k if echo else None, m) if n is not None]
    if prompt_tops:
        out.update(logprob_start_len=0, prompt_top_logprobs=max(prompt_tops))
    return out


_COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {"suffix": lambda v: v == ""}
_COMPLETION_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "prompt_top_logprobs": "prompt_logprobs",
}


def parse_completion(
    body: Any,
    served_model: str,
    max_n: int = F.MAX_N,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> ParsedRequest:
    """POST /v1/completions. Token ids (prompt, stop_token_ids) are checked against
    vocab_size when it is given, an output constraint's size, nesting and breadth against
    max_constraint_bytes, max_constraint_depth and max_constraint_properties."""
    body = F.require_object(body)
    common = _common(body, served_model, max_n)
    _reject_unsupported(body, {**_COMPLETION_UNSUPPORTED, "best_of": lambda v: v == common["n"]})
    if body.get("prompt") is None:
        raise bad("prompt", "'prompt' is required")
    prompts = batched_prompts.parse_prompts(body["prompt"], vocab_size)
    _, max_tokens = _max_tokens(body, ("max_tokens",), F.FIELD_RULES["max_new_tokens"])
    kwargs = F.sampling_kwargs(body, _KEYS, _RULES)
    kwargs["max_new_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    echo = F.opt(body, "echo", False, F.as_bool)
    kwargs.update(_completion_logprobs(body, echo))
    grammar, param_names = F.constraint(body, response_format=True)
    params = F.validated(
        SamplingParams(**kwargs, **grammar),
        _COMPLETION_NAMES | param_names,
        vocab_size,
        max_constraint_bytes,
        max_constraint_depth,
        max_constraint_properties,
    )
    return ParsedRequest(
        params=params,
        text=prompts[0].text,
        input_ids=prompts[0].input_ids,
        prompts=prompts if len(prompts) > 1 else None,
        param_names=param_names,
        echo=echo,
        prompt_logprobs=body.get("prompt_logprobs"),
        **common,
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
    extra = F.opt(body, "chat_template_kwargs", {}, F.as_dict)
    for key in extra:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad(f"chat_template_kwargs.{key}", f"'chat_template_kwargs.{key}' may not be set")
    kwargs = dict(extra)
    add = body.get("add_generation_prompt", kwargs.get("add_generation_prompt"))
    kwargs["add_generation_prompt"] = (
        True if add is None else F.as_bool(add, "add_generation_prompt")
    )
    return kwargs


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    want = F.opt(body, "logprobs", False, F.as_bool)
    top = F.opt(body, "top_logprobs", 0, lambda v, p: F.as_int(v, p, 0, MAX_TOP_LOGPROBS))
    if top and not want:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    return {"logprobs": want, "top_logprobs": top} if want else {}


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
    max_n: int = F.MAX_N,
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
    body = F.require_object(body)
    common = _common(body, served_model, max_n)
    _reject_unsupported(body, _CHAT_UNSUPPORTED)
    messages = parse_messages(body.get("messages"))
    budget_key, max_tokens = _max_tokens(
        body, ("max_completion_tokens", "max_tokens"), _CHAT_MAX_TOKENS
    )
    kwargs = F.sampling_kwargs(body, _KEYS, _RULES)
    kwargs["max_new_tokens"] = max_tokens
    kwargs.update(_chat_logprobs(body))
    chat_kwargs = chat_template_kwargs(body)
    if chat_kwargs.get("enable_thinking") is False:
        reasoning_parser = (
            None  # the template closed an empty block in the prompt: all output is answer
        )
    tools = T.parse_tool_calling(body, tool_call_parser)
    grammar, param_names = _tool_constraint(tools, *F.constraint(body, response_format=True))
    if grammar and reasoning_parser is not None:
        # The constraint rules the answer after the reasoning, which runs free up to its close tag.
        grammar["reasoning_open"], grammar["reasoning_close"] = REASONING_PARSERS[
            reasoning_parser
        ].grammar_tags()
    if (
        tools is not None
        and tool_call_parser in NEEDS_SPECIAL_TOKENS
        and body.get("skip_special_tokens") is None
    ):
        kwargs["skip_special_tokens"] = False  # the format's call marker is a special token
    names = {
        "max_new_tokens": budget_key,
        "min_new_tokens": "min_tokens",
        "top_logprobs": "top_logprobs",
    }
    params = F.validated(
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
    return {"json_schema": json.dumps(tools.schema())}, {"json_schema": tools.schema_param()}


# ---- responses -------------------------------------------------------------------------------


def _tops(r: RequestOutput, k: int) -> list[tuple[int, str, float]]:
    """The k-th token's alternatives as (id, text, logprob)."""
    if r.top_logprobs is None or r.top_logprobs[k] is None:
        return []
    ids, lps = r.top_logprobs[k]
    return list(zip(ids, r.top_texts[k], lps))


def _completion_logprobs_body(
    r: RequestOutput, offset: int, view: PromptView | None
) -> dict[str, Any] | None:
    """Legacy completions' logprobs: the output tokens', after the prompt's with echo."""
    echoed = view is not None and view.echo_logprobs is not None
    if r.logprobs is None and not echoed:
        return None
    texts = r.token_texts or []
    lps = r.logprobs or []
    body = {
        "tokens": texts,
        "token_logprobs": [logprob(x) for x in lps],
        "top_logprobs": [
            legacy_top(_tops(r, k), r.token_ids[k], texts[k], lps[k]) for k in range(len(texts))
        ],
    }
    if echoed:
        prompt = echo_logprobs(r.prompt_logprobs, view.echo_logprobs)
        body = {key: prompt[key] + body[key] for key in body}
    offsets, pos = [], offset
    for text in body["tokens"]:
        offsets.append(pos)
        pos += len(text)
    return {**body, "text_offset": offsets}


def _completion_choice(
    index: int, r: RequestOutput, offset: int = 0, view: PromptView | None = None
) -> dict[str, Any]:
    """A choice; with a view (a request's first record only) the prompt as it asked."""
    echo = view.echo_text if view is not None and view.echo_text is not None else ""
    choice = {
        "index": index,
        "text": echo + r.text,
        "logprobs": _completion_logprobs_body(r, offset, view),
        "finish_reason": r.finish_reason,
    }
    if view is not None and view.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs, view.prompt_logprobs)
    return choice


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list[RequestOutput],
    view: PromptView | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_completion_choice(i, c, 0, view) for i, c in enumerate(choices)],
        "usage": Usage.of(choices).to_openai(),
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: RequestOutput,
    text_offset: int = 0,
    view: PromptView | None = None,
) -> dict[str, Any]:
    """A streamed completions delta; text_offset is how many characters this choice already
    streamed, so logprobs' text_offset keeps counting across chunks. A choice's first chunk
    has the view: the prompt comes first in it."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_completion_choice(index, delta, text_offset, view)],
    }


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage is set; kind "completion" | "chat"."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_openai(),
    }


def _token_entry(token: str, lp: Any) -> dict[str, Any]:
    return {"token": token, "logprob": logprob(lp), "bytes": list(token.encode("utf-8"))}


def _chat_logprobs_body(r: RequestOutput) -> dict[str, Any] | None:
    if r.logprobs is None:
        return None
    return {
        "content": [
            {
                **_token_entry(text, lp),
                "top_logprobs": [_token_entry(t, lp_t) for _, t, lp_t in _tops(r, k)],
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
