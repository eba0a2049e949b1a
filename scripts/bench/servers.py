"""Starting and stopping the servers a benchmark measures: Relay (`python -m launch.serve`, from this
checkout or another one), the peer engines (engines.py) and routers, one at a time on a small machine.

A server runs in a session of its own, its output in a log file under .bench/logs; stopping it stops all it
started and removes what it left in shared memory that no process holds (vLLM killed at the end of its run
left ~1.6 GB of torch segments in /dev/shm, RAM the next engine measured without).
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import socket
import subprocess
import sys
import time

from procs.common import terminate
from scripts.bench.client import wait_ready
from scripts.bench.results import BENCH_DIR, ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


SHM_DIR = "/dev/shm"


def shm_entries(shm_dir: str = SHM_DIR) -> set[str]:
    return set(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else set()


def held_open() -> set[str]:
    """Every path some process on this machine holds open or mapped (that /proc lets us see)."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            with open(f"/proc/{pid}/maps") as f:
                held.update(
                    line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6
                )
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return held


def remove_orphaned_shm(before: set[str], shm_dir: str = SHM_DIR) -> list[str]:
    """Remove what a stopped server left in shared memory (vLLM killed at the end of its run left
    ~1.6 GB of torch segments there, RAM the next engine measured without): the entries that
    appeared since `before` and that no process holds open. Returns their names."""
    held = held_open()
    removed = []
    for name in sorted(shm_entries(shm_dir) - before):
        path = os.path.join(shm_dir, name)
        if os.path.isfile(path) and os.path.realpath(path) not in held:
            os.unlink(path)
            removed.append(name)
    return removed


def tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class Server:
    """One server process: `with Server(...) as s` starts it, waits until s.base_url answers, and stops it.

    checkout: serve from another checkout (its launch/ and src/ first on PYTHONPATH), e.g. a `git worktree`
    of an older commit to compare against; fd_limit: the descriptor limit it runs under; ready_poll: how
    often (seconds) to ask whether it is ready. After the start, ready_s is the seconds from launch to ready."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_path: str,
        ready_timeout: float = 900.0,
        env: dict[str, str] | None = None,
        cwd: str = ROOT,
        checkout: str | None = None,
        fd_limit: int | None = None,
        ready_poll: float = 1.0,
    ):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.ready_timeout, self.fd_limit, self.ready_poll = ready_timeout, fd_limit, ready_poll
        self.ready_s: float | None = None
        self.env = dict(env or {})
        self.cwd = checkout or cwd
        if checkout:
            self.env["PYTHONPATH"] = os.pathsep.join([checkout, os.path.join(checkout, "src")])
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        if not port_free(self.port):
            raise RuntimeError(
                f"port {self.port} is already in use: stop that server or pick another port"
            )
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log = open(self.log_path, "w")
        self.shm_before = shm_entries()
        print(
            f"\n### starting {self.name}: {' '.join(self.cmd)}\n    (log: {os.path.relpath(self.log_path, ROOT)})",
            flush=True,
        )
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=self.cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **self.env},
            preexec_fn=self._limit if self.fd_limit else None,
        )
        try:
            asyncio.run(wait_ready(self.base_url, self.ready_timeout, self.proc, self.ready_poll))
        except BaseException:
            self.stop()
            print(f"--- the last lines of {self.log_path}:\n{tail(self.log_path, 30)}", flush=True)
            raise
        self.ready_s = time.monotonic() - t0
        print(f"    ready in {self.ready_s:.1f} s", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _limit(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.fd_limit, self.fd_limit))

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """The first match of `pattern` in the server's log, waiting for it to appear."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log_text())
            if m:
                return m
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode}; see {self.log_path}"
                )
            time.sleep(0.5)
        raise TimeoutError(f"no {pattern!r} within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        terminate([self.proc], 20, whole_group=True)  # the session this script created for it
        left = remove_orphaned_shm(self.shm_before)
        if left:
            print(f"    removed what {self.name} left in {SHM_DIR}: {', '.join(left)}", flush=True)
        if not self.log.closed:
            self.log.close()


def relay_server(
    tag: str,
    port: int,
    flags: list[str],
    env: dict[str, str] | None = None,
    ready_timeout: float = 900.0,
    checkout: str | None = None,
    fd_limit: int | None = None,
) -> Server:
    """Relay's `python -m launch.serve --port PORT FLAGS`, its log .bench/logs/relay-TAG.log."""
    cmd = [sys.executable, "-m", "launch.serve", "--port", str(port), *flags]
    if env:
        print(f"    relay environment: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    return Server(
        f"relay ({tag})",
        cmd,
        port,
        os.path.join(BENCH_DIR, "logs", f"relay-{tag}.log"),
        ready_timeout,
        env=env,
        checkout=checkout,
        fd_limit=fd_limit,
    )
