"""ZeroMQ plumbing: a private directory for ipc:// socket files, PUSH/PULL pairs, and
receivers that drain everything queued after one wake-up (~5x the message rate of one
await per message)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import zmq
import zmq.asyncio

from ipc.codec import decode, encode

_PREFIX = "relay-"
_OWNER_FILE = "owner"  # "<pid> <process start time>" of the launcher that made the directory


def make_ipc_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700), stamped with
    its owner so a later start can tell it is stale if this process is killed."""
    path = tempfile.mkdtemp(prefix=_PREFIX)
    os.chmod(path, 0o700)
    with open(os.path.join(path, _OWNER_FILE), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}")
    return path


def remove_stale_ipc_dirs() -> list[str]:
    """Remove the ipc directories this user's launchers left behind when killed (SIGKILL
    gives no chance to clean up): those whose owner process is gone. Returns them."""
    root = tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if (
                not name.startswith(_PREFIX)
                or not os.path.isdir(path)
                or os.stat(path).st_uid != os.getuid()
            ):
                continue
        except OSError:
            continue  # removed meanwhile (by another launcher starting now: a --dp replica)
        try:
            with open(os.path.join(path, _OWNER_FILE)) as f:
                pid, started = f.read().split()
        except (OSError, ValueError):
            continue  # not ours to judge (no owner stamp)
        if _start_time(int(pid)) != started:  # gone, or the pid now belongs to another process
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' if it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def remove_ipc_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def endpoint(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # internal queues: never drop, never block on a high-water mark
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def push(ctx: zmq.Context, ep: str, bind: bool = False) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.PUSH))
    sock.bind(ep) if bind else sock.connect(ep)
    return sock


def pull(ctx: zmq.Context, ep: str, bind: bool = True) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.PULL))
    sock.bind(ep) if bind else sock.connect(ep)
    return sock


def send(sock: zmq.Socket, obj: Any) -> None:
    sock.send(encode(obj), copy=False)


def recv_ready(sock: zmq.Socket) -> list[Any]:
    """Every message already queued on a sync socket, without blocking."""
    out = []
    while True:
        try:
            out.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


class AsyncPull:
    """A PULL socket for asyncio code: await one wake-up, then drain without blocking."""

    def __init__(self, ctx: zmq.asyncio.Context, ep: str, bind: bool = True):
        self.sock = pull(ctx, ep, bind)
        self._sync = zmq.Socket.shadow(self.sock.underlying)  # same socket, non-blocking recvs

    async def recv_batch(self) -> list[Any]:
        await self.sock.poll(flags=zmq.POLLIN)
        return recv_ready(self._sync)

    def close(self) -> None:
        self.sock.close()


# Socket file names inside the private ipc directory (who binds: see launch.serve).
HTTP, TOKENIZER, SCHEDULER, RUNNER_RESULT, DETOKENIZER, LAUNCHER = (
    "http",
    "tokenizer",
    "sched",
    "sched_result",
    "detok",
    "launcher",
)


def runner_inbox(rank: int) -> str:
    return f"tp{rank}"
