"""relay::http: the FastAPI app, and its link to the other processes.

Requests go to the tokenizer workers; records come back from the detokenizer (and refusals
from the tokenizer) on one PULL socket that a single dispatcher task drains and routes to
the waiting routes. The routes themselves live in relay.api, one module per API.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from ipc.codec import encode
from ipc.messages import (
    AbortRequest,
    ControlCall,
    ControlReply,
    GenerateReq,
    Heartbeat,
    OutputBatch,
    TokenizeCall,
)
from ipc.sockets import HTTP, SCHEDULER, TOKENIZER, AsyncPull, endpoint, push, send
from relay.api import (
    admin,
    anthropic_messages,
    embeddings,
    openai,
    responses,
    sglang,
    tokenization,
)
from relay.api.errors import ProtocolError
from relay.api.guard import GuardConfig, RequestGuard
from relay.api.parsed_request import ParsedRequest
from relay.api.request_id import RequestIdMiddleware, request_id, submitted
from relay.api.serving import ApiRequest, error_response
from relay.health import HEARTBEAT_INTERVAL, Heartbeats
from relay.metrics import ServerMetrics
from relay.outputs import FinishReason, RequestOutput

logger = logging.getLogger(__name__)


class ZmqEngineClient:
    """The http process's link to the pipeline (relay.api.serving.EngineClient)."""

    def __init__(
        self,
        ipc_dir: str,
        served_model: str,
        context_len: int,
        max_queued: int,
        server_info: dict[str, Any],
        vocab_size: int | None = None,
        health_timeout: float = 20.0,
        max_constraint_bytes: int | None = None,
        max_constraint_depth: int | None = None,
        max_constraint_properties: int | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str = "hermes",
    ):
        self.ctx = zmq.asyncio.Context()
        self.to_tokenizer = push(self.ctx, endpoint(ipc_dir, TOKENIZER), bind=True)
        self.to_sched = push(self.ctx, endpoint(ipc_dir, SCHEDULER))
        # Sends through the sync twins never wait: an abort is queued for delivery even when
        # the route sending it is being cancelled. to_sched connects, so with no high-water
        # mark its sends always queue; to_tokenizer binds, and a bound PUSH with no peer left
        # (every tokenizer died) would block the event loop for ever, so it is sent with
        # NOBLOCK (_to_tokenizer) and a refusal means no tokenizer is there.
        self._sync_to_tokenizer = zmq.Socket.shadow(self.to_tokenizer.underlying)
        self._sync_to_sched = zmq.Socket.shadow(self.to_sched.underlying)
        self.inbox = AsyncPull(self.ctx, endpoint(ipc_dir, HTTP))
        self.served_model = served_model
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.max_constraint_bytes = max_constraint_bytes
        self.max_constraint_depth = max_constraint_depth
        self.max_constraint_properties = max_constraint_properties
        self.reasoning_parser = reasoning_parser  # --reasoning-parser
        self.tool_call_parser = (
            tool_call_parser  # --tool-call-parser, or the chat template's format
        )
        self.max_queued = max_queued
        self.server_info = server_info
        self.routes: dict[
            str, tuple[ApiRequest, int]
        ] = {}  # choice rid -> (its request, choice index)
        self.num_requests = 0
        self.tokenizer_calls = (
            0  # /tokenize and /detokenize in flight: they count against max_queued too
        )
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.metrics = ServerMetrics(
            server_info.get("replica")
        )  # --replica-name labels every series
        self.heartbeats = Heartbeats(health_timeout)
        self.dead: str | None = None  # set when a child process died: refuse new work
        self.draining: str | None = (
            None  # set by a graceful stop (relay.api.drain): refuse new work
        )
        self._idle = (
            asyncio.Event()
        )  # set whenever a request ends, for a drain to look at what is left

    # ---- requests -------------------------------------------------------------------
    def submit(self, parsed: ParsedRequest, kind: str) -> ApiRequest:
        self._refuse_if_stopping()
        self._refuse_if_full()
        api = ApiRequest(parsed.rid or self.request_id(kind), parsed.n, parsed.param_names)
        if any(r in self.routes for r in api.rids):
            raise ProtocolError(400, f"request id {api.rid!r} is already in use", "rid")
        # Encoded before anything is registered: a request that cannot cross the wire leaves
        # nothing behind.
        data = encode(
            GenerateReq(
                rids=api.rids,
                params=parsed.params,
                text=parsed.text,
                input_ids=parsed.input_ids,
                messages=parsed.messages,
                chat_kwargs=parsed.chat_kwargs,
                priority=parsed.priority,
                arrival_time=time.time(),
                inputs=parsed.inputs,
            )
        )
        for i, r in enumerate(api.rids):
            self.routes[r] = (api, i)
        self.num_requests += 1
        if not self._to_tokenizer(data):
            self.release(api, abort=False)
            raise ProtocolError(
                503, "no tokenizer process is connected; retry later", None, "server_error"
            )
        submitted(api.rid)
        return api

    def request_id(self, kind: str) -> str:
        """A new id for a request of `kind`, not in flight here (relay.api.request_id)."""
        return request_id(kind, self.routes)

    def _refuse_if_stopping(self) -> None:
        if self.dead:
            raise ProtocolError(503, f"server is shutting down: {self.dead}", None, "server_error")
        if self.draining:
            raise ProtocolError(
                503, f"{self.draining}; retry on another server", None, "server_error"
            )

    def _refuse_if_full(self) -> None:
        in_flight = self.num_requests + self.tokenizer_calls
        if in_flight >= self.max_queued:
            raise ProtocolError(
                503,
                f"server overloaded: {in_flight} requests in flight; retry later",
                None,
                "server_error",
            )

    async def tokenizer_call(self, query: Any) -> dict[str, Any]:
        """/tokenize or /detokenize, done by a tokenizer process (relay.text.tokenize_query.TokenizeQuery);
        its answer's data, or a ProtocolError: the tokenizer's refusal (400 naming the field), 503
        when full or no tokenizer is there, 504 when none answers within the health timeout."""
        self._refuse_if_stopping()
        self._refuse_if_full()
        call_id = next(self._call_ids)
        data = encode(TokenizeCall(call_id, query))
        fut = asyncio.get_running_loop().create_future()
        self.calls[call_id] = fut
        self.tokenizer_calls += 1
        try:
            if not self._to_tokenizer(data):
                raise ProtocolError(
                    503, "no tokenizer process is connected; retry later", None, "server_error"
                )
            reply = await asyncio.wait_for(fut, self.heartbeats.timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(
                504,
                f"no tokenizer answered within {self.heartbeats.timeout:g} s",
                None,
                "server_error",
            ) from None
        finally:
            self.calls.pop(call_id, None)
            self.tokenizer_calls -= 1
            self._idle.set()
        if not reply.ok:
            raise ProtocolError(
                reply.data.get("status", 500),
                reply.data.get("message", "tokenizer error"),
                reply.data.get("param"),
            )
        return reply.data

    async def wait_for_tokenizer(self, timeout: float) -> bool:
        """Whether a tokenizer connected within `timeout` s. Tokenizers connect before this
        socket is bound and zmq retries their connect only every 100 ms, so a server that
        answered before this returned would refuse its first requests with 503."""
        deadline = time.monotonic() + timeout
        while not self.dead and time.monotonic() < deadline:  # wakes to notice a child's death
            if await self.to_tokenizer.poll(100, zmq.POLLOUT):
                return True
        return False

    def _to_tokenizer(self, data: bytes) -> bool:
        """Hand a message to a tokenizer worker; False if none is connected."""
        try:
            self._sync_to_tokenizer.send(data, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def release(self, api: ApiRequest, abort: bool, reason: str = "client_disconnect") -> None:
        """Forget a request (idempotent); if it may still be running, make the scheduler end
        it, and count it as aborted for `reason`."""
        routed = [r for r in api.rids if r in self.routes]
        for r in routed:
            del self.routes[r]
            if abort:
                send(self._sync_to_sched, AbortRequest(r, sent_at=time.time()))
        if routed:  # still counted as in flight
            self.num_requests -= 1
            self._idle.set()
            if abort:
                self.metrics.observe_abort(reason, finish_seen=False)

    def abort(self, rid: str) -> bool:
        """End a request by its id (all its choices); whether it was in flight here."""
        known = [r for r in self.routes if r == rid or r.startswith(rid + "-")]
        for r in known or [rid]:
            send(self._sync_to_sched, AbortRequest(r, sent_at=time.time()))
        if known:
            self.metrics.observe_abort("abort_request", finish_seen=True)
        return bool(known)

    async def control(self, kind: str, timeout: float | None = None) -> ControlReply:
        """Ask the scheduler; a ProtocolError 504 if it does not answer in time (by default
        the health timeout: a scheduler that slow is unhealthy anyway)."""
        timeout = self.heartbeats.timeout if timeout is None else timeout
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.calls[call_id] = fut
        send(self._sync_to_sched, ControlCall(call_id, kind))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(
                504, f"the scheduler did not answer within {timeout:g} s", None, "server_error"
            ) from None
        finally:
            self.calls.pop(call_id, None)

    async def heartbeat_forever(self) -> None:
        while True:
            self.heartbeat()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    def heartbeat(self) -> None:
        now = time.monotonic()
        seq = self.heartbeats.ping(now)
        if self._to_tokenizer(encode(Heartbeat(seq))):
            self.heartbeats.delivered()
        else:
            self.heartbeats.undelivered(seq, now)

    def health_problem(self) -> str | None:
        return self.dead or self.draining or self.heartbeats.problem(time.monotonic())

    # ---- the dispatcher -------------------------------------------------------------
    async def dispatch_forever(self) -> None:
        while True:
            for msg in await self.inbox.recv_batch():
                if isinstance(msg, OutputBatch):
                    now = time.monotonic()
                    for record in msg.outputs:
                        self._route(record, now)
                elif isinstance(msg, ControlReply):
                    fut = self.calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, Heartbeat):
                    self.heartbeats.pong(msg.seq, msg.step_age)

    def _route(self, record: RequestOutput, now: float) -> None:
        entry = self.routes.get(record.rid)
        if entry is None:
            return  # its client is gone
        api, index = entry
        self.metrics.on_tokens(api.timer, now, len(record.token_ids))
        if record.finished:
            if record.error is None or record.status >= 500:  # refusals are not finished requests
                self.metrics.observe_finish(
                    api.timer.e2e(now),
                    record.queue_time,
                    record.prompt_tokens,
                    record.completion_tokens,
                    record.cached_tokens,
                    record.finish_reason,
                )
            del self.routes[record.rid]
            api.open_choices -= 1
            if api.open_choices == 0:
                self.num_requests -= 1
                self._idle.set()
        api.put(index, record)

    # ---- a graceful stop (relay.api.drain) ---------------------------------------------
    def stop_accepting(self, reason: str) -> None:
        self.draining = reason

    def in_flight(self) -> int:
        return self.num_requests + self.tokenizer_calls

    async def wait_idle(self) -> None:
        while self.in_flight():
            self._idle.clear()
            await self._idle.wait()

    def abort_all(self, message: str) -> int:
        """End every generating request in flight with an error (503), and free it in the
        scheduler; how many API requests that was. (A /tokenize call answers in milliseconds:
        uvicorn's own graceful close covers it.)"""
        apis = {id(api) for api, _ in self.routes.values()}
        now = time.monotonic()
        for rid in list(self.routes):
            send(self._sync_to_sched, AbortRequest(rid, sent_at=time.time()))
            self._route(
                RequestOutput(rid, finish_reason=FinishReason.ABORT, error=message, status=503), now
            )
        return len(apis)

    def fail_all(self, message: str) -> None:
        """A child died: end every request in flight with an error."""
        self.dead = message
        now = time.monotonic()
        for rid in list(self.routes):
            self._route(
                RequestOutput(rid, finish_reason=FinishReason.ABORT, error=message, status=503), now
            )


def build_app(client: ZmqEngineClient, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(
        title="Relay", docs_url=None, redoc_url=None, version=client.server_info.get("version", "")
    )
    app.add_middleware(RequestGuard, config=guard or GuardConfig())
    app.add_middleware(RequestIdMiddleware)  # outermost: refusals echo the client's id too

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(ProtocolError(e.status_code, str(e.detail), None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(ProtocolError(500, f"internal error: {type(e).__name__}", None))

    for api in (openai, responses, anthropic_messages, embeddings, sglang, tokenization, admin):
        api.add_routes(app, client)
    return app
