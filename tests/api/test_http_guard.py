"""The HTTP front door without processes: the request guard (in-process ASGI), connection
limits, pipeline heartbeats and stale ipc directories."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from ipc.codec import decode
from ipc.messages import Heartbeat
from ipc.sockets import (
    TOKENIZER,
    endpoint,
    make_ipc_dir,
    pull,
    remove_ipc_dir,
    remove_stale_ipc_dirs,
)
from procs.http_server import ZmqEngineClient
from relay.api.errors import ProtocolError
from relay.api.guard import (
    GuardConfig,
    RequestGuard,
    _evict_longest_idle,
    close_idle_connections,
    default_allowed_hosts,
)
from relay.api.parsed_request import ParsedRequest
from relay.health import Heartbeats
from relay.sampling_params import SamplingParams
from tests.helpers.paths import ROOT


async def echo_app(scope, receive, send):
    """Answers with the body it received, so replaying is visible."""
    message = await receive()
    body = json.dumps({"got": message.get("body", b"").decode()}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def call(
    cfg: GuardConfig,
    method: str = "POST",
    path: str = "/v1/completions",
    body: bytes | None = b"{}",
    headers: dict | None = None,
) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=RequestGuard(echo_app, cfg))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1:30000"
        ) as client:
            h = {"content-type": "application/json", **(headers or {})}
            return await client.request(method, path, content=body, headers=h)

    return asyncio.run(go())


LOCAL = GuardConfig(allowed_hosts=default_allowed_hosts("127.0.0.1", None))


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param


def test_a_good_request_passes_with_its_body_replayed():
    r = call(LOCAL, body=b'{"prompt": "hi"}')
    assert r.status_code == 200 and r.json() == {"got": '{"prompt": "hi"}'}


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_post_bodies_must_be_json(content_type):
    assert_error(call(LOCAL, headers={"content-type": content_type}), 415, "Content-Type")
    assert (
        call(LOCAL, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    )


def test_a_bodyless_post_needs_no_content_type():
    """`curl -X POST /flush_cache` keeps working; a cross-site page is stopped by Origin."""
    assert (
        call(LOCAL, path="/flush_cache", body=None, headers={"content-type": ""}).status_code == 200
    )


def test_body_size_limit_before_parsing():
    cfg = GuardConfig(max_body_bytes=100)
    assert_error(call(cfg, body=b"x" * 101), 413)
    assert call(cfg, body=b"{" + b" " * 98 + b"}").status_code == 200

    async def chunked():  # no Content-Length: counted while it streams in
        async def gen():
            for _ in range(10):
                yield b"x" * 20

        transport = httpx.ASGITransport(app=RequestGuard(echo_app, cfg))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.post(
                "/v1/completions", content=gen(), headers={"content-type": "application/json"}
            )

    assert_error(asyncio.run(chunked()), 413)


def test_a_body_that_never_arrives_times_out():
    async def go():
        async def receive():
            await asyncio.sleep(3600)

        sent = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/generate",
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"10")],
        }
        await RequestGuard(echo_app, GuardConfig(body_timeout=0.05))(scope, receive, send)
        return sent

    sent = asyncio.run(go())
    assert sent[0]["status"] == 408 and json.loads(sent[1]["body"])["error"]["code"] == 408


def test_host_and_origin_checks_stop_rebinding_and_cross_site_posts():
    assert_error(call(LOCAL, headers={"host": "evil.example"}), 400, "Host")
    assert call(LOCAL, headers={"host": "localhost:30000"}).status_code == 200
    assert call(LOCAL, headers={"host": "[::1]:30000"}).status_code == 200
    assert_error(call(LOCAL, headers={"origin": "http://evil.example"}), 403, "Origin")
    assert call(LOCAL, headers={"origin": "http://localhost:3000"}).status_code == 200
    assert (
        call(
            LOCAL, method="GET", path="/health", body=None, headers={"origin": "http://x.example"}
        ).status_code
        == 200
    )


def test_allowed_hosts_policy():
    assert default_allowed_hosts("0.0.0.0", None) is None  # a wildcard bind cannot know its names
    assert default_allowed_hosts("0.0.0.0", ["api.example"]) == {"api.example"}
    assert default_allowed_hosts("127.0.0.1", ["*"]) is None
    assert "10.0.0.5" in default_allowed_hosts("10.0.0.5", None)
    assert call(GuardConfig(), headers={"host": "anything.example"}).status_code == 200


def test_api_key_on_every_path_but_health():
    cfg = GuardConfig(api_key="sekret")
    assert_error(call(cfg), 401)
    assert_error(call(cfg, headers={"authorization": "Bearer sekreT"}), 401)
    assert call(cfg, headers={"authorization": "Bearer sekret"}).status_code == 200
    assert call(cfg, method="GET", path="/health", body=None).status_code == 200
    assert_error(call(cfg, method="GET", path="/metrics", body=None), 401)


# ---- connections --------------------------------------------------------------------------


class FakeTransport:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class FakeConn:
    def __init__(self, idle_since: float, busy: bool = False):
        self.idle_since, self.busy, self.transport = idle_since, busy, FakeTransport()


def test_idle_connections_are_closed_after_the_timeout_and_busy_ones_never():
    conns = {FakeConn(0.0), FakeConn(8.0), FakeConn(0.0, busy=True)}
    assert close_idle_connections(conns, idle_timeout=5.0, now=10.0) == 1
    assert [c.idle_since for c in conns if c.transport.closed] == [0.0]


def test_at_the_cap_the_longest_idle_connection_makes_room():
    old, new, busy = FakeConn(1.0), FakeConn(5.0), FakeConn(0.0, busy=True)
    conns = {old, new, busy}
    assert _evict_longest_idle(conns) and old.transport.closed and old not in conns
    assert _evict_longest_idle(conns) and new.transport.closed
    assert not _evict_longest_idle(conns), (
        "a busy connection is never evicted: the new one is refused"
    )


# ---- heartbeats ---------------------------------------------------------------------------


def test_heartbeats_report_a_stalled_pipeline_and_a_stuck_step():
    hb = Heartbeats(timeout=5.0)
    a = hb.ping(0.0)
    assert hb.problem(4.0) is None
    b = hb.ping(1.0)
    hb.pong(b, 0.0)  # a later one came back, an earlier one did not: still stalled somewhere
    assert "no heartbeat" in hb.problem(5.5)
    hb.pong(a, 0.0)
    assert hb.problem(6.0) is None
    hb.pong(hb.ping(7.0), 6.0)  # the scheduler says a step has run for 6 s
    assert "model step" in hb.problem(7.2)


def test_with_every_tokenizer_gone_the_http_process_never_blocks_and_reports_it():
    """A bound PUSH with no peer blocks its sender: one heartbeat once froze the event loop of a
    server whose tokenizer had died, so it ignored SIGTERM for ever."""
    ipc_dir = make_ipc_dir()
    client = ZmqEngineClient(ipc_dir, "m", 100, 8, {}, health_timeout=5.0)
    try:
        client.heartbeat()  # returns: nothing is connected to take it
        assert client.health_problem() is None, (
            "an outage shorter than the health timeout is tolerated"
        )
        assert "no tokenizer" in client.heartbeats.problem(time.monotonic() + 6.0)
        with pytest.raises(ProtocolError) as refused:
            client.submit(ParsedRequest(SamplingParams(max_new_tokens=4), text="hi"), "completion")
        assert refused.value.status == 503 and not client.routes and client.num_requests == 0
    finally:
        client.ctx.destroy(linger=0)
        remove_ipc_dir(ipc_dir)


def test_the_server_answers_only_once_a_tokenizer_has_connected():
    """Tokenizers connect before the http process binds, and zmq retries a connect only every
    100 ms: a server that answered at once refused its first requests with 503."""
    ipc_dir = make_ipc_dir()
    client = ZmqEngineClient(ipc_dir, "m", 100, 8, {}, health_timeout=5.0)
    ctx = zmq.Context()
    try:
        assert not asyncio.run(client.wait_for_tokenizer(0.05))
        tokenizer = pull(ctx, endpoint(ipc_dir, TOKENIZER), bind=False)
        assert asyncio.run(client.wait_for_tokenizer(5.0))
        client.heartbeat()
        assert isinstance(decode(tokenizer.recv()), Heartbeat)
    finally:
        ctx.destroy(linger=0)
        client.ctx.destroy(linger=0)
        remove_ipc_dir(ipc_dir)


def test_a_delivered_heartbeat_ends_a_tokenizer_outage():
    hb = Heartbeats(timeout=5.0)
    hb.undelivered(hb.ping(0.0), 0.0)
    assert "no tokenizer" in hb.problem(5.5)
    hb.ping(6.0)
    hb.delivered()
    assert hb.problem(6.5) is None


# ---- stale ipc directories ----------------------------------------------------------------


def test_ipc_directories_of_killed_servers_are_removed_and_live_ones_kept():
    code = "import sys; sys.path[:0] = ['.', 'src']; from ipc.sockets import make_ipc_dir; print(make_ipc_dir())"
    dead = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    live = make_ipc_dir()
    try:
        assert os.path.isdir(dead)
        removed = remove_stale_ipc_dirs()
        assert dead in removed and not os.path.exists(dead)
        assert os.path.isdir(live) and live not in removed
    finally:
        remove_ipc_dir(live)
        remove_ipc_dir(dead)
