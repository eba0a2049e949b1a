"""OpenAI-compatible API: the routes /v1/completions, /v1/chat/completions, /v1/models.

Each route reads top to bottom: parse the body (a 4xx naming the field when it is bad),
submit it, answer whole or as SSE chunks. The parsers and builders are pure functions, one
module per endpoint (relay.api.completions, relay.api.chat); what both share is in
relay.api.openai_common.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request

from relay.api import batched_prompts
from relay.api.chat import chat_chunk, chat_response, parse_chat, parsed_chat_chunks
from relay.api.chat_output import ChatOutput
from relay.api.completions import (
    completion_chunk,
    completion_response,
    parse_completion,
    prompt_view,
)
from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.errors import ProtocolError, error_body
from relay.api.json_body import decode_json_body
from relay.api.openai_common import usage_chunk
from relay.api.parsed_request import ParsedRequest
from relay.api.prompt_output import PromptView
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
from relay.outputs import RequestOutput


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
            decode_json_body(await request.body()),
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
            yield sse(error_body(r.status, r.error, r.param))
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
