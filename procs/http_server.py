"""relay::http: the FastAPI app (OpenAI-compatible and SGLang-native endpoints).

Requests go to the tokenizer workers; text deltas come back from the detokenizer on one
PULL socket that a single dispatcher task drains and routes to the waiting handlers.
Protocol details (parsing, validation, response shapes) live in `relay.protocol`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ipc.codec import encode
from ipc.messages import AbortReq, BatchStrOut, ControlOut, ControlReq, ErrorOut, GenerateReq, Heartbeat
from ipc.sockets import HTTP, SCHEDULER, TOKENIZER, AsyncPull, endpoint, push, send
from relay import protocol as P
from relay.api_docs import ERROR_RESPONSES, METRICS_RESPONSE, request_body
from relay.health import HEARTBEAT_INTERVAL, Heartbeats
from relay.http_guard import GuardConfig, RequestGuard
from relay.metrics import ServerMetrics
from relay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Piece:
    """One delta of one choice, as the detokenizer (or an error) delivered it."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: Any = None
    logprobs: list | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    error: str | None = None
    status: int = 500  # for errors: 4xx when the request itself was at fault
    param: str | None = None


class ApiRequest:
    """One HTTP request (n choices); the dispatcher appends pieces, the handler takes them."""

    def __init__(self, rid: str, n: int):
        self.rid = rid
        self.rids = [f"{rid}-{i}" if n > 1 else rid for i in range(n)]
        self.pending: list[Piece] = []
        self.event = asyncio.Event()
        self.open_choices = n
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None

    def put(self, piece: Piece) -> None:
        self.pending.append(piece)
        self.event.set()

    async def take(self) -> list[Piece]:
        await self.event.wait()
        self.event.clear()
        out, self.pending = self.pending, []
        return out


