"""The front door of `launch.serve --dp N`: it listens on --host/--port and passes every
connection on to sglang-router, which listens on a loopback port behind it.

It exists for one change: an OpenAI request whose body names no `model` (absent or null) gets
the served model's name, so --dp accepts what a single server accepts. sglang-router 0.3.2 has
no setting for it: it refuses such a /v1/completions body while deserializing it (422, "missing
field `model`"), and sends such a chat body on with `"model": "unknown"`, which the replicas
refuse (404).

Each client connection gets a router connection of its own, so a client that goes away closes
its router connection, and the router aborts what it was serving for it, as it would without
this front. Requests are parsed (httptools) and sent on whole, re-framed with a Content-Length;
responses are copied back byte for byte. Time limits, body limits and the like are the router's
and the replicas', except two that only a buffering hop needs: a request that takes longer than
--http-timeout to arrive ends its connection, and one whose body exceeds
--max-request-body-bytes gets a 413 (the replicas' answer to it). An idle connection stays
open as long as the router keeps it (it closes none).

It runs on an event loop thread of relay::dp (sglang-router's own process holds the GIL while it
serves).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
from collections.abc import Callable

import httptools

OPENAI_ROUTES = (b"/v1/completions", b"/v1/chat/completions")
# Request headers not sent on as they came: the body is re-framed, and 100 Continue answered here.
_REFRAMED = {b"content-length", b"transfer-encoding", b"expect"}
_READ_BYTES = 1 << 16
_TOO_LARGE = (
    b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


def with_model(body: bytes, model: str) -> bytes:
    """An OpenAI body with "model" set to `model` where it names none (absent or null); any
    other body unchanged (one that is not a JSON object is the router's to refuse)."""
    try:
        request = json.loads(body)
    except ValueError:
        return body
    if not isinstance(request, dict) or request.get("model") is not None:
        return body
    return json.dumps({**request, "model": model}).encode()


@dataclasses.dataclass
class Request:
    method: bytes = b""
    url: bytes = b""
    version: bytes = b"1.1"
    headers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)
    body: bytearray = dataclasses.field(default_factory=bytearray)

    def encode(self, model: str) -> bytes:
        """This request as the router gets it: as sent, but framed by a Content-Length, and an
        OpenAI body that names no model naming the served one."""
        body = bytes(self.body)
        if self.method == b"POST" and self.url.split(b"?", 1)[0] in OPENAI_ROUTES:
            body = with_model(body, model)
        lines = [b"%s %s HTTP/%s" % (self.method, self.url, self.version)]
        lines += [
            name + b": " + value for name, value in self.headers if name.lower() not in _REFRAMED
        ]
        lines.append(b"content-length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    def expects_continue(self) -> bool:
        return any(n.lower() == b"expect" and v.lower() == b"100-continue" for n, v in self.headers)


class RequestParser:
    """The whole requests in what a client has sent so far (httptools calls the on_* methods)."""

    def __init__(self, max_body: int, on_continue: Callable[[], None]):
        self.parser = httptools.HttpRequestParser(self)
        self.max_body = max_body
        self.on_continue = on_continue  # the client waits for 100 Continue before sending the body
        self.current: Request | None = None
        self.complete: list[Request] = []
        self.too_large = False  # a body past max_body: the connection ends with a 413

    def feed(self, data: bytes) -> list[Request]:
        """Raises httptools.HttpParserError on what is not HTTP/1.x (an upgrade included)."""
        self.parser.feed_data(data)
        complete, self.complete = self.complete, []
        return complete

    @property
    def partial(self) -> bool:
        return self.current is not None

    def on_message_begin(self) -> None:
        self.current = Request()

    def on_url(self, url: bytes) -> None:
        self.current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.current.method = self.parser.get_method()
        self.current.version = self.parser.get_http_version().encode()
        if self.current.expects_continue():
            self.on_continue()

    def on_body(self, body: bytes) -> None:
        self.too_large = self.too_large or len(self.current.body) + len(body) > self.max_body
        if not self.too_large:
            self.current.body += body

    def on_message_complete(self) -> None:
        self.complete.append(self.current)
        self.current = None


@dataclasses.dataclass
class Front:
    router_port: int  # on 127.0.0.1
    model: str  # the served model's name
    max_body: int
    timeout: float  # seconds a request may take to arrive
    connections: set[asyncio.Task] = dataclasses.field(default_factory=set)

    async def serve(self, sock: socket.socket, stop: asyncio.Event) -> None:
        """Until stop is set; then no new connections, and those open are served until the
        router closes them (it lets requests in flight finish first)."""
        server = await asyncio.start_server(
            self.connection, sock=sock, limit=_READ_BYTES, backlog=1024
        )
        await stop.wait()
        server.close()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def connection(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        try:
            await self.relay(client_r, client_w)
        finally:
            client_w.close()
            self.connections.discard(task)

    async def relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Until the client or the router closes its side."""
        try:
            router_r, router_w = await asyncio.open_connection(
                "127.0.0.1", self.router_port, limit=_READ_BYTES
            )
        except OSError:
            return  # the router is stopping: as it would refuse the connection
        ends = [
            asyncio.ensure_future(self.requests(client_r, client_w, router_w)),
            asyncio.ensure_future(copy(router_r, client_w)),
        ]
        try:
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for end in ends:
                end.cancel()
            router_w.close()

    async def requests(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        router_w: asyncio.StreamWriter,
    ) -> None:
        """The client's requests, each sent on once whole, until it goes away (as a disconnect:
        closing its router connection makes the router abort what it serves for it)."""
        parser = RequestParser(
            self.max_body, lambda: client_w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        )
        while data := await self.read(client_r, parser.partial):
            try:
                complete = parser.feed(data)
            except httptools.HttpParserError:
                return
            if parser.too_large:
                await self.refuse_too_large(client_w)
                return
            for request in complete:
                router_w.write(request.encode(self.model))
            try:
                await router_w.drain()
            except ConnectionError:
                return

    async def read(self, reader: asyncio.StreamReader, partial: bool) -> bytes:
        """The next bytes a client sends; b"" once it has gone, or a request it started has taken
        longer than the timeout to arrive."""
        try:
            read = reader.read(_READ_BYTES)
            return await (asyncio.wait_for(read, self.timeout) if partial else read)
        except (asyncio.TimeoutError, ConnectionError):
            return b""

    async def refuse_too_large(self, client_w: asyncio.StreamWriter) -> None:
        body = json.dumps(
            {
                "object": "error",
                "error": {
                    "message": f"the request body is larger than {self.max_body} bytes (--max-request-body-bytes)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": 413,
                },
            }
        ).encode()
        client_w.write(_TOO_LARGE % (len(body), body))
        try:
            await client_w.drain()
        except ConnectionError:
            pass


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The router's responses to the client as they come, until either side closes."""
    try:
        while data := await reader.read(_READ_BYTES):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class FrontThread:
    """The front on an event loop thread of its own; on_exit(error) runs there if it stops
    before stop() (a failure: the server cannot be reached)."""

    def __init__(
        self, front: Front, sock: socket.socket, on_exit: Callable[[BaseException | None], None]
    ):
        self.front = front
        self.sock = sock
        self.on_exit = on_exit
        self.loop = new_event_loop()
        self.stop_event = asyncio.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="front")

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        error: BaseException | None = None
        try:
            self.loop.run_until_complete(self.front.serve(self.sock, self.stop_event))
        except Exception as e:  # noqa: BLE001 (reported to the supervisor, which stops the server)
            error = e
        if not self.stopping:
            self.on_exit(error)

    def stop(self) -> None:
        """Stop taking connections; those open are served until the router closes them."""
        self.stopping = True
        self.loop.call_soon_threadsafe(self.stop_event.set)
