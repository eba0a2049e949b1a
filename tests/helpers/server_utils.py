"""Start a real Relay server (all its processes) for a test, and talk to it."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time

import httpx

from procs.common import terminate
from tests.helpers.paths import ROOT

READY_LINE = "Relay is ready"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m launch.serve ...` in a subprocess; ready once it prints its ready line."""

    def __init__(
        self, *flags: str, startup_timeout: float = 240.0, max_open_files: int | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self._ready = threading.Event()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}

        def limit_files() -> None:  # in the child, before exec: the server starts under this limit
            if max_open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.serve", "--port", str(self.port), *flags],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=limit_files,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(startup_timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.log)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if READY_LINE in line:
                self._ready.set()
        self._ready.set()  # the process ended: wake the waiter

    @property
    def log(self) -> str:
        return "".join(self.lines[-200:])

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def children(self) -> list[int]:
        """pids of the server's relay::* children (its process group)."""
        out = subprocess.run(
            ["pgrep", "-g", str(os.getpgid(self.proc.pid))], capture_output=True, text=True
        )
        return [int(p) for p in out.stdout.split() if int(p) != self.proc.pid]

    def pid_of(self, title: str) -> int:
        out = subprocess.run(
            ["pgrep", "-f", "-g", str(os.getpgid(self.proc.pid)), f"^{title}$"],
            capture_output=True,
            text=True,
        )
        pids = [int(p) for p in out.stdout.split()]
        assert len(pids) == 1, f"{title}: {pids}"
        return pids[0]

    def stop(self) -> None:
        terminate([self.proc], 30, whole_group=True)  # its session: it and all it started


def assert_served_completions_equal(model_path: str, prompts: list, want: list) -> None:
    """A float32 server on model_path completes each prompt greedily (10 tokens, ignore_eos) with
    exactly the text of the offline Engine's output in want."""
    server = Server("--model-path", model_path, "--dtype", "float32", "--kv-cache-gb", "0.05")
    try:
        with server.client() as c:
            for p, w in zip(prompts, want):
                r = c.post(
                    "/v1/completions",
                    json={"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == w.text
    finally:
        server.stop()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll a condition the server will reach (not a sleep standing in for an event)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


# ---- a server that stops at start-up: its exit status and its one error line -------------------


def serve(*flags: str, cache_dir: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"RELAY_CACHE_DIR": cache_dir} if cache_dir else {})}
    return subprocess.run(
        [sys.executable, "-m", "launch.serve", "--load-format", "dummy-null", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(out: subprocess.CompletedProcess, *names: str) -> None:
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert all(name in errors[0] for name in names), errors[0]
