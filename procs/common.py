"""What every child process does first: name itself, die with its parent, read its args."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from relay.config import EngineConfig

ARGS_ENV = "RELAY_PROC_ARGS"
_PR_SET_PDEATHSIG = 1


@dataclass
class ProcArgs:
    """Everything a child needs, passed as JSON in its environment (no pickle)."""

    name: str  # the process title is relay::<name>
    ipc_dir: str
    model_dir: str
    config: dict[str, Any]
    index: int = 0  # TP rank, or tokenizer worker number
    parent_pid: int = 0
    log_level: str = "INFO"
    extra: dict[str, Any] = field(default_factory=dict)
    replica: str | None = None  # a data-parallel replica's name (dp0, ...): in titles and log lines

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.config)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> ProcArgs:
        return cls(**json.loads(os.environ[ARGS_ENV]))


def child_pythonpath() -> str:
    """Children import `procs`, `ipc` and `relay` exactly as this process does."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = [here, os.path.join(here, "src"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def proc_label(name: str, replica: str | None = None) -> str:
    """`sched`, or `sched dp1` in replica dp1 of a `--dp` server: the process title is
    `relay::<label>` and log lines are tagged with it."""
    return name + (f" {replica}" if replica else "")


def set_title(title: str) -> None:
    """`relay::sched` etc.: what `ps`, `pgrep -f` and py-spy users look for."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM us when the launcher dies, so no child is orphaned."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)  # the launcher died before we could register


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"[%(asctime)s {name}] %(levelname)s %(name)s: %(message)s",
    )


def announce_ready(ctx, ipc_dir: str, msg) -> None:
    """Tell the launcher we are up; waits (briefly) until the message has left."""
    import zmq

    from ipc.sockets import LAUNCHER, endpoint, push, send

    sock = push(ctx, endpoint(ipc_dir, LAUNCHER))
    sock.setsockopt(zmq.LINGER, 10_000)  # unlike the data sockets: don't drop it on close
    send(sock, msg)
    sock.close()


def child_main(body: Callable[[ProcArgs], None]) -> None:
    """Run a child process body; on a crash print the traceback and exit non-zero."""
    args = ProcArgs.from_env()
    label = proc_label(args.name, args.replica)
    set_title(f"relay::{label}")
    die_with_parent(args.parent_pid)
    setup_logging(args.log_level, label)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops us
    try:
        body(args)
    except KeyboardInterrupt:
        pass
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def terminate(
    procs: list[subprocess.Popen | None], grace: float, whole_group: bool = False
) -> None:
    """SIGTERM the live ones, SIGKILL what is left after grace seconds, reap all. With whole_group
    (each a child started in its own session), SIGKILL also whatever of its process group
    outlives it: a peer engine's worker still winding down would otherwise take CPU from what
    starts next (a benchmark's next engine, timing its kernels at start-up)."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(p.pid) if whole_group else p.kill()
            p.wait()
        if whole_group:
            kill_group(p.pid)  # what outlived its leader


def kill_group(pgid: int) -> None:
    """SIGKILL every process of a process group (none left: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
