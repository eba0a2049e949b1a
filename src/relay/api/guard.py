"""What stands between the network and the API handlers: checks every request must pass
before a handler sees it, and connection limits that keep the server's descriptors safe.

- `RequestGuard`, an ASGI middleware: Host and Origin checks (a web page cannot drive a
  local server through DNS rebinding or a cross-site POST), the API key, JSON-only POST
  bodies, a body size limit checked before anything is parsed, and a deadline to receive
  the body. It reads the body once and replays it to the handler.
- `guarded_protocol()`, uvicorn's HTTP protocol with a connection cap and an idle deadline:
  a connection with no request in progress (never sent one, stalled mid-headers, or idle
  after a response) is closed after `idle_timeout`; at the cap the longest-idle connection
  makes room for a new one, and only when every connection is busy is the new one refused
  with a 503.
Every refusal is an OpenAI-shaped JSON error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from relay.api.errors import ProtocolError, anthropic_error_body, error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt as JSON is ~1 MB: 16 MiB is generous
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
# Descriptors the http process keeps for itself beyond client connections (ZeroMQ, logs, ...).
FD_RESERVE = 256


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None
    # Host names (or addresses) requests may be addressed to; None accepts any.
    allowed_hosts: frozenset[str] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = 30.0


def default_allowed_hosts(bind_host: str, extra: list[str] | None) -> frozenset[str] | None:
    """The Host names a server bound to `bind_host` answers to. Loopback binds answer to
    loopback names only; a wildcard bind (0.0.0.0, ::) cannot know its names and accepts
    any unless the operator lists them; "*" in `extra` accepts any."""
    if extra and "*" in extra:
        return None
    names = {h.lower().strip("[]") for h in extra or []}
    if bind_host in ("0.0.0.0", "::", ""):
        return frozenset(names) if names else None
    return frozenset(names | LOOPBACK_NAMES | {bind_host.lower().strip("[]")})


def _hostname(host_header: str) -> str:
    """'example.com:8080' -> 'example.com'; '[::1]:30000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    def __init__(self, app, config: GuardConfig):
        self.app = app
        self.cfg = config
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_headers(scope)
            if scope["method"] == "POST":
                receive = await self._buffered_body(scope, receive)
        except ProtocolError as e:
            return await send_error(send, e, anthropic=scope["path"].startswith("/v1/messages"))
        await self.app(scope, receive, send)

    def _check_headers(self, scope: Scope) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        allowed = self.cfg.allowed_hosts
        if allowed is not None and _hostname(headers.get("host", "")) not in allowed:
            raise ProtocolError(
                400, "this server does not answer to that Host header (see --allowed-hosts)", "Host"
            )
        origin = headers.get("origin")
        if (
            origin
            and allowed is not None
            and scope["method"] != "GET"
            and _hostname(urlsplit(origin).netloc) not in allowed
        ):
            raise ProtocolError(
                403,
                "cross-origin requests are not allowed (see --allowed-hosts)",
                "Origin",
                "permission_error",
            )
        if self._key is not None and scope["path"] != "/health" and not self._authorized(headers):
            raise ProtocolError(401, "missing or wrong API key", None, "authentication_error")
        if scope["method"] == "POST" and _has_body(headers):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise ProtocolError(
                    415,
                    "POST bodies must be JSON: send 'Content-Type: application/json'",
                    "Content-Type",
                )
            length = headers.get("content-length")
            if length is not None and (
                not length.isdigit() or int(length) > self.cfg.max_body_bytes
            ):
                raise _too_large(self.cfg.max_body_bytes)

    def _authorized(self, headers: dict[str, str]) -> bool:
        """The key as OpenAI clients send it (Authorization: Bearer) or Anthropic's
        (x-api-key); both are compared in constant time."""
        bearer = headers.get("authorization", "").encode("latin-1")
        x_api_key = headers.get("x-api-key", "").encode("latin-1")
        ok_bearer = hmac.compare_digest(bearer, b"Bearer " + self._key)
        ok_x = hmac.compare_digest(x_api_key, self._key)
        return ok_bearer or ok_x

    async def _buffered_body(self, scope: Scope, receive: Receive) -> Receive:
        """Read the whole body under the size limit and deadline; a receive that replays it
        and then passes on what the client sends next (its disconnect)."""
        chunks: list[bytes] = []
        size, limit = 0, self.cfg.max_body_bytes
        deadline = time.monotonic() + self.cfg.body_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise ProtocolError(
                    408, f"the request body did not arrive within {self.cfg.body_timeout:g} s", None
                ) from None
            if message["type"] == "http.disconnect":
                raise ProtocolError(400, "the client disconnected while sending the body", None)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def _has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0") != "0" or "chunked" in headers.get(
        "transfer-encoding", ""
    )


def _too_large(limit: int) -> ProtocolError:
    return ProtocolError(
        413, f"the request body exceeds {limit} bytes (--max-request-body-bytes)", None
    )


async def send_error(send: Send, e: ProtocolError, anthropic: bool = False) -> None:
    """e as OpenAI's error body, or (anthropic: the /v1/messages routes) as Anthropic's."""
    shaped = (
        anthropic_error_body(e.status, e.message)
        if anthropic
        else error_body(e.status, e.message, e.param, e.type)
    )
    body = json.dumps(shaped).encode()
    await send(
        {
            "type": "http.response.start",
            "status": e.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ---- connections -----------------------------------------------------------------------


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(fd_limit: int) -> int:
    return max(16, fd_limit - FD_RESERVE)


_REFUSED = json.dumps(
    error_body(503, "too many connections; retry later", None, "server_error")
).encode()
_REFUSED_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_REFUSED)).encode() + b"\r\n\r\n" + _REFUSED
)


def guarded_protocol(max_connections: int):
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with the connection
    cap; pass it as uvicorn.Config(http=...) and run close_idle_forever beside the server."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class GuardedProtocol(Base):
        def connection_made(self, transport) -> None:
            self.idle_since = time.monotonic()
            self.refused = False
            if len(self.connections) >= max_connections and not _evict_longest_idle(
                self.connections
            ):
                self.refused = True
                self.transport = transport
                transport.write(_REFUSED_RESPONSE)
                transport.close()
                return
            super().connection_made(transport)

        def connection_lost(self, exc) -> None:
            if not self.refused:
                super().connection_lost(exc)

        def on_response_complete(self) -> None:
            self.idle_since = time.monotonic()
            super().on_response_complete()

        @property
        def busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

    return GuardedProtocol


def _evict_longest_idle(connections) -> bool:
    idle = [c for c in connections if not c.busy]
    if not idle:
        return False
    victim = min(idle, key=lambda c: c.idle_since)
    connections.discard(victim)
    victim.transport.close()
    return True


def close_idle_connections(connections, idle_timeout: float, now: float | None = None) -> int:
    """Close connections that have had no request in progress for idle_timeout seconds:
    never-used ones, ones stalled mid-headers, and keep-alive ones left open. Run it
    periodically; returns how many it closed."""
    now = time.monotonic() if now is None else now
    stale = [c for c in connections if not c.busy and now - c.idle_since > idle_timeout]
    for c in stale:
        c.transport.close()
    return len(stale)


async def close_idle_forever(connections, idle_timeout: float) -> None:
    while True:
        await asyncio.sleep(min(1.0, idle_timeout / 2))
        close_idle_connections(connections, idle_timeout)
