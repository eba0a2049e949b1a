"""SGLang's native API: the routes /generate (one prompt, or a batch of them) and
/abort_request, over relay.api.generate (the request and the response) and
relay.api.generate_batch (a batch's rules)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from relay.api.batched_prompts import answer, submit_all
from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.errors import ProtocolError, error_body
from relay.api.generate import generate_response, parse_abort, parse_generate
from relay.api.generate_batch import is_batch, parse_batch
from relay.api.json_body import decode_json_body, require_object
from relay.api.serving import (
    SSE_DONE,
    Choice,
    EngineClient,
    error_response,
    refuse_if_embedding,
    sse,
    streamed,
    whole,
)
from relay.outputs import RequestOutput


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/generate", openapi_extra=request_body("generate"), responses=ERROR_RESPONSES)
    async def generate(request: Request):
        try:
            refuse_if_embedding(client)
            body = require_object(decode_json_body(await request.body()))
            if is_batch(body):
                return await _serve_batch(request, client, body)
            parsed = parse_generate(body, **_limits(client))
            api = client.submit(parsed, "generate")
        except ProtocolError as e:
            return error_response(e)
        # n > 1 answers as a batch of one prompt does (SGLang makes it one): a list, indexed.
        several = parsed.n > 1
        if parsed.stream:
            return await streamed(
                client, api, request, lambda outs: _events(outs, api.rids, several)
            )
        done = await whole(client, api, request)
        if not isinstance(done, list):
            return done
        outs = [generate_response(api.rids[i], c) for i, c in enumerate(done)]
        return outs if several else outs[0]

    @app.post("/abort_request", openapi_extra=request_body("abort"), responses=ERROR_RESPONSES)
    async def abort_request(request: Request):
        try:
            rid = parse_abort(decode_json_body(await request.body()))
        except ProtocolError as e:
            return error_response(e)
        return {"success": True, "found": client.abort(rid)}


def _limits(client: EngineClient) -> dict[str, Any]:
    """What this server's model and flags allow a request (relay.api.generate.parse_prompt)."""
    return {
        "vocab_size": client.vocab_size,
        "max_constraint_bytes": client.max_constraint_bytes,
        "max_constraint_depth": client.max_constraint_depth,
        "max_constraint_properties": client.max_constraint_properties,
    }


async def _serve_batch(request: Request, client: EngineClient, body: dict[str, Any]) -> Response:
    """A batch (raises a ProtocolError before anything runs): each prompt its own request, the
    answer SGLang's list of one-prompt answers, prompt i's choice j at i * n + j."""
    parsed = parse_batch(body, **_limits(client))
    rid = None if parsed.own_rids else parsed.rid or client.request_id("generate")
    batch = submit_all(client, parsed.prompts, rid, "generate")
    return await answer(
        request,
        client,
        batch,
        parsed.stream,
        lambda outs: _events(outs, batch.rids, indexed=True),
        lambda done: [generate_response(batch.rids[k], out) for k, out in enumerate(done)],
    )


async def _events(
    outs: AsyncIterator[Choice], rids: list[str], indexed: bool
) -> AsyncIterator[bytes]:
    """SGLang streams each choice's whole output so far in every chunk, not a delta; where the
    answer is a list, each chunk carries its choice's `index` in it."""
    so_far: dict[int, RequestOutput] = {}
    async for index, r in outs:
        if r.error is not None:
            yield sse(error_body(r.status, r.error, r.param))
            return
        acc = so_far.setdefault(index, RequestOutput(r.rid))
        acc.extend(r)
        chunk = generate_response(rids[index], acc)
        yield sse({**chunk, "index": index} if indexed else chunk)
    yield SSE_DONE
