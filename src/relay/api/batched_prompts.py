"""A request of several prompts, each its own request, read back as one: /v1/completions'
`prompt` list (answered here, as OpenAI and vLLM do) and /generate's batch
(relay.api.generate_batch) share submit_all, PromptBatch and answer.

Each prompt's request is submitted at once, under its own id or `<id>-<i>` (so /abort_request
with the batch's id ends them all), and read back as one request whose choices are numbered
across the prompts: choice i * n + j is prompt i's choice j, OpenAI's order (and SGLang's).
Every prompt is checked before any is submitted (a 400 naming it: `prompt[i]`, `text[i]`);
one refused later (too long for the context) answers with its 4xx before a stream starts, and
a failure or a client leaving ends the prompts still running: nothing is left behind.

For completions, usage adds up over the prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from relay.api import completions, openai_common
from relay.api.errors import ProtocolError, error_body
from relay.api.parsed_request import ParsedRequest, Prompt
from relay.api.prompt_output import PromptView
from relay.api.request_id import submitted
from relay.api.serving import (
    SSE_DONE,
    ApiRequest,
    Choice,
    EngineClient,
    SseEvents,
    Usage,
    sse,
    streamed,
    whole,
)
from relay.outputs import RequestOutput


async def serve(request: Request, client: EngineClient, parsed: ParsedRequest) -> Response:
    """Answer a completion whose parsed.prompts holds several prompts, whole or streamed."""
    singles = [_single(parsed, i, p) for i, p in enumerate(parsed.prompts or [])]
    views = await asyncio.gather(*(_view(client, p) for p in singles))
    rid = client.request_id("completion")
    batch = submit_all(client, singles, rid, "completion")
    created, model = int(time.time()), client.served_model
    return await answer(
        request,
        client,
        batch,
        parsed.stream,
        lambda outs: _events(outs, rid, created, model, parsed, views),
        lambda done: _response(rid, created, model, done, views, parsed.n),
    )


async def answer(
    request: Request,
    client: EngineClient,
    batch: PromptBatch,
    stream: bool,
    events: SseEvents,
    respond: Callable[[list[RequestOutput]], Any],
) -> Any:
    """A batch's answer: its events streamed, or respond() on every choice's whole output
    (choice i * n + j prompt i's choice j); an error or a client that left ends every prompt."""
    parts = _PartsReleased(client)
    if stream:
        return await streamed(parts, batch, request, events)
    done = await whole(parts, batch, request)
    return respond(done) if isinstance(done, list) else done


def _single(parsed: ParsedRequest, i: int, prompt: Prompt) -> ParsedRequest:
    """Prompt i's request; a refusal of its prompt past this process names prompt[i]."""
    return dataclasses.replace(
        parsed,
        text=prompt.text,
        input_ids=prompt.input_ids,
        prompts=None,
        param_names={**parsed.param_names, "prompt": f"prompt[{i}]"},
    )


async def _view(client: EngineClient, single: ParsedRequest) -> PromptView:
    try:
        return await completions.prompt_view(client, single)
    except ProtocolError as e:
        raise e.renamed(single.param_names) from None


def submit_all(
    client: EngineClient, singles: list[ParsedRequest], rid: str | None, kind: str
) -> PromptBatch:
    """Every prompt's request, or none: one refused (the server is full, its id in use) takes
    back the rest, its error naming that prompt's field. Prompt i runs under its own rid if it
    has one (/generate's list of rids), else as `<rid>-<i>`."""
    parts: list[ApiRequest] = []
    try:
        for i, single in enumerate(singles):
            own = dataclasses.replace(single, rid=single.rid or f"{rid}-{i}")
            try:
                parts.append(client.submit(own, kind))
            except ProtocolError as e:
                raise e.renamed(single.param_names) from None
    except BaseException:
        for part in parts:
            client.release(part, abort=True, reason="rejected")
        raise
    # The response's X-Request-Id: the batch's, not its last prompt's; none for a list of rids.
    submitted(rid)
    return PromptBatch(rid, parts)


class PromptBatch:
    """The prompts' requests read as one (what relay.api.serving reads of an ApiRequest): their
    records numbered across the batch."""

    def __init__(self, rid: str | None, parts: list[ApiRequest]):
        self.rid = rid
        self.parts = parts
        self.rids = [r for part in parts for r in part.rids]
        self.event = asyncio.Event()
        self._heard = [False] * len(parts)
        for part in parts:
            part.event = self.event  # a record for any prompt wakes the batch's reader
            if part.pending:
                self.event.set()

    async def take(self) -> list[Choice]:
        """The records that arrived. The first take waits until every prompt was heard from
        (or one failed), so that a prompt the tokenizer refuses answers a stream with its 4xx."""
        out: list[Choice] = []
        while not out or not (all(self._heard) or any(r.error is not None for _, r in out)):
            await self.event.wait()
            self.event.clear()
            out += self._drain()
        return out

    def _drain(self) -> list[Choice]:
        out: list[Choice] = []
        first = 0  # the batch's index of this prompt's choice 0
        for i, part in enumerate(self.parts):
            if part.pending:
                self._heard[i] = True
                out += [(first + index, r) for index, r in part.pending]
                part.pending = []
            first += len(part.rids)
        return out


class _PartsReleased:
    """The client as relay.api.serving releases a PromptBatch through it: each prompt's request.
    A batch that ended, however, ends its prompts still running (one failed: the others)."""

    def __init__(self, client: EngineClient):
        self.client = client

    def release(self, batch: PromptBatch, abort: bool, reason: str = "client_disconnect") -> None:
        for part in batch.parts:
            self.client.release(part, abort=True, reason=reason if abort else "error")


def _usage(outputs: list[RequestOutput | None], n: int) -> Usage:
    """Each prompt's usage (its prompt counted once), added up."""
    each = [Usage.of(outputs[i : i + n]) for i in range(0, len(outputs), n)]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in each),
        completion_tokens=sum(u.completion_tokens for u in each),
        cached_tokens=sum(u.cached_tokens for u in each),
    )


def _response(
    rid: str,
    created: int,
    model: str,
    done: list[RequestOutput],
    views: list[PromptView],
    n: int,
) -> dict[str, Any]:
    answers = [
        completions.completion_response(rid, created, model, done[i * n : (i + 1) * n], view)
        for i, view in enumerate(views)
    ]
    choices = [
        {**choice, "index": i * n + choice["index"]}
        for i, answer in enumerate(answers)
        for choice in answer["choices"]
    ]
    return {**answers[0], "choices": choices, "usage": _usage(done, n).to_openai()}


async def _events(
    outs: AsyncIterator[Choice],
    rid: str,
    created: int,
    model: str,
    parsed: ParsedRequest,
    views: list[PromptView],
) -> AsyncIterator[bytes]:
    total = len(views) * parsed.n
    offsets = [0] * total  # text_offset of each choice's next chunk (logprobs)
    last: list[RequestOutput | None] = [None] * total
    async for index, r in outs:
        if r.error is not None:
            yield sse(error_body(r.status, r.error, r.param))
            return
        view = views[index // parsed.n] if last[index] is None else None  # the prompt first
        chunk = completions.completion_chunk(rid, created, model, index, r, offsets[index], view)
        yield sse(chunk)
        offsets[index] += len(chunk["choices"][0]["text"])
        last[index] = r
    if parsed.include_usage:
        yield sse(
            openai_common.usage_chunk("completion", rid, created, model, _usage(last, parsed.n))
        )
    yield SSE_DONE
