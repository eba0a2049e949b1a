"""Data-parallel replicas behind sglang-router (`launch.serve --dp N`, docs/scaling.md).

The server tests share one `--dp 2` server with the null runner (no model: what is tested is
the processes, the router and the replicas' caches, and each step is instant on a 2-core CI
box). The last of them kills a replica and then stops the server. The other tests are unit
tests of the pieces: core shares, the replicas' and the router's flags, request ids, the
replica metrics label, the front door (on a stand-in router), and the supervision policy (a
dead replica, the last one, the router) on stand-in processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import dp, dp_replicas
from launch.flags import build_parser
from launch.front import Front, RequestParser
from relay.api import request_id as rid_mod
from relay.metrics import ServerMetrics
from tests.helpers.server_utils import ROOT, Server, alive, free_port, wait_until

MODEL = "SmolLM2-135M-Instruct"


# ---- one --dp 2 server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    metrics_port = free_port()
    s = Server(
        "--dp",
        "2",
        "--load-format",
        "dummy-null",
        "--kv-cache-gb",
        "0.05",
        "--log-requests",
        "--router-prometheus-port",
        str(metrics_port),
    )
    s.router_metrics_port = metrics_port
    yield s
    s.stop()


@pytest.fixture(scope="module")
def replicas(server) -> dict[str, str]:
    """name -> URL, from the ready line ("dp0 http://127.0.0.1:PORT, dp1 ...")."""
    line = next(line for line in server.lines if "Relay is ready" in line)
    return dict(re.findall(r"(dp\d+) (http://127\.0\.0\.1:\d+)", line))


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def titled(server: Server) -> dict[str, int]:
    """Every process of the server by title (the replicas run in process groups of their own)."""
    out = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            out[open(f"/proc/{p.pid}/cmdline").read().strip("\0")] = p.pid
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_openai_client_through_the_router(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    out = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (
        text and whole.choices[0].message.content
    )  # (the null runner's tokens differ per request)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with server.client() as c:
        native = c.post(
            "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}}
        ).json()
    assert native["meta_info"]["completion_tokens"] == 3


@pytest.mark.slow
def test_a_body_without_a_model_is_served_as_by_a_single_server(server):
    """sglang-router alone refuses a completions body without `model` (422) and names a chat
    body's missing model `unknown` (the replicas then say 404): the front door fills it in."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with server.client() as c:
        completion = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        answers = [
            c.post("/v1/chat/completions", json=chat),
            c.post("/v1/chat/completions", json={**chat, "model": None}),
            c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "model": None}),
        ]
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        other = c.post("/v1/completions", json={"prompt": "Hi", "model": "other"})
    assert completion.status_code == 200 and completion.json()["model"] == MODEL, completion.text
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][5:])["model"] == MODEL
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


@pytest.mark.slow
def test_replicas_answer_what_the_router_needs(server, replicas):
    assert sorted(replicas) == ["dp0", "dp1"]
    for name, url in replicas.items():
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            info = c.get("/server_info").json()
            assert info["served_model_name"] == MODEL and info["replica"] == name
            assert c.get("/get_server_info").json()["replica"] == name
            model = c.get("/model_info").json()
            assert model["served_model_name"] == MODEL and os.path.isdir(model["model_path"])
            assert c.get("/get_model_info").json() == model
            load = c.get("/get_load").json()
            assert load[0]["num_reqs"] == 0 and load[0]["num_tokens"] == 0
    with server.client() as c:  # the router registered both, under the served name
        workers = c.get("/workers").json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(replicas.values())
        assert all(w["is_healthy"] and w["model_id"] == MODEL for w in workers)
        loads = c.get("/get_loads").json()["workers"]
        assert all(w["load"] >= 0 for w in loads), "the router reads the replicas' /get_load"


