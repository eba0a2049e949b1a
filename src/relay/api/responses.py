"""OpenAI's Responses API: POST /v1/responses.

A thin translation onto chat completions: the body becomes the chat request it amounts to
(relay.api.responses_request), is submitted as one, and its output is answered as Responses
output items, whole or as the Responses event stream (relay.api.responses_output). Responses
asked to be stored (the default) are kept in the app's bounded store
(relay.api.responses_store, `app.state.responses`) for previous_response_id.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.errors import ProtocolError
from relay.api.json_body import decode_json_body
from relay.api.output_blocks import Block, assistant_message, whole_blocks
from relay.api.responses_output import ResponseEvents, response_object
from relay.api.responses_request import ResponsesRequest, parse_responses
from relay.api.responses_store import ResponseStore
from relay.api.serving import (
    EngineClient,
    Usage,
    error_response,
    refuse_if_embedding,
    streamed,
    whole,
)


def add_routes(app: FastAPI, client: EngineClient) -> None:
    store = ResponseStore()
    app.state.responses = store

    @app.post("/v1/responses", openapi_extra=request_body("responses"), responses=ERROR_RESPONSES)
    async def responses(request: Request):
        return await _serve(request, client, store)


def _parse(body: bytes, client: EngineClient, store: ResponseStore) -> ResponsesRequest:
    refuse_if_embedding(client)
    return parse_responses(
        decode_json_body(body),
        client.served_model,
        store,
        vocab_size=client.vocab_size,
        max_constraint_bytes=client.max_constraint_bytes,
        max_constraint_depth=client.max_constraint_depth,
        max_constraint_properties=client.max_constraint_properties,
        reasoning_parser=client.reasoning_parser,
        tool_call_parser=client.tool_call_parser,
    )


async def _serve(request: Request, client: EngineClient, store: ResponseStore):
    try:
        req = _parse(await request.body(), client, store)
        api = client.submit(req.parsed, "resp")
    except ProtocolError as e:
        return error_response(e)
    created, model = int(time.time()), client.served_model

    def keep(blocks: list[Block]) -> None:
        if req.store:  # the conversation so far, and this answer as its last turn
            store.put(api.rid, [*req.conversation, assistant_message(blocks)])

    if req.parsed.stream:
        events = ResponseEvents(req, api.rid, created, model, keep)
        return await streamed(client, api, request, events.events)
    done = await whole(client, api, request)
    if not isinstance(done, list):
        return done
    (r,) = done
    blocks, finish_reason = whole_blocks(
        req.parsed.tools, req.parsed.reasoning, r.text, r.finish_reason
    )
    keep(blocks)
    return response_object(req, api.rid, created, model, blocks, finish_reason, Usage.of([r]))