class Backend:
    """The http process's link to the other processes."""

    def __init__(self, ipc_dir: str, served_model: str, context_len: int, max_queued: int,
                 server_info: dict[str, Any], vocab_size: int | None = None, health_timeout: float = 20.0):
        self.ctx = zmq.asyncio.Context()
        self.to_tokenizer = push(self.ctx, endpoint(ipc_dir, TOKENIZER), bind=True)
        self.to_sched = push(self.ctx, endpoint(ipc_dir, SCHEDULER))
        # Sends through the sync twin complete at once (no high-water mark): an abort is
        # queued for delivery even when the handler sending it is being cancelled.
        self._sync_to_tokenizer = zmq.Socket.shadow(self.to_tokenizer.underlying)
        self._sync_to_sched = zmq.Socket.shadow(self.to_sched.underlying)
        self.inbox = AsyncPull(self.ctx, endpoint(ipc_dir, HTTP))
        self.served_model = served_model
        self.context_len = context_len
        self.max_queued = max_queued
        self.server_info = server_info
        self.routes: dict[str, tuple[ApiRequest, int]] = {}
        self.num_requests = 0
        self.controls: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count()
        self.metrics = ServerMetrics()
        self.vocab_size = vocab_size
        self.heartbeats = Heartbeats(health_timeout)
        self.dead: str | None = None  # set when a child process died: refuse new work

    # ---- requests -------------------------------------------------------------------
    def submit(self, parsed: P.ParsedRequest, rid: str | None = None) -> ApiRequest:
        return self.submit_fields(parsed.n, rid, parsed.kind, params=parsed.params, text=parsed.text,
                                  input_ids=parsed.input_ids, messages=parsed.messages,
                                  chat_kwargs=parsed.chat_kwargs, priority=parsed.priority)

    def submit_fields(self, n: int, rid: str | None, kind: str, **fields: Any) -> ApiRequest:
        if self.dead:
            raise P.ProtocolError(503, f"server is shutting down: {self.dead}", None, "server_error")
        if self.num_requests >= self.max_queued:
            raise P.ProtocolError(503, f"server overloaded: {self.num_requests} requests in flight; retry later",
                                  None, "server_error")
        api = ApiRequest(rid or f"{kind[:4]}-{uuid.uuid4().hex}", n)
        if any(r in self.routes for r in api.rids):
            raise P.ProtocolError(400, f"request id {api.rid!r} is already in use", "rid")
        # Encoded before anything is registered: a request that cannot cross the wire leaves
        # nothing behind.
        data = encode(GenerateReq(rids=api.rids, arrival_time=time.time(), **fields))
        for i, r in enumerate(api.rids):
            self.routes[r] = (api, i)
        self.num_requests += 1
        self._sync_to_tokenizer.send(data, copy=False)
        return api

    def release(self, api: ApiRequest, abort: bool, reason: str = "client_disconnect") -> None:
        """Forget a request (idempotent); if it may still be running, make the scheduler end
        it, and count it as aborted for `reason`."""
        routed = [r for r in api.rids if r in self.routes]
        for r in routed:
            del self.routes[r]
            if abort:
                send(self._sync_to_sched, AbortReq(r, sent_at=time.time()))
        if routed:  # still counted as in flight
            self.num_requests -= 1
            if abort:
                self.metrics.observe_abort(reason, finish_seen=False)

    def abort_rid(self, rid: str) -> bool:
        entry = self.routes.get(rid)
        send(self._sync_to_sched, AbortReq(rid, sent_at=time.time()))
        return entry is not None

    async def control(self, kind: str, timeout: float | None = None) -> ControlOut:
        """Ask the scheduler; a ProtocolError 504 if it does not answer in time (by default
        the health timeout: a scheduler that slow is unhealthy anyway)."""
        timeout = self.heartbeats.timeout if timeout is None else timeout
        req_id = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self.controls[req_id] = fut
        send(self._sync_to_sched, ControlReq(req_id, kind))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise P.ProtocolError(504, f"the scheduler did not answer within {timeout:g} s", None,
                                  "server_error") from None
        finally:
            self.controls.pop(req_id, None)

    async def heartbeat_forever(self) -> None:
        while True:
            send(self._sync_to_tokenizer, Heartbeat(self.heartbeats.ping(time.monotonic())))
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    def health_problem(self) -> str | None:
        return self.dead or self.heartbeats.problem(time.monotonic())

    # ---- the dispatcher -------------------------------------------------------------
    async def dispatch_forever(self) -> None:
        while True:
            for msg in await self.inbox.recv_batch():
                if isinstance(msg, BatchStrOut):
                    self._route_outputs(msg)
                elif isinstance(msg, ErrorOut):
                    self._route(msg.rid, lambda i: Piece(i, finish_reason="abort", error=msg.message,
                                                         status=msg.status, param=msg.param))
                elif isinstance(msg, ControlOut):
                    fut = self.controls.get(msg.req_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, Heartbeat):
                    self.heartbeats.pong(msg.seq, msg.step_age, time.monotonic())

    def _route_outputs(self, m: BatchStrOut) -> None:
        now = time.monotonic()
        for i, rid in enumerate(m.rids):
            entry = self.routes.get(rid)
            if entry is None:
                continue  # its client is gone
            api, index = entry
            piece = Piece(index, m.texts[i], m.token_ids[i], m.finish_reasons[i], m.matched_stops[i],
                          m.logprobs[i], m.prompt_tokens[i], m.completion_tokens[i], m.cached_tokens[i],
                          m.queue_times[i] if m.queue_times else None, m.errors[i])
            self._observe(api, piece, now)
            self._deliver(rid, api, piece)

    def _route(self, rid: str, make) -> None:
        entry = self.routes.get(rid)
        if entry is not None:
            self._deliver(rid, entry[0], make(entry[1]))

    def _deliver(self, rid: str, api: ApiRequest, piece: Piece) -> None:
        if piece.finish_reason is not None:
            del self.routes[rid]
            api.open_choices -= 1
            if api.open_choices == 0:
                self.num_requests -= 1
        api.put(piece)

    def _observe(self, api: ApiRequest, piece: Piece, now: float) -> None:
        n = len(piece.token_ids)
        if n:
            if api.first_token is None:
                api.first_token = now
                self.metrics.observe_first_token(now - api.arrival)
            else:
                self.metrics.observe_inter_token((now - api.last_token) / n, n)
            api.last_token = now
        if piece.finish_reason is not None:
            self.metrics.observe_finish(now - api.arrival, piece.queue_time, piece.prompt_tokens,
                                        piece.completion_tokens, piece.cached_tokens, piece.finish_reason)

    def fail_all(self, message: str) -> None:
        """A child died: end every request in flight with an error."""
        self.dead = message
        for rid, (api, index) in list(self.routes.items()):
            self._deliver(rid, api, Piece(index, finish_reason="abort", error=message, status=503))


