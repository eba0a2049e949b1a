"""The processes of one Relay server (this node's share of them): which there are, starting
them with their arguments and thread shares, waiting until each is ready, watching for one
that dies, and stopping them all."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import zmq

from ipc.messages import Ready
from ipc.nodes import NodePlan
from ipc.sockets import LAUNCHER, endpoint, pull, recv_ready
from launch.multinode import gloo_env
from procs.common import ARGS_ENV, ProcArgs, child_pythonpath, terminate
from relay.config import EngineConfig

STOP_GRACE_SECONDS = 5.0


@dataclasses.dataclass
class Child:
    name: str  # relay::<name>
    module: str
    index: int = 0
    proc: subprocess.Popen | None = None


def plan_children(
    cfg: EngineConfig, tokenizer_workers: int, nodes: NodePlan = NodePlan()
) -> list[Child]:
    """This node's processes: its TP ranks, and on node 0 everything else."""
    local = nodes.local_ranks() if nodes.multi else range(cfg.tp_size)
    ranks = [Child(f"tp{r}", "procs.model_runner", r) for r in local]
    if nodes.node_rank > 0:
        return ranks
    tokenizers = [
        Child("tokenizer" if tokenizer_workers == 1 else f"tokenizer{i}", "procs.tokenizer", i)
        for i in range(tokenizer_workers)
    ]
    return (
        ranks
        + [Child("sched", "procs.scheduler"), Child("detok", "procs.detokenizer")]
        + tokenizers
    )


class Launcher:
    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: str,
        ipc_dir: str,
        tokenizer_workers: int,
        log_level: str,
        replica: str | None = None,
        nodes: NodePlan = NodePlan(),
    ):
        self.cfg = cfg
        self.nodes = nodes
        self.replica = replica
        self.model_dir = model_dir
        self.ipc_dir = ipc_dir
        self.log_level = log_level
        self.children = plan_children(cfg, tokenizer_workers, nodes)
        self.stopping = False

    def start(self) -> None:
        cores = len(os.sched_getaffinity(0))
        local_ranks = sum(
            c.module == "procs.model_runner" for c in self.children
        )  # this node's share of --tp
        extra = {"nodes": self.nodes.to_dict()} if self.nodes.multi else {}
        for child in self.children:
            args = ProcArgs(
                child.name,
                self.ipc_dir,
                self.model_dir,
                self.cfg.to_dict(),
                child.index,
                os.getpid(),
                self.log_level.upper(),
                extra=extra,
                replica=self.replica,
            )
            runner = child.module == "procs.model_runner"
            threads = str(max(1, cores // local_ranks)) if runner else "1"
            env = {
                **os.environ,
                ARGS_ENV: args.to_env(),
                "OMP_NUM_THREADS": threads,
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": child_pythonpath(),
                **(gloo_env(self.nodes) if runner else {}),
            }
            child.proc = subprocess.Popen([sys.executable, "-m", child.module], env=env)

    def wait_ready(self, timeout: float, also: Callable[[], None] | None = None) -> dict[str, dict]:
        """Block until every child says Ready; raise naming the one that failed or died (or
        whatever `also`, called while waiting, raises: another node gone)."""
        ctx = zmq.Context.instance()
        sock = pull(ctx, endpoint(self.ipc_dir, LAUNCHER))
        waiting = {c.name for c in self.children}
        infos: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        try:
            while waiting:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"timed out waiting for relay::{', relay::'.join(sorted(waiting))}"
                        + (f" of replica {self.replica}" if self.replica else "")
                    )
                self._raise_if_dead()
                if also is not None:
                    also()
                if sock.poll(200):
                    for msg in recv_ready(sock):
                        if isinstance(msg, Ready):
                            waiting.discard(msg.name)
                            infos[msg.name] = msg.info
        finally:
            sock.close()
        return infos

    def _raise_if_dead(self) -> None:
        for c in self.children:
            code = c.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"relay::{c.name} (pid {c.proc.pid}) exited with code {code} during startup"
                )

    def watch(self, on_exit) -> None:
        """Call on_exit(child, code) from a thread when a child exits unexpectedly."""
        for c in self.children:
            threading.Thread(
                target=self._wait_one, args=(c, on_exit), daemon=True, name=f"watch-{c.name}"
            ).start()

    def _wait_one(self, child: Child, on_exit) -> None:
        code = child.proc.wait()
        if not self.stopping:
            on_exit(child, code)

    def stop(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period, reap all."""
        self.stopping = True
        terminate([c.proc for c in self.children], STOP_GRACE_SECONDS)

    def died(self) -> list[str]:
        """The children that have exited on their own so far, each as a line for the log (asked
        before stop(): a stop signal that comes after a child's death must not make the exit
        status 0). One ended by SIGTERM was stopped with the server: a signal to its whole
        process group (systemd, kill -- -PGID) reaches the children as well."""
        codes = [(c, exit_code(c.proc)) for c in self.children if c.proc is not None]
        return [
            f"relay::{c.name} (pid {c.proc.pid}) died with exit code {code}"
            for c, code in codes
            if code is not None and code != -signal.SIGTERM
        ]


def exit_code(proc: subprocess.Popen) -> int | None:
    """proc's exit status if it has exited, else None, without blocking. Popen.poll() cannot
    tell: it answers None while a watch thread waits on the process."""
    if proc.returncode is None:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None  # still running
        except ChildProcessError:
            pass  # its watch thread reaped it just now
    return proc.wait()  # reaps it, or waits the moment its watch thread takes to record it
