"""Process-level behaviour: tensor parallelism, a child dying, SIGTERM, process titles."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from procs.common import terminate
from tests.server_utils import Server, alive, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time in a land far away,",
           "Q: What is 2+2?\nA:", "The quick brown fox", "List three colors:"]


def greedy(server: Server, n: int = 16) -> list[list[int]]:
    with server.client() as c:
        outs = [c.post("/generate", json={"text": p, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                          "ignore_eos": True}}).json()
                for p in PROMPTS]
    return [o["output_ids"] for o in outs]


def test_tp2_equals_tp1_in_float32():
    """--tp 2 gives --tp 1's greedy tokens; a rank that dies mid-request (its peer waiting for it
    in a shared-memory collective) fails the request and stops the server."""
    outputs = []
    for tp in ("1", "2"):
        s = Server("--tp", tp, "--dtype", "float32", "--kv-cache-gb", "0.5", "--context-length", "4096")
        try:
            if tp == "2":
                s.pid_of("relay::tp1")  # really two ranks
                with s.client() as c:  # once took tp0, and with it the server, down
                    bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "min_tokens": 2,
                                                          "stop_token_ids": [1_000_000_000]})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
            outputs.append(greedy(s))
            if tp == "2":
                body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                with httpx.Client(base_url=s.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
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
    s = Server("--load-format", "dummy-null", "--tokenizer-workers", "2")
    children = s.children()
    titles = {open(f"/proc/{p}/cmdline").read().strip("\0") for p in children}
    assert {"relay::sched", "relay::tp0", "relay::detok", "relay::tokenizer0", "relay::tokenizer1"} <= titles
    assert open(f"/proc/{s.proc.pid}/cmdline").read().strip("\0") == "relay::http"
    ipc_dirs = {d for d in os.listdir("/tmp") if d.startswith("relay-")}
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0
    assert not [p for p in children if alive(p)]
    assert {d for d in os.listdir("/tmp") if d.startswith("relay-")} < ipc_dirs, "its ipc directory is removed"


@pytest.mark.parametrize("victim", ["relay::sched", "relay::tp0", "relay::detok", "relay::tokenizer"])
def test_child_death_fails_requests_and_exits(victim):
    """The tokenizer's death is followed at once by a SIGTERM to the server: the stop must not
    hide the death behind exit status 0."""
    s = Server("--load-format", "dummy-null", "--context-length", "100000")
    children = s.children()
    try:
        body = {"prompt": "hi", "max_tokens": 90000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=s.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
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
    out = subprocess.run(["python", "-m", "launch.serve", "--model-path", "/nonexistent/model"],
                         capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode != 0 and "does not exist" in out.stderr


def test_help_explains_flags():
    out = subprocess.run(["python", "-m", "launch.serve", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for flag in ("--model-path", "--tp", "--host", "--port", "--dtype", "--page-size", "--kv-cache-gb",
                 "--mem-fraction-static", "--max-running-requests", "--chunked-prefill-size",
                 "--disable-radix-cache", "--api-key", "--log-requests"):
        assert flag in out.stdout



def test_terminating_a_session_ends_what_outlives_its_leader():
    """A child run in its own session (a peer engine in a benchmark, a --dp replica) whose own
    child outlives it, as a worker still winding down does: terminate(whole_group=True) leaves
    nothing of that session running to take CPU from what starts next."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(120)']); print(p.pid, flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    straggler = int(leader.stdout.readline())
    terminate([leader], 10, whole_group=True)
    assert leader.returncode == -signal.SIGTERM  # the leader itself went on SIGTERM
    wait_until(lambda: not alive(straggler), 10, "the leader's child to be gone")
