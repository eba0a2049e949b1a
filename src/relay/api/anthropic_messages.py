"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A thin translation onto chat completions: the body becomes the chat request it amounts to
(relay.api.anthropic_request), is submitted as one, and its output is answered as Anthropic
content blocks, whole or as Anthropic's event stream (relay.api.anthropic_output). Errors are
Anthropic's shape ({"type": "error", "error": {"type", "message"}}), the message naming the
field. With --api-key, Anthropic clients' `x-api-key` header is accepted (relay.api.guard).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from relay.api.anthropic_output import error_response, message, message_events
from relay.api.anthropic_request import parse_anthropic
from relay.api.docs import ANTHROPIC_ERROR_RESPONSES, request_body
from relay.api.errors import ProtocolError
from relay.api.json_body import decode_json_body
from relay.api.output_blocks import whole_blocks
from relay.api.parsed_request import ParsedRequest
from relay.api.serving import EngineClient, Usage, refuse_if_embedding, streamed, whole
from relay.text.tokenize_query import TokenizeQuery


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post(
        "/v1/messages", openapi_extra=request_body("messages"), responses=ANTHROPIC_ERROR_RESPONSES
    )
    async def messages(request: Request):
        return await _serve(request, client)

    @app.post(
        "/v1/messages/count_tokens",
        openapi_extra=request_body("count_tokens"),
        responses=ANTHROPIC_ERROR_RESPONSES,
    )
    async def count_tokens(request: Request):
        """The prompt's size as /v1/messages would render it: the chat template, its tools
        included, done by a tokenizer process."""
        try:
            parsed = await _parse(request, client, counting=True)
            query = TokenizeQuery(  # special tokens as generation adds them to a chat: none
                "tokenize",
                messages=parsed.messages,
                chat_kwargs=parsed.chat_kwargs,
                add_special_tokens=False,
            )
            out = await client.tokenizer_call(query)
        except ProtocolError as e:
            return error_response(e)
        return {"input_tokens": len(out["tokens"])}


async def _parse(request: Request, client: EngineClient, counting: bool = False) -> ParsedRequest:
    refuse_if_embedding(client)
    return parse_anthropic(
        decode_json_body(await request.body()),
        client.served_model,
        counting=counting,
        vocab_size=client.vocab_size,
        max_constraint_bytes=client.max_constraint_bytes,
        max_constraint_depth=client.max_constraint_depth,
        max_constraint_properties=client.max_constraint_properties,
        reasoning_parser=client.reasoning_parser,
        tool_call_parser=client.tool_call_parser,
    )


async def _serve(request: Request, client: EngineClient):
    try:
        parsed = await _parse(request, client)
        api = client.submit(parsed, "msg")
    except ProtocolError as e:
        return error_response(e)
    model = client.served_model
    if parsed.stream:

        def events(outs):
            return message_events(outs, parsed, api.rid, model)

        return await streamed(client, api, request, events, on_error=error_response)
    done = await whole(client, api, request, on_error=error_response)
    if not isinstance(done, list):
        return done
    (r,) = done
    blocks, finish_reason = whole_blocks(parsed.tools, parsed.reasoning, r.text, r.finish_reason)
    return message(api.rid, model, blocks, finish_reason, r.matched_stop, Usage.of([r]))
