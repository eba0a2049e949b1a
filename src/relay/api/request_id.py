"""Request ids that a client or a router chose: the `X-Request-Id` header.

A router in front of several replicas (sglang-router) forwards the header it was given, so
one id names a request in the client's logs, the router's and the replica's. The id a
request runs under here is `<kind>-<header value>` (`comp-`, `chat-`, `gene-`: the shape of
the ids Relay makes), so its `--log-requests` line, its response `id` and `/abort_request`
all carry it; the response echoes it in `X-Request-Id`. A header value that is not a short
printable token is ignored (Relay makes an id, as without the header): a tracing header never
fails a request. An id already in flight gets a suffix instead of a refusal.

`RequestIdMiddleware` reads the header into a context variable for the route's task;
`request_id()` makes the id when the route submits its request.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

HEADER = "x-request-id"
MAX_LEN = 128
_TOKEN = re.compile(rf"[\x21-\x7e]{{1,{MAX_LEN}}}")  # visible ASCII, no spaces


@dataclass
class RequestIds:
    given: str | None  # the header's value, if usable
    used: str | None = None  # the id the request was submitted under


_current: contextvars.ContextVar[RequestIds | None] = contextvars.ContextVar(
    "relay_request_ids", default=None
)


def usable(value: str | None) -> str | None:
    return value if value is not None and _TOKEN.fullmatch(value) else None


def request_id(kind: str, in_use: Container[str]) -> str:
    """The id for a new request of `kind` (generate, completion, chat, health ...)."""
    ids = _current.get()
    prefix = kind[:4]
    if ids is None or ids.given is None:
        rid = f"{prefix}-{uuid.uuid4().hex}"
    else:
        rid = f"{prefix}-{ids.given}"
        if rid in in_use or f"{rid}-0" in in_use:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
    return rid


def submitted(rid: str | None) -> None:
    """Record the id a request runs under, for the response header (None: no one id names it,
    as a /generate batch with a list of rids; the header echoes the client's, if any)."""
    ids = _current.get()
    if ids is not None:
        ids.used = rid


class RequestIdMiddleware:
    """ASGI middleware: the `X-Request-Id` header in, the request's id out."""

    def __init__(self, app: Callable[..., Any]):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = None
        for k, v in scope["headers"]:
            if k.lower() == HEADER.encode():
                given = usable(v.decode("latin-1"))
                break
        ids = RequestIds(given)
        token = _current.set(ids)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                # A /generate body's own `rid` may hold any text; a header carries visible ASCII only.
                rid = usable(ids.used or ids.given)
                if rid is not None:
                    headers = [
                        (k, v)
                        for k, v in message.get("headers", [])
                        if k.lower() != HEADER.encode()
                    ]
                    message = {
                        **message,
                        "headers": [*headers, (HEADER.encode(), rid.encode("latin-1"))],
                    }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