@pytest.mark.slow
def test_metrics_carry_the_replica_and_the_router_has_its_own(server, replicas):
    for name, url in replicas.items():
        text = httpx.get(url + "/metrics", timeout=30).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert all(s.labels["replica"] == name for s in fams["relay:prompt_tokens"].samples)
    router = httpx.get(f"http://127.0.0.1:{server.router_metrics_port}/metrics", timeout=30).text
    assert "smg_http_requests_total" in router
    merged = httpx.get(
        server.url + "/engine_metrics", timeout=30
    )  # the router merges the replicas'
    assert merged.status_code == 200, merged.text
    assert {f'replica="{n}"' for n in replicas} <= set(re.findall(r'replica="dp\d"', merged.text))


@pytest.mark.slow
def test_a_request_id_reaches_the_replicas_log_line(server):
    trace = f"trace-{uuid.uuid4().hex[:12]}"
    with server.client() as c:
        r = c.post(
            "/v1/completions",
            headers={"X-Request-Id": trace},
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == trace
    assert r.json()["id"] == f"comp-{trace}"
    line = wait_until(
        lambda: next((line for line in server.lines if f"rid=comp-{trace} " in line), None),
        10,
        "the replica's request log line",
    )
    assert re.search(r"sched dp[01]\]", line), line  # tagged with the replica that served it


@pytest.mark.slow
def test_process_titles_groups_and_core_shares(server):
    procs = titled(server)
    assert open(f"/proc/{server.proc.pid}/cmdline").read().strip("\0") == "relay::dp"
    for rep in ("dp0", "dp1"):
        for name in ("http", "tokenizer", "sched", "tp0", "detok"):
            assert f"relay::{name} {rep}" in procs, sorted(procs)
        group = os.getpgid(procs[f"relay::http {rep}"])
        assert group != os.getpgid(server.proc.pid), (
            "each replica runs in a process group of its own"
        )
        assert os.getpgid(procs[f"relay::tp0 {rep}"]) == group
    assert "sglang::router" in procs
    cores = [os.sched_getaffinity(procs[f"relay::tp0 {rep}"]) for rep in ("dp0", "dp1")]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not cores[0] & cores[1] and len(cores[0]) == len(cores[1]), cores


# ---- cache-aware routing against round-robin ----------------------------------------------

GROUPS, PER_GROUP = (
    3,
    4,
)  # an odd number of groups: round-robin splits every group over both replicas


def shared_prefix_prompts() -> list[str]:
    """Round by round, one request per group: a long system prompt, then a short question."""
    prefix = [
        f"You are assistant {g}. "
        + " ".join(f"Rule {g}.{i}: answer briefly and precisely." for i in range(40))
        for g in range(GROUPS)
    ]
    return [
        f"{prefix[g]}\nQuestion {r}: what is {r} plus {g}?"
        for r in range(PER_GROUP)
        for g in range(GROUPS)
    ]


def cache_counters(replicas: dict[str, str]) -> tuple[int, int]:
    prompt = cached = 0
    for url in replicas.values():
        sched = httpx.get(url + "/get_server_info", timeout=30).json()["scheduler"]
        prompt += sched["prompt_tokens_total"]
        cached += sched["cached_prompt_tokens_total"]
    return prompt, cached


def hit_rate(router_url: str, replicas: dict[str, str]) -> float:
    for url in replicas.values():
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    before = cache_counters(replicas)
    with httpx.Client(base_url=router_url, timeout=60) as c:
        for prompt in shared_prefix_prompts():  # one at a time: each finds what the last one cached
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
    after = cache_counters(replicas)
    return (after[1] - before[1]) / (after[0] - before[0])


@pytest.mark.slow
def test_cache_aware_routing_hits_the_cache_more_than_round_robin(server, replicas):
    cache_aware = hit_rate(server.url, replicas)
    # The same replicas behind a second router, started by hand as on a multi-host setup.
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *replicas.values(),
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:

        def ready():
            try:
                return (
                    httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=5).json()[
                        "healthy_workers"
                    ]
                    == 2
                )
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        wait_until(ready, 60, "the hand-started router sees both replicas", interval=0.2)
        round_robin = hit_rate(f"http://127.0.0.1:{port}", replicas)
    finally:
        router.terminate()
        router.wait(30)
    # Cache-aware: each group's prefix is computed once (3 of 4 requests hit); round-robin
    # computes it on both replicas (2 of 4).
    assert cache_aware > 0.6 and cache_aware > round_robin + 0.15, (cache_aware, round_robin)