# ---- the app -------------------------------------------------------------------------------
def build_app(backend: Backend, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(title="Relay", docs_url=None, redoc_url=None, version=backend.server_info.get("version", ""))
    app.add_middleware(RequestGuard, config=guard or GuardConfig())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(P.ProtocolError(e.status_code, str(e.detail), None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error(P.ProtocolError(500, f"internal error: {type(e).__name__}", None))

    @app.get("/health", responses=ERROR_RESPONSES)
    async def health():
        """200 while every process's loop is turning (a heartbeat makes it through the
        pipeline in time); 503 with the reason otherwise."""
        problem = backend.health_problem()
        if problem:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate", responses=ERROR_RESPONSES)
    async def health_generate(request: Request):
        """Healthy only if a one-token generation makes it through every process."""
        try:
            api = backend.submit_fields(1, None, "health", input_ids=[0],
                                        params=SamplingParams(max_new_tokens=1, temperature=0.0))
        except P.ProtocolError as e:
            return JSONResponse({"status": "unhealthy", "reason": e.message}, status_code=503)
        try:
            pieces = await asyncio.wait_for(_collect(backend, api, request), 60)
        except asyncio.TimeoutError:
            backend.release(api, abort=True, reason="health_check_timeout")
            return JSONResponse({"status": "unhealthy", "reason": "no token within 60 s"}, status_code=503)
        if pieces is None or any(p.error for p in pieces):
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        return {"object": "list", "data": [{"id": backend.served_model, "object": "model", "created": 0,
                                            "owned_by": "relay", "max_model_len": backend.context_len}]}

    @app.post("/v1/completions", openapi_extra=request_body("completion"), responses=ERROR_RESPONSES)
    async def completions(request: Request):
        return await _openai(request, P.parse_completion, "completion")

    @app.post("/v1/chat/completions", openapi_extra=request_body("chat"), responses=ERROR_RESPONSES)
    async def chat_completions(request: Request):
        return await _openai(request, P.parse_chat, "chat")

    async def _openai(request: Request, parse, kind: str):
        try:
            parsed = parse(P.decode_json_body(await request.body()), backend.served_model,
                           vocab_size=backend.vocab_size)
            api = backend.submit(parsed)
        except P.ProtocolError as e:
            return _error(e)
        created = int(time.time())
        if parsed.stream:
            return await _stream(request, api, lambda pieces: _openai_chunks(api, pieces, parsed, created, kind))
        done = await _finish(request, api, parsed.n)
        if isinstance(done, Response):
            return done
        choices, usage = done
        build = P.completion_response if kind == "completion" else P.chat_response
        return build(api.rid, created, backend.served_model, choices, usage)

    async def _openai_chunks(api: ApiRequest, pieces: AsyncIterator[Piece], parsed: P.ParsedRequest,
                             created: int, kind: str):
        model = backend.served_model
        started = [False] * parsed.n
        offsets = [0] * parsed.n  # text_offset of each choice's next chunk (completions logprobs)
        usage = P.Usage(0, 0, 0)
        async for piece in pieces:
            if piece.error is not None:
                yield P.sse(P.error_body(piece.status, piece.error, piece.param))
                return
            delta = P.ChoiceOutput(piece.index, piece.text, piece.token_ids, piece.finish_reason,
                                   piece.matched_stop, piece.logprobs)
            if kind == "completion":
                yield P.sse(P.completion_chunk(api.rid, created, model, delta, offsets[piece.index]))
                offsets[piece.index] += len(piece.text)
            else:
                yield P.sse(P.chat_chunk(api.rid, created, model, delta, first=not started[piece.index]))
            started[piece.index] = True
            if piece.finish_reason is not None:
                usage.prompt_tokens = piece.prompt_tokens
                usage.completion_tokens += piece.completion_tokens
                usage.cached_tokens = max(usage.cached_tokens, piece.cached_tokens)
        if parsed.include_usage:
            yield P.sse(P.usage_chunk(kind, api.rid, created, model, usage))
        yield P.SSE_DONE

    @app.post("/generate", openapi_extra=request_body("generate"), responses=ERROR_RESPONSES)
    async def generate(request: Request):
        try:
            parsed = P.parse_generate(P.decode_json_body(await request.body()), vocab_size=backend.vocab_size)
            api = backend.submit(parsed, rid=parsed.rid)
        except P.ProtocolError as e:
            return _error(e)
        if parsed.stream:
            return await _stream(request, api, lambda pieces: _generate_chunks(api, pieces))
        done = await _finish(request, api, parsed.n)
        if isinstance(done, Response):
            return done
        choices, usage = done
        outs = [P.generate_response(api.rids[c.index], c, usage) for c in choices]
        return outs[0] if parsed.n == 1 else outs

    async def _generate_chunks(api: ApiRequest, pieces: AsyncIterator[Piece]):
        acc: dict[int, P.ChoiceOutput] = {}
        async for piece in pieces:
            if piece.error is not None:
                yield P.sse(P.error_body(piece.status, piece.error, piece.param))
                return
            c = acc.setdefault(piece.index, P.ChoiceOutput(piece.index, "", [], None, None, None))
            c.text += piece.text
            c.token_ids += piece.token_ids
            c.finish_reason, c.matched_stop = piece.finish_reason, piece.matched_stop
            if piece.logprobs:
                c.logprobs = (c.logprobs or []) + piece.logprobs
            usage = P.Usage(piece.prompt_tokens, piece.completion_tokens or len(c.token_ids), piece.cached_tokens)
            yield P.sse(P.generate_response(api.rids[piece.index], c, usage))
        yield P.SSE_DONE

    async def _finish(request: Request, api: ApiRequest, n: int) -> tuple[list[P.ChoiceOutput], P.Usage] | Response:
        """A non-streamed request's choices and usage, or the response that replaces them
        (its error, or 499 when the client left)."""
        pieces = await _collect(backend, api, request)
        if pieces is None:
            return Response(status_code=499)
        err = _first_error(pieces)
        return _error(err) if err is not None else _merge(pieces, n)

    async def _stream(request: Request, api: ApiRequest, make_chunks) -> Response:
        """Wait for the first output (so a rejected request still gets its 4xx status), then
        stream; a client that goes away aborts the request, whose KV is then freed."""
        try:
            first = await _race_disconnect(request, api.take())
        except BaseException:
            backend.release(api, abort=True)
            raise
        if first is _DISCONNECTED:
            backend.release(api, abort=True)
            return Response(status_code=499)
        err = _first_error(first)
        if err is not None and err.status < 500:
            backend.release(api, abort=True, reason="rejected")
            return _error(err)
        finished = False

        async def body():
            nonlocal finished
            async for chunk in make_chunks(_pieces(api, first)):
                yield chunk
            finished = True

        # Released when the response ends, whether or not its body ever started.
        return _ReleasingStream(body(), lambda: backend.release(api, abort=not finished))

    @app.post("/abort_request", openapi_extra=request_body("abort"), responses=ERROR_RESPONSES)
    async def abort_request(request: Request):
        try:
            rid = P.parse_abort(P.decode_json_body(await request.body()))
        except P.ProtocolError as e:
            return _error(e)
        known = [r for r in backend.routes if r == rid or r.startswith(rid + "-")]
        for r in known or [rid]:
            backend.abort_rid(r)
        if known:
            backend.metrics.observe_abort("abort_request", finish_seen=True)
        return {"success": True, "found": bool(known)}

    @app.get("/get_server_info", responses=ERROR_RESPONSES)
    async def get_server_info():
        try:
            out = await backend.control("get_info")
        except P.ProtocolError as e:
            return _error(e)
        return {**backend.server_info, "scheduler": out.data, "num_http_requests": backend.num_requests}

    @app.post("/flush_cache", responses=ERROR_RESPONSES)
    async def flush_cache():
        try:
            out = await backend.control("flush_cache")
        except P.ProtocolError as e:
            return _error(e)
        if not out.ok:
            return JSONResponse({"success": False, **out.data}, status_code=400)
        return {"success": True}

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSE)
    async def metrics():
        try:
            out = await backend.control("get_info", timeout=2.0)
            backend.metrics.set_scheduler_stats(out.data)
        except P.ProtocolError:
            pass  # serve the histograms anyway
        body, content_type = backend.metrics.render()
        return Response(body, media_type=content_type)

    return app


class _ReleasingStream(StreamingResponse):
    """An SSE response that calls on_close once it ends, however it ends: a client that
    leaves before the body starts would otherwise leave its request registered."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


_DISCONNECTED = object()


async def _race_disconnect(request: Request, awaitable):
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


def coalesce(batch: list[Piece]) -> list[Piece]:
    """Merge the pieces of each choice that arrived together into one: under load a stream
    then carries several tokens per SSE event instead of paying per token."""
    merged: dict[int, Piece] = {}
    out: list[Piece] = []
    for p in batch:
        m = merged.get(p.index)
        if m is None or m.finish_reason is not None or m.error is not None:
            merged[p.index] = p
            out.append(p)
            continue
        m.text += p.text
        m.token_ids = m.token_ids + p.token_ids
        if p.logprobs:
            m.logprobs = (m.logprobs or []) + p.logprobs
        m.finish_reason, m.matched_stop, m.error, m.status, m.param = (
            p.finish_reason, p.matched_stop, p.error, p.status, p.param)
        m.prompt_tokens, m.completion_tokens, m.cached_tokens, m.queue_time = (
            p.prompt_tokens, p.completion_tokens, p.cached_tokens, p.queue_time)
    return out


async def _pieces(api: ApiRequest, first: list[Piece] | None = None) -> AsyncIterator[Piece]:
    """Every piece of every choice until all have finished or one failed."""
    open_choices = len(api.rids)
    batch = first if first is not None else await api.take()
    while True:
        for piece in coalesce(batch):
            yield piece
            if piece.error is not None:
                return
            open_choices -= piece.finish_reason is not None
        if not open_choices:
            return
        batch = await api.take()


async def _collect(backend: Backend, api: ApiRequest, request: Request) -> list[Piece] | None:
    """All pieces of a non-streamed request; None (after aborting it) if the client left."""
    async def gather() -> list[Piece]:
        return [piece async for piece in _pieces(api)]

    try:
        result = await _race_disconnect(request, gather())
    except BaseException:
        backend.release(api, abort=True)
        raise
    if result is _DISCONNECTED:
        backend.release(api, abort=True)
        return None
    backend.release(api, abort=any(p.error for p in result), reason="error")
    return result


def _first_error(pieces: list[Piece]) -> P.ProtocolError | None:
    for p in pieces:
        if p.error is not None:
            return P.ProtocolError(p.status, p.error, p.param, None if p.status < 500 else "server_error")
    return None


def _merge(pieces: list[Piece], n: int) -> tuple[list[P.ChoiceOutput], P.Usage]:
    choices = [P.ChoiceOutput(i, "", [], None, None, None) for i in range(n)]
    usage = P.Usage(0, 0, 0)
    for p in pieces:
        c = choices[p.index]
        c.text += p.text
        c.token_ids += p.token_ids
        if p.logprobs:
            c.logprobs = (c.logprobs or []) + p.logprobs
        if p.finish_reason is not None:
            c.finish_reason, c.matched_stop = p.finish_reason, p.matched_stop
            usage.prompt_tokens = p.prompt_tokens
            usage.completion_tokens += p.completion_tokens
            usage.cached_tokens = max(usage.cached_tokens, p.cached_tokens)
    return choices, usage


def _error(e: P.ProtocolError) -> JSONResponse:
    return JSONResponse(P.error_body(e.status, e.message, e.param, e.type), status_code=e.status)
