"""Process-level behaviour: tensor parallelism, a child dying, SIGTERM, process titles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from procs.common import terminate
from tests.helpers.server_utils import ROOT, Server, alive, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "Once upon a time in a land far away,",
    "Q: What is 2+2?\nA:",
    "The quick brown fox",
    "List three colors:",
]


def greedy(server: Server, n: int = 16) -> list[list[int]]:
    with server.client() as c:
        outs = [
            c.post(
                "/generate",
                json={
                    "text": p,
                    "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                },
            ).json()
            for p in PROMPTS
        ]
    return [o["output_ids"] for o in outs]


def test_tp2_equals_tp1_with_deterministic():
    """With --deterministic, --tp 2 gives --tp 1's greedy tokens; a rank that dies mid-request (its
    peer waiting for it in a shared-memory collective) fails the request and stops the server."""
    outputs = []
    for tp in ("1", "2"):
        # --deterministic: float32 on float block activations. TP's all-reduce sums in another
        # order, which moves an activation by its last bits; int8 block activations (the default
        # from AVX2 up) or bfloat16 can round that into a whole step, and greedy output then
        # differs (with the defaults, 0 of these 6 prompts over 24 tokens on a Zen 4, 2026-12-05).
        s = Server(
            "--tp",
            tp,
            "--deterministic",
            "--kv-cache-gb",
            "0.5",
            "--context-length",
            "4096",
        )
        try:
            if tp == "2":
                s.pid_of("relay::tp1")  # really two ranks
                with s.client() as c:  # once took tp0, and with it the server, down
                    bad = c.post(
                        "/v1/completions",
                        json={
                            "prompt": "x",
                            "max_tokens": 4,
                            "min_tokens": 2,
                            "stop_token_ids": [1_000_000_000],
                        },
                    )
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
            outputs.append(greedy(s))
            if tp == "2":
                body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                with (
                    httpx.Client(base_url=s.url, timeout=30) as c,
                    c.stream("POST", "/v1/completions", json=body) as r,
                ):
                    lines = r.iter_lines()
                    assert next(lines).startswith("data:")
                    os.kill(s.pid_of("relay::tp1"), signal.SIGKILL)
                    tail = list(lines)
                assert any('"error"' in line for line in tail), tail[-3:]
                assert s.proc.wait(15) != 0 and "relay::tp1" in s.log and "died" in s.log
        finally:
            s.stop()
    assert outputs[0] == outputs[1]


def test_process_titles_and_sigterm_leaves_no_orphans():
    """Also: by default (--shutdown-timeout 0, vLLM's) SIGTERM aborts a stream in flight at once,
    with an error event, and still exits 0."""
    s = Server(
        "--load-format", "dummy-null", "--tokenizer-workers", "2", "--context-length", "100000"
    )
    children = s.children()
    titles = {open(f"/proc/{p}/cmdline").read().strip("\0") for p in children}
    assert {
        "relay::sched",
        "relay::tp0",
        "relay::detok",
        "relay::tokenizer0",
        "relay::tokenizer1",
    } <= titles
    assert open(f"/proc/{s.proc.pid}/cmdline").read().strip("\0") == "relay::http"
    ipc_dirs = {d for d in os.listdir("/tmp") if d.startswith("relay-")}
    body = {"prompt": "hi", "max_tokens": 90000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=s.url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        s.proc.send_signal(signal.SIGTERM)
        last = [line for line in lines if line][-1]
    assert '"code":503' in last and "shutting down" in last
    assert s.proc.wait(15) == 0
    assert not [p for p in children if alive(p)]
    assert {d for d in os.listdir("/tmp") if d.startswith("relay-")} < ipc_dirs, (
        "its ipc directory is removed"
    )


@pytest.mark.parametrize(
    "victim", ["relay::sched", "relay::tp0", "relay::detok", "relay::tokenizer"]
)
def test_child_death_fails_requests_and_exits(victim):
    """The tokenizer's death is followed at once by a SIGTERM to the server: the stop must not
    hide the death behind exit status 0."""
    s = Server("--load-format", "dummy-null", "--context-length", "100000")
    children = s.children()
    try:
        body = {"prompt": "hi", "max_tokens": 90000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=s.url, timeout=30) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data:")  # the request is in flight
            os.kill(s.pid_of(victim), signal.SIGKILL)
            if victim == "relay::tokenizer":
                s.proc.send_signal(signal.SIGTERM)
            tail = list(lines)
        assert any('"error"' in line for line in tail), tail[-3:]
        assert s.proc.wait(10) != 0, "exits non-zero"
        assert f"{victim}" in s.log and "died" in s.log
        assert "Traceback" not in s.log
        wait_until(lambda: not [p for p in children if alive(p)], 10, "every child gone")
    finally:
        s.stop()


def test_bad_model_path_fails_fast():
    out = subprocess.run(
        ["python", "-m", "launch.serve", "--model-path", "/nonexistent/model"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode != 0 and "does not exist" in out.stderr


def test_help_explains_flags():
    out = subprocess.run(
        ["python", "-m", "launch.serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    for flag in (
        "--model-path",
        "--tp",
        "--host",
        "--port",
        "--dtype",
        "--page-size",
        "--kv-cache-gb",
        "--mem-fraction-static",
        "--max-running-requests",
        "--chunked-prefill-size",
        "--disable-radix-cache",
        "--api-key",
        "--log-requests",
    ):
        assert flag in out.stdout


def test_terminating_a_session_ends_what_outlives_its_leader():
    """A child run in its own session (a peer engine in a benchmark, a --dp replica) whose own
    child outlives it, as a worker still winding down does: terminate(whole_group=True) leaves
    nothing of that session running to take CPU from what starts next."""
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); print(p.pid, flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    straggler = int(leader.stdout.readline())
    terminate([leader], 10, whole_group=True)
    assert leader.returncode == -signal.SIGTERM  # the leader itself went on SIGTERM
    wait_until(lambda: not alive(straggler), 10, "the leader's child to be gone")


def test_sigterm_drains_requests_in_flight_for_the_shutdown_timeout_then_aborts_the_rest():
    """SIGTERM with --shutdown-timeout: /health and new requests get 503 at once; a stream that
    ends within the timeout ends normally; a stream and a whole request still running at the
    timeout end with an error (an error event, a 503 body), never cut silently; exit 0."""
    import json
    import threading

    s = Server(
        "--load-format", "dummy-null", "--context-length", "1000000", "--shutdown-timeout", "10"
    )
    endless = {"prompt": "hi", "max_tokens": 990_000, "ignore_eos": True}
    whole: dict = {}
    try:
        with (
            httpx.Client(base_url=s.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json={**endless, "stream": True}) as long_stream,
            c.stream(
                "POST",
                "/v1/completions",
                json={
                    "prompt": "hi",
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ) as short_stream,
        ):
            long_lines, short_lines = long_stream.iter_lines(), short_stream.iter_lines()
            assert next(long_lines).startswith("data:") and next(short_lines).startswith("data:")
            worker = threading.Thread(
                target=lambda: whole.update(
                    r=httpx.post(s.url + "/v1/completions", json=endless, timeout=60)
                )
            )
            worker.start()
            wait_until(
                lambda: c.get("/get_server_info").json()["num_http_requests"] == 3,
                30,
                "3 requests in flight",
            )
            s.proc.send_signal(signal.SIGTERM)
            health = wait_until(
                lambda: (r := c.get("/health")).status_code == 503 and r, 10, "/health to say 503"
            )
            assert "shutting down" in health.json()["reason"]
            refused = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert (
                refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            )
            short = [line for line in short_lines if line]
            long_tail = [line for line in long_lines if line][-2:]
        assert short[-1] == "data: [DONE]" and not any(
            "error" in json.loads(line[6:]) for line in short[:-1]
        )
        assert json.loads(short[-2][6:])["usage"]["completion_tokens"] == 3000
        last = json.loads(long_tail[-1][6:])
        assert (
            last["error"]["code"] == 503 and "--shutdown-timeout 10 s" in last["error"]["message"]
        )
        worker.join(60)
        assert (
            whole["r"].status_code == 503
            and "shutting down" in whole["r"].json()["error"]["message"]
        )
        assert s.proc.wait(30) == 0
        assert "Traceback" not in s.log
    finally:
        s.stop()
