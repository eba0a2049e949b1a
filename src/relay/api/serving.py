"""An HTTP request's life on the server side, shared by every generating route.

A route parses its body, submits it to the EngineClient (the http process's link to the
pipeline), and answers with `whole()` or `streamed()`. Records (relay.outputs.RequestOutput)
arrive per choice; several that arrived together are merged into one, so under load an SSE
event carries several tokens instead of paying per token. A client that leaves aborts its
request (its KV is freed), and however a response ends its request is released.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from relay.api.errors import ProtocolError, error_body
from relay.api.parsed_request import ParsedRequest
from relay.metrics import RequestTimer, ServerMetrics
from relay.outputs import RequestOutput

Choice = tuple[int, RequestOutput]  # (choice index, record)


class ApiRequest:
    """One HTTP request (n choices); the client's dispatcher puts records, the route takes them."""

    def __init__(self, rid: str, n: int, param_names: dict[str, str] | None = None):
        self.rid = rid
        self.param_names = param_names or {}  # an error's SamplingParams field -> the API's name
        self.rids = [f"{rid}-{i}" if n > 1 else rid for i in range(n)]
        self.pending: list[Choice] = []
        self.event = asyncio.Event()
        self.open_choices = n
        self.timer = RequestTimer(time.monotonic())

    def put(self, index: int, record: RequestOutput) -> None:
        if record.param in self.param_names:
            record.param = self.param_names[record.param]
        self.pending.append((index, record))
        self.event.set()

    async def take(self) -> list[Choice]:
        await self.event.wait()
        self.event.clear()
        out, self.pending = self.pending, []
        return out


class EngineClient(Protocol):
    """What routes need of the http process's link to the pipeline (procs.http_server)."""

    served_model: str
    context_len: int
    vocab_size: int | None
    max_constraint_bytes: int | None  # --max-constraint-bytes
    max_constraint_depth: int | None  # --max-constraint-depth
    max_constraint_properties: int | None  # --max-constraint-properties
    reasoning_parser: str | None  # --reasoning-parser
    tool_call_parser: str  # --tool-call-parser, or the chat template's format
    server_info: dict[str, Any]
    metrics: ServerMetrics
    num_requests: int

    def request_id(self, kind: str) -> str: ...
    def submit(self, parsed: ParsedRequest, kind: str) -> ApiRequest: ...
    def release(self, api: ApiRequest, abort: bool, reason: str = "client_disconnect") -> None: ...
    def abort(self, rid: str) -> bool: ...
    async def control(self, kind: str, timeout: float | None = None) -> Any: ...
    async def tokenizer_call(self, query: Any) -> dict[str, Any]: ...
    def health_problem(self) -> str | None: ...


def refuse_if_embedding(client: EngineClient) -> None:
    """An embedding server (--is-embedding) generates nothing: its generating routes refuse."""
    if client.server_info.get("is_embedding"):
        raise ProtocolError(
            400,
            "this server was started with --is-embedding: it serves /v1/embeddings and "
            "generates no text",
        )


# ---- records -------------------------------------------------------------------------------


def coalesce(batch: list[Choice]) -> list[Choice]:
    """Merge the records of each choice that arrived together (not past a finish or error)."""
    merged: dict[int, RequestOutput] = {}
    out: list[Choice] = []
    for index, r in batch:
        m = merged.get(index)
        if m is None or m.finished or m.error is not None:
            merged[index] = r
            out.append((index, r))
        else:
            m.extend(r)
    return out


async def choices(api: ApiRequest, first: list[Choice] | None = None) -> AsyncIterator[Choice]:
    """Every record of every choice until all have finished or one failed."""
    open_choices = len(api.rids)
    batch = first if first is not None else await api.take()
    while True:
        for index, r in coalesce(batch):
            yield index, r
            if r.error is not None:
                return
            open_choices -= r.finished
        if not open_choices:
            return
        batch = await api.take()


def merge(pieces: list[Choice], n: int) -> list[RequestOutput]:
    """Each choice's records as one."""
    merged = [RequestOutput("") for _ in range(n)]
    for index, r in pieces:
        merged[index].extend(r)
    return merged


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @classmethod
    def of(cls, outputs: list[RequestOutput | None]) -> Usage:
        """One request's usage from its choices' latest records: the shared prompt counts
        once (as OpenAI bills it) and completions add up."""
        done = [o for o in outputs if o is not None]
        return cls(
            prompt_tokens=max((o.prompt_tokens for o in done), default=0),
            completion_tokens=sum(o.completion_tokens for o in done),
            cached_tokens=max((o.cached_tokens for o in done), default=0),
        )

    def to_openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def first_error(pieces: list[Choice]) -> ProtocolError | None:
    for _, r in pieces:
        if r.error is not None:
            return ProtocolError(
                r.status, r.error, r.param, None if r.status < 500 else "server_error"
            )
    return None


# ---- responses -------------------------------------------------------------------------------


def error_response(e: ProtocolError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.type), status_code=e.status)


SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return (
        b"data: "
        + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        + b"\n\n"
    )


ErrorResponse = Callable[[ProtocolError], Response]


async def whole(
    client: EngineClient,
    api: ApiRequest,
    request: Request,
    on_error: ErrorResponse = error_response,
) -> list[RequestOutput] | Response:
    """A non-streamed request's merged choices, or the response that replaces them (its
    error as on_error shapes it, or 499 when the client left)."""
    pieces = await collect(client, api, request)
    if pieces is None:
        return Response(status_code=499)
    err = first_error(pieces)
    return on_error(err) if err is not None else merge(pieces, len(api.rids))


async def collect(client: EngineClient, api: ApiRequest, request: Request) -> list[Choice] | None:
    """All records of a request; None (after aborting it) if the client left."""

    async def gather() -> list[Choice]:
        return [piece async for piece in choices(api)]

    try:
        result = await _race_disconnect(request, gather())
    except BaseException:
        client.release(api, abort=True)
        raise
    if result is _DISCONNECTED:
        client.release(api, abort=True)
        return None
    client.release(api, abort=any(r.error for _, r in result), reason="error")
    return result


SseEvents = Callable[[AsyncIterator[Choice]], AsyncIterator[bytes]]


async def streamed(
    client: EngineClient,
    api: ApiRequest,
    request: Request,
    events: SseEvents,
    on_error: ErrorResponse = error_response,
) -> Response:
    """Wait for the first output (so a rejected request still gets its 4xx status, shaped by
    on_error), then stream `events` of the records; a client that goes away aborts the
    request."""
    try:
        first = await _race_disconnect(request, api.take())
    except BaseException:
        client.release(api, abort=True)
        raise
    if first is _DISCONNECTED:
        client.release(api, abort=True)
        return Response(status_code=499)
    err = first_error(first)
    if err is not None and err.status < 500:
        client.release(api, abort=True, reason="rejected")
        return on_error(err)
    finished = False

    async def body():
        nonlocal finished
        async for chunk in events(choices(api, first)):
            yield chunk
        finished = True

    # Released when the response ends, whether or not its body ever started.
    return _ReleasingStream(body(), lambda: client.release(api, abort=not finished))


class _ReleasingStream(StreamingResponse):
    """An SSE response that calls on_close once it ends, however it ends: a client that
    leaves before the body starts would otherwise leave its request registered."""

    def __init__(self, body, on_close: Callable[[], None]):
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


_DISCONNECTED = object()


async def _race_disconnect(request: Request, awaitable: Awaitable):
    """The awaitable's result, or _DISCONNECTED if the client hangs up first."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    return _DISCONNECTED


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