# ---- a dying replica, then SIGTERM (last: it takes the server down) -----------------------


@pytest.mark.slow
def test_a_dead_replica_leaves_the_server_answering_and_sigterm_stops_everything(server, replicas):
    victim = titled(server)["relay::tp0 dp1"]
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: any(
            "replica dp1" in line and "out of the router's rotation" in line
            for line in server.lines
        ),
        30,
        "the supervisor takes dp1 out",
    )
    with server.client() as c:
        wait_until(
            lambda: [w["url"] for w in c.get("/workers").json()["workers"]] == [replicas["dp0"]],
            10,
            "the router has only dp0 left",
        )

    async def burst():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        outs = await asyncio.gather(
            *[
                client.completions.create(model=MODEL, prompt=f"Request {i}", max_tokens=3)
                for i in range(8)
            ]
        )
        await client.close()
        return outs

    assert all(o.usage.completion_tokens == 3 for o in asyncio.run(burst()))
    assert server.proc.poll() is None, "one replica left: the server serves on"

    left = titled(server)
    assert "sglang::router" in left and "relay::http dp0" in left
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 1, "a replica had died: the stop must not hide it"
    assert any(
        "replica dp1" in line and "before the stop signal: exiting 1" in line
        for line in server.lines
    ), server.log
    wait_until(
        lambda: not [p for p in left.values() if alive(p)],
        10,
        "the router and every replica process gone",
    )


# ---- the pieces ------------------------------------------------------------------------------


