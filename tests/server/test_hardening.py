"""A careless or hostile client against a real server: one request's bad input or failure
never hurts another, every error is JSON, nothing leaks, and the server cannot be exhausted.

One server for the module: a tiny random-weight Llama with the default model's tokenizer and
full vocabulary (fast steps, real processes and runner), under a 1,024-descriptor limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.helpers.server_utils import Server, wait_until

pytestmark = pytest.mark.slow

MAX_BODY = 4_000_000
FD_LIMIT = 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(
        "--model-path",
        tiny_model_dir("llama-fullvocab"),
        "--served-model-name",
        "tiny",
        "--kv-cache-gb",
        "0.05",
        "--context-length",
        "160",
        "--http-timeout",
        "2",
        "--health-timeout",
        "3",
        "--max-request-body-bytes",
        str(MAX_BODY),
        max_open_files=FD_LIMIT,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def completion(client, **body):
    return client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, **body})


def assert_json_error(r: httpx.Response, status: int, param: str | None = "?") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str)
    if param != "?":
        assert err["param"] == param
    return err


def assert_nothing_held(client) -> None:
    """No request in flight anywhere and no KV locked, once the server has settled."""

    def settled():
        info = client.get("/get_server_info").json()
        sched = info["scheduler"]
        return (
            info["num_http_requests"] == 0
            and sched["num_running"] == 0
            and sched["num_waiting"] == 0
            and sched["kv_locked_tokens"] == 0
        )

    wait_until(settled, 30, "no request in flight and no locked KV")
    assert completion(client).status_code == 200, "a normal request still succeeds"


# ---- 1. a bad sampling field fails only its own request --------------------------------------


def test_an_out_of_vocabulary_stop_id_fails_only_itself(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:

            async def stream():
                body = {
                    "prompt": "Once upon a time",
                    "max_tokens": 24,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                return r.status_code, lines

            streams = [asyncio.create_task(stream()) for _ in range(8)]
            await asyncio.sleep(0)
            bad = await c.post(
                "/v1/completions",
                json={
                    "prompt": "x",
                    "max_tokens": 4,
                    "min_tokens": 2,
                    "stop_token_ids": [1_000_000_000],
                },
            )
            return bad, await asyncio.gather(*streams)

    bad, streams = asyncio.run(go())
    assert_json_error(bad, 400, "stop_token_ids")
    for status, lines in streams:
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "length"


# ---- 2. invalid Unicode: a 400 naming the field, and no leaked in-flight slot ---------------

SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "\\udfff"}]}',
        "messages.0.content",
    ),
    ("/v1/completions", '{"prompt": "a", "stop": ["\\ud800"]}', "stop.0"),
    ("/generate", '{"text": "a", "rid": "\\ud800"}', "rid"),
]


def test_invalid_unicode_is_a_400_naming_the_field_and_leaks_nothing(client):
    """Each of these was a plain-text 500 that kept an in-flight slot for good: ~4,100 of
    them made every later request a 503."""
    for _ in range(50):
        for path, raw, param in SURROGATE_BODIES:
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert_json_error(r, 400, param)
    assert client.get("/get_server_info").json()["num_http_requests"] == 0
    assert_nothing_held(client)


# ---- 3. every error is JSON with the right status ----------------------------------------------


@pytest.mark.parametrize(
    "method, path, raw, headers, status",
    [
        ("POST", "/abort_request", "[1, 2]", {}, 400),
        ("POST", "/abort_request", '"rid"', {}, 400),
        ("POST", "/generate", "[" * 1000 + "]" * 1000, {}, 400),
        ("POST", "/v1/chat/completions", '{"messages": ' + "[" * 5000 + "]" * 5000 + "}", {}, 400),
        ("POST", "/v1/completions", '{"prompt": "x"}', {"content-type": "text/plain"}, 415),
        ("POST", "/v1/completions", '{"prompt": "x"}', {"host": "attacker.example"}, 400),
        ("POST", "/v1/completions", '{"prompt": "x"}', {"origin": "http://attacker.example"}, 403),
        ("GET", "/flush_cache", None, {}, 405),
        ("GET", "/no/such/path", None, {}, 404),
    ],
)
def test_errors_are_json_in_the_openai_shape(client, method, path, raw, headers, status):
    r = client.request(
        method, path, content=raw, headers={"content-type": "application/json", **headers}
    )
    assert_json_error(r, status)


def test_a_scheduler_that_does_not_answer_gives_504_and_an_unhealthy_server(server, client):
    pid = server.pid_of("relay::sched")
    os.kill(pid, signal.SIGSTOP)
    try:
        assert_json_error(client.get("/get_server_info"), 504)
        assert_json_error(client.post("/flush_cache"), 504)
        wait_until(
            lambda: client.get("/health").status_code == 503, 15, "/health reports the stall"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: client.get("/health").status_code == 200, 15, "/health recovers")


# ---- 4. size limits before tokenizing -----------------------------------------------------------


def test_oversized_bodies_and_prompts_are_refused_cheaply(client):
    assert_json_error(completion(client, prompt="x" * (MAX_BODY + 10)), 413)
    big = "The quick brown fox jumps over the lazy dog. " * (3_000_000 // 45)
    assert "context" in assert_json_error(completion(client, prompt=big), 400, "prompt")["message"]
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]}
    )
    assert_json_error(chat, 400, "messages")
    assert_nothing_held(client)


# ---- 5. idle connections never exhaust the descriptors ------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_and_half_open_connections_never_exhaust_descriptors(server, client):
    """1,000 idle sockets under a 1,024-descriptor limit once made every other client fail."""
    sockets = []
    try:
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", server.port))
            if i % 2:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                )  # headers never finish
            sockets.append(s)
        with server.client() as fresh:
            r = fresh.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert open_fds(server.proc.pid) < FD_LIMIT
        # The idle ones are closed once --http-timeout passes.
        wait_until(lambda: open_fds(server.proc.pid) < 200, 20, "idle connections closed")
    finally:
        for s in sockets:
            s.close()


# ---- 6. /health follows the pipeline --------------------------------------------------------------


def test_health_reports_a_stalled_pipeline(server, client):
    assert client.get("/health").json() == {"status": "ok"}
    pid = server.pid_of("relay::detok")
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: client.get("/health").status_code == 503,
            15,
            "/health reports the stalled detokenizer",
        )
        assert "heartbeat" in client.get("/health").json()["reason"]
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: client.get("/health").status_code == 200, 15, "/health recovers")


# ---- 7. smaller items ----------------------------------------------------------------------------


def test_client_disconnects_are_counted_in_metrics(server, client):
    def aborted() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith('relay:aborted_requests_total{reason="client_disconnect"}'):
                return float(line.split()[-1])
        return 0.0

    before = aborted()
    body = {"prompt": "Count to a thousand:", "max_tokens": 150, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        next(r.iter_lines())
    wait_until(lambda: aborted() == before + 1, 15, "the disconnect counted")
    assert_nothing_held(client)


def test_openapi_documents_request_bodies_errors_and_metrics(client):
    spec = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"
        assert "400" in op["responses"] and "error" in json.dumps(op["responses"]["400"])
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "get" not in spec["paths"]["/flush_cache"]


# ---- fuzzing: the OpenAPI schema, and hypothesis over bodies --------------------------------------


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


fuzz = schemathesis.pytest.from_fixture("api_schema")


@fuzz.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_driven_fuzz_never_gets_a_server_error(case, server):
    response = case.call(base_url=server.url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert response.headers["content-type"][0].startswith("application/json")
        body = response.json()
        if body.get("type") == "error":  # Anthropic's shape, on /v1/messages
            assert body["error"]["type"] and body["error"]["message"]
        else:
            assert body["error"]["code"] == response.status_code


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "prompt",
    "messages",
    "text",
    "input_ids",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "top_logprobs",
    "sampling_params",
    "rid",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "stream_options",
    "priority",
    "response_format",
    "tools",
    "chat_template_kwargs",
    "echo",
    "logit_bias",
    "tokens",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
]
BASES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 3}},
    "/abort_request": {"rid": "nope"},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(sorted(BASES)),
    changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=3),
)
def test_mutated_bodies_get_a_client_error_or_an_answer_never_a_server_error(client, path, changes):
    body = {**BASES[path], **changes}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16  # keep accepted requests short; refusals still see every value
    try:
        raw = json.dumps(body, allow_nan=True)
    except (TypeError, ValueError):
        return
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code


def test_after_the_fuzzing_nothing_is_held(client):
    assert_nothing_held(client)


# ---- soak: normal, aborted, bad and oversized requests mixed -------------------------------------

BAD_BODIES = [
    {"prompt": ""},
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": [1, 10**9]},
    {"prompt": "x", "stop_token_ids": [10**7], "min_tokens": 1},
    {"prompt": "x", "max_tokens": 100_000},
    {"prompt": "x", "n": 1000},
    {"model": "other", "prompt": "x"},
]


def test_soak_of_mixed_requests_leaks_nothing(server, client):
    rng = random.Random(0)
    kinds = rng.choices(
        ["normal", "stream", "abort", "bad", "oversized"], weights=[4, 3, 3, 3, 1], k=300
    )

    async def one(c: httpx.AsyncClient, kind: str, i: int) -> int | None:
        if kind == "normal":
            r = await c.post(
                "/v1/completions",
                json={"prompt": f"Request {i}:", "max_tokens": rng.randint(1, 12)},
            )
            return r.status_code
        if kind == "bad":
            r = await c.post("/v1/completions", json=rng.choice(BAD_BODIES))
            assert r.json()["error"]["code"] == r.status_code
            return r.status_code
        if kind == "oversized":
            r = await c.post("/v1/completions", json={"prompt": "word " * 700_000})
            return r.status_code
        body = {"prompt": f"Stream {i}:", "max_tokens": 140, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if kind == "abort" and line.startswith("data:"):
                    return None  # leaves mid-stream: the server must abort it and free its KV
            return r.status_code

    async def go():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            gate = asyncio.Semaphore(32)

            async def gated(kind, i):
                async with gate:
                    return await one(c, kind, i)

            return await asyncio.gather(*(gated(k, i) for i, k in enumerate(kinds)))

    statuses = asyncio.run(go())
    assert all(s is None or s < 500 for s in statuses), sorted({s for s in statuses if s})
    assert statuses.count(200) >= kinds.count("normal") + kinds.count("stream")
    assert_nothing_held(client)