def test_core_shares():
    assert dp_replicas.share_cores([0, 1], 2) == [[0], [1]]
    assert dp_replicas.share_cores(list(range(8)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert dp_replicas.share_cores([0, 1], 3) == [[0], [1], [0]]


def test_gpu_plan(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    plan = dp_replicas.plan_replicas(2, 2, "auto", [1, 2])
    assert [r.gpus for r in plan] == [["0", "1"], ["2", "3"]] and all(r.cores is None for r in plan)
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        dp_replicas.plan_replicas(3, 2, "cuda", [1, 2, 3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert all(r.cores for r in dp_replicas.plan_replicas(2, 1, "auto", [1, 2]))


def test_replica_and_router_flags():
    parser = build_parser()
    ns = parser.parse_args(
        [
            "--dp",
            "2",
            "--port",
            "8000",
            "--host",
            "127.0.0.1",
            "--tp",
            "2",
            "--log-requests",
            "--kv-cache-gb",
            "0.5",
            "--api-key",
            "k",
            "--allowed-hosts",
            "box",
            "--router-policy",
            "round_robin",
            "--router-args",
            "--cache-threshold 0.5",
        ]
    )
    argv = dp_replicas.replica_argv(parser, ns, dp_replicas.Replica("dp1", 4242))
    again = parser.parse_args(argv)
    assert (
        again.port,
        again.replica_name,
        again.tp_size,
        again.log_requests,
        again.kv_cache_gb,
        again.api_key,
        again.dp,
        again.allowed_hosts,
        again.host,
    ) == (4242, "dp1", 2, True, 0.5, "k", 1, None, "127.0.0.1")
    router = dp_replicas.router_argv(
        ns, [dp_replicas.Replica("dp0", 1), dp_replicas.Replica("dp1", 2)], 4343
    )
    assert router[:4] == ["--host", "127.0.0.1", "--port", "4343"], (
        "behind the front door, on loopback"
    )
    assert router[router.index("--worker-urls") + 1 :][:2] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert (
        router[router.index("--policy") + 1] == "round_robin"
        and router[router.index("--api-key") + 1] == "k"
    )
    assert (
        "http://box:8000" in router and "http://[::1]:8000" in router
    )  # CORS: the names it answers to
    assert router[-2:] == ["--cache-threshold", "0.5"]
    anywhere = parser.parse_args(["--dp", "2", "--host", "0.0.0.0"])
    assert "--cors-allowed-origins" not in dp_replicas.router_argv(anywhere, [], 4343)


def test_request_ids():
    assert rid_mod.usable("abc-123:x/y") == "abc-123:x/y"
    assert rid_mod.usable("has space") is None and rid_mod.usable("x" * 129) is None
    assert rid_mod.request_id("completion", set()).startswith("comp-")
    token = rid_mod._current.set(rid_mod.RequestIds("t1"))
    try:
        assert rid_mod.request_id("chat", set()) == "chat-t1"
        taken = rid_mod.request_id("chat", {"chat-t1"})
        assert taken.startswith("chat-t1-") and taken != "chat-t1"
        assert rid_mod.request_id("chat", {"chat-t1-0"}) != "chat-t1"  # an n > 1 request holds it
    finally:
        rid_mod._current.reset(token)


def test_response_header_echoes_only_ascii_ids():
    """A /generate body's rid may be any text; the X-Request-Id echo must not fail on it."""
    import asyncio

    async def app(scope, receive, send):
        rid_mod.submitted(scope["rid"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    sent = []

    async def send(message):
        sent.append(message)

    async def run(rid):
        sent.clear()
        await rid_mod.RequestIdMiddleware(app)(
            {"type": "http", "headers": [], "rid": rid}, None, send
        )
        return dict(sent[0]["headers"]).get(rid_mod.HEADER.encode())

    assert asyncio.run(run("gene-abc")) == b"gene-abc"
    assert asyncio.run(run("ré-ключ")) is None


def test_replica_label_on_every_series():
    m = ServerMetrics("dp3")
    m.observe_finish(1.0, 0.1, 10, 5, 3, "stop")
    fams = list(text_string_to_metric_families(m.render()[0].decode()))
    assert fams and all(s.labels.get("replica") == "dp3" for f in fams for s in f.samples)
    assert "relay:aborted_requests" not in {f.name for f in fams}, (
        "no empty families (the router cannot merge them)"
    )
    assert "replica=" not in ServerMetrics().render()[0].decode()


def test_the_front_door_fills_a_missing_model_and_reframes_each_request():
    chunked_body = b'{"prompt": "Hi"}'
    sent = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunked_body), chunked_body)
        + request(b"POST", b"/v1/chat/completions?x=1", b'{"model": null, "messages": []}')
        + request(b"GET", b"/v1/models", b"")
        + request(b"POST", b"/generate", b'{"text": "Hi"}')
        + request(b"POST", b"/v1/completions", b'{"model": "other", "prompt": "Hi"}')
        + request(b"POST", b"/v1/completions", b"[1, 2]")
    )
    parser = RequestParser(1 << 20, on_continue=lambda: None)
    requests = parser.feed(sent[:40]) + parser.feed(
        sent[40:]
    )  # split mid-request: pipelined, in pieces
    assert len(requests) == 6 and not parser.partial
    framed = b"".join(r.encode("M") for r in requests)
    assert b"transfer-encoding" not in framed.lower()
    again = RequestParser(1 << 20, on_continue=lambda: None).feed(
        framed
    )  # as the router reads them
    assert [(r.method, r.url) for r in again] == [(r.method, r.url) for r in requests]
    bodies = [json.loads(r.body) if r.body else None for r in again]
    assert bodies == [
        {"prompt": "Hi", "model": "M"},
        {"model": "M", "messages": []},
        None,
        {"text": "Hi"},
        {"model": "other", "prompt": "Hi"},
        [1, 2],
    ]


def request(method: bytes, url: bytes, body: bytes) -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        method,
        url,
        len(body),
        body,
    )


def test_the_front_door_streams_answers_and_passes_a_disconnect_on():
    """A client that goes away closes its router connection (the router then aborts its request);
    a body past the limit gets a 413; a request that stalls half-sent ends its connection."""

    async def main():
        bodies, router_saw_eof = asyncio.Queue(), asyncio.Event()

        async def router(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
            await bodies.put(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            if not await reader.read():
                router_saw_eof.set()

        stub = await asyncio.start_server(router, "127.0.0.1", 0)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # connections wait in its backlog until the front accepts them
        front = Front(stub.sockets[0].getsockname()[1], "M", max_body=100, timeout=0.5)
        stop = asyncio.Event()
        serving = asyncio.ensure_future(front.serve(listener, stop))
        address = listener.getsockname()

        reader, writer = await asyncio.open_connection(*address)
        writer.write(request(b"POST", b"/v1/completions", b"{}"))
        assert json.loads(await asyncio.wait_for(bodies.get(), 10)) == {"model": "M"}
        assert (await asyncio.wait_for(reader.readuntil(b"hello"), 10)).startswith(
            b"HTTP/1.1 200 OK"
        )
        writer.close()  # mid-answer
        await asyncio.wait_for(router_saw_eof.wait(), 10)

        reader, writer = await asyncio.open_connection(*address)
        writer.write(request(b"POST", b"/v1/completions", b"x" * 500))
        answer = await asyncio.wait_for(reader.read(), 10)
        assert (
            answer.startswith(b"HTTP/1.1 413")
            and json.loads(answer.split(b"\r\n\r\n")[1])["error"]["code"] == 413
        )

        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert await asyncio.wait_for(reader.read(), 10) == b"", (
            "closed once the request stalled past the timeout"
        )
        stop.set()
        await asyncio.wait_for(serving, 10)
        stub.close()

    asyncio.run(main())


class _Args(argparse.Namespace):
    api_key = None
    shutdown_timeout = 0.0


def test_supervision_policy_on_stand_in_processes():
    """A replica that exits leaves the others serving; the last one, or the router, ends it."""

    def sleeper():
        return subprocess.Popen(["sleep", "60"])

    ns = _Args(host="127.0.0.1", port=free_port())  # no router there: removal is best effort

    def supervised(kill: list[int]) -> tuple[int, float]:
        reps = [dp_replicas.Replica(f"dp{i}", 1, proc=sleeper()) for i in range(2)]
        sup = dp.Supervisor(argparse.ArgumentParser(), ns, reps, free_port())
        sup.router = sleeper()
        everyone = [sup.router] + [r.proc for r in reps]
        for i in kill:
            everyone[i].kill()
        start = time.monotonic()
        try:
            return sup.supervise(), time.monotonic() - start
        finally:
            sup.stop()
            assert all(p.poll() is not None for p in everyone)

    assert supervised([1, 2])[0] == 1  # both replicas: nothing left
    assert supervised([0])[0] == 1  # the router

    reps = [dp_replicas.Replica(f"dp{i}", 1, proc=sleeper()) for i in range(2)]
    sup = dp.Supervisor(argparse.ArgumentParser(), ns, reps, free_port())
    sup.router = sleeper()
    reps[0].proc.kill()
    try:
        with pytest.raises(TimeoutError):  # one replica left: still supervising
            _run_for(sup.supervise, 2.0)
    finally:
        sup.stop()


def test_a_stop_after_a_death_names_it():
    """SIGTERM after a replica (or the router) died must exit non-zero: died() names who."""
    reps = [
        dp_replicas.Replica(f"dp{i}", 1, proc=subprocess.Popen(["sleep", "60"])) for i in range(2)
    ]
    sup = dp.Supervisor(
        argparse.ArgumentParser(), _Args(host="127.0.0.1", port=free_port()), reps, free_port()
    )
    sup.router = subprocess.Popen(["sleep", "60"])
    try:
        assert sup.died() == []
        reps[1].proc.kill()
        reps[1].proc.wait()  # as the supervisor's watch thread does: reaped already
        sup.router.terminate()  # stopped with the server (a signal to its process group): no death
        sup.router.wait()
        assert sup.died() == [f"replica dp1 (pid {reps[1].proc.pid}) exited with code -9"]
    finally:
        sup.stop()


def _run_for(fn, seconds: float):
    """Run fn in a thread; TimeoutError if it is still running after `seconds`."""
    import threading

    result = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError
    return result[0]
