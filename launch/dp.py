"""`python -m launch.serve --dp N`: N independent Relay replicas behind sglang-router.

Each replica is a whole Relay server, `python -m launch.serve --replica-name dpI` on a
loopback port of its own: its own http process, tokenizer(s), scheduler (and radix cache),
model runner(s) and detokenizer, its own ipc directory, and its own supervision (a child of a
replica that dies takes that replica down, as it would a single server). Each replica runs in
a process group of its own and dies with this process (PR_SET_PDEATHSIG). On CPU each gets an
equal share of the cores (its affinity; its runner's threads follow from it), on GPUs its own
--tp devices (CUDA_VISIBLE_DEVICES).

In front of them runs sglang-router (the Rust router from PyPI, its CLI
`sglang_router.launch_router`) with --worker-urls pointing at the replicas, on a loopback port:
--host/--port is served by this process's front door (launch/front.py), which passes every
connection on to the router and fills in an OpenAI body's missing `model` (the router refuses a
completions body without one, and names a chat body's model `unknown`). The router health-checks
them (/health every 2 s; two failures take a replica out of rotation), retries a request
whose replica cannot be reached on another one, and routes by --router-policy (cache_aware:
a request goes to the replica whose cache holds the longest prefix of it, the least loaded one
when loads drift apart).

This process (relay::dp) supervises: a replica that exits is taken out of the router's
rotation at once (DELETE /workers/{id}) and the others serve on; the server stops, non-zero,
only when no replica is left, or when the router exits. A dead replica is not restarted:
what killed it (a crash, the OOM killer, a bad device) would most likely kill it again, and
a restart loop would hide that behind a server that looks up; capacity drops by one
replica, loudly (an error log line, the router's /workers, the replica's missing series),
until the operator restarts the server. SIGINT/SIGTERM stop the router (it lets requests in
flight finish for up to 5 s, the replicas still serving them), then the replicas, and exit 0, or
1 where a replica or the router had died before the signal.

The replicas' plan (ports, cores or GPUs) and their flags and the router's are in
launch/dp_replicas.py; this module starts and supervises the processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from launch.children import exit_code
from launch.dp_replicas import (
    DP_CORES_ENV,
    DP_PARENT_ENV,
    ROUTER_GRACE_SECONDS,
    Replica,
    free_ports,
    plan_replicas,
    replica_argv,
    router_argv,
)
from launch.flags import check_model_config, engine_config
from launch.front import Front, FrontThread
from launch.ports import PortUnavailable, bind_port
from procs.common import child_pythonpath, set_title, setup_logging, terminate

logger = logging.getLogger("relay.dp")

FRONT = "front"  # in Supervisor.events: the front door stopped
STOP_GRACE_SECONDS = 15.0  # a replica's own stop takes up to ~8 s (uvicorn 3, children 5)


def _get_json(url: str, api_key: str | None = None, method: str = "GET", timeout: float = 5.0):
    req = urllib.request.Request(url, method=method)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


class Supervisor:
    def __init__(
        self,
        parser: argparse.ArgumentParser,
        ns: argparse.Namespace,
        replicas: list[Replica],
        router_port: int,
    ):
        self.parser = parser
        self.ns = ns
        self.replicas = replicas
        self.router: subprocess.Popen | None = None
        self.router_port = router_port
        self.router_url = f"http://127.0.0.1:{router_port}"
        self.front: FrontThread | None = None
        self.stopping = False
        self.events: queue.Queue = queue.Queue()

    def _env(self, **extra: str) -> dict[str, str]:

        return {
            **os.environ,
            DP_PARENT_ENV: str(os.getpid()),
            "PYTHONPATH": child_pythonpath(),
            **extra,
        }

    def start_replicas(self) -> None:
        for r in self.replicas:
            extra = {DP_CORES_ENV: ",".join(map(str, r.cores))} if r.cores else {}
            if r.gpus:
                extra["CUDA_VISIBLE_DEVICES"] = ",".join(r.gpus)
            # A process group each: Ctrl-C reaches only this process, which stops them in order.
            r.proc = subprocess.Popen(
                [sys.executable, "-m", "launch.serve", *replica_argv(self.parser, self.ns, r)],
                env=self._env(**extra),
                start_new_session=True,
            )
            where = (
                f"cores {','.join(map(str, r.cores))}"
                if r.cores
                else f"GPUs {','.join(r.gpus or [])}"
            )
            logger.info("replica %s: pid %d, %s, %s", r.name, r.proc.pid, r.url, where)

    def wait_replicas(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(self.replicas)
        while waiting:
            for r in list(waiting):
                code = r.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"replica {r.name} (pid {r.proc.pid}) exited with code {code} during startup"
                    )
                try:
                    _get_json(r.url + "/health", timeout=2.0)
                    waiting.remove(r)
                except (OSError, ValueError):
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"timed out waiting for replica(s) {', '.join(r.name for r in waiting)}"
                )
            if waiting:
                time.sleep(0.25)

    def start_router(self) -> None:
        argv = router_argv(self.ns, self.replicas, self.router_port)
        # The router looks for a tokenizer under each worker's model_path to tokenize requests
        # itself (its gRPC mode); over HTTP it routes on text and needs none, so its "no
        # tokenizer for model ..." warning would only alarm (RUST_LOG, when unset, keeps it out).
        level = argv[argv.index("--log-level") + 1]
        rust_log = (
            os.environ.get("RUST_LOG")
            or f"{level},smg::core::steps::worker::local::register_tokenizer=error"
        )
        self.router = subprocess.Popen(
            [sys.executable, "-m", "launch.router", *argv],
            env=self._env(RUST_LOG=rust_log),
            start_new_session=True,
        )
        logger.info(
            "router: pid %d, policy %s, on %s",
            self.router.pid,
            self.ns.router_policy,
            self.router_url,
        )

    def wait_router(self, timeout: float) -> None:
        """Until the router serves and counts every replica healthy."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.router.poll()
            if code is not None:
                raise RuntimeError(
                    f"the router (sglang-router, pid {self.router.pid}) exited with code {code} "
                    "during startup"
                )
            for r in self.replicas:
                if r.proc.poll() is not None:
                    raise RuntimeError(
                        f"replica {r.name} (pid {r.proc.pid}) exited with code {r.proc.returncode} "
                        "during startup"
                    )
            try:
                if _get_json(self.router_url + "/readiness", timeout=2.0).get(
                    "healthy_workers"
                ) == len(self.replicas):
                    return
            except (OSError, ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("timed out waiting for the router to register every replica")
            time.sleep(0.25)

    def start_front(self, sock: socket.socket, model: str) -> None:
        """The front door on sock (--host/--port, bound at start-up), once the router serves."""
        from relay.api.guard import raise_fd_limit

        raise_fd_limit()  # two descriptors a client connection: its own, and its router connection
        front = Front(self.router_port, model, self.ns.max_request_body_bytes, self.ns.http_timeout)
        self.front = FrontThread(front, sock, on_exit=lambda error: self.events.put((FRONT, error)))
        self.front.start()

    def supervise(self) -> int:
        """Until the router, the front door or the last replica stops; returns the exit code."""
        for proc, who in [(self.router, None), *[(r.proc, r) for r in self.replicas]]:
            threading.Thread(
                target=lambda p=proc, w=who: self.events.put((w, p.wait())),
                daemon=True,
                name=f"watch-{who.name if who else 'router'}",
            ).start()
        live = {r.name for r in self.replicas}
        while True:
            try:
                who, code = self.events.get(timeout=1.0)
            except queue.Empty:
                continue
            if who is None:
                logger.error(
                    "the router (sglang-router, pid %d) exited with code %s: stopping the server",
                    self.router.pid,
                    code,
                )
                return 1
            if who == FRONT:
                logger.error(
                    "the front door on port %d stopped (%s): stopping the server",
                    self.ns.port,
                    code,
                )
                return 1
            live.discard(who.name)
            if not live:
                logger.error(
                    "replica %s (pid %d) exited with code %s and no replica is left: stopping the server",
                    who.name,
                    who.proc.pid,
                    code,
                )
                return 1
            logger.error(
                "replica %s (pid %d) exited with code %s: out of the router's rotation; %d of %d "
                "replicas serve on (%s)",
                who.name,
                who.proc.pid,
                code,
                len(live),
                len(self.replicas),
                ", ".join(sorted(live)),
            )
            self.remove_from_router(who)

    def remove_from_router(self, replica: Replica) -> None:
        """Take a dead replica out of rotation now (its health checks would in ~4 s)."""
        try:
            workers = _get_json(self.router_url + "/workers", self.ns.api_key)["workers"]
            for w in workers:
                if w["url"] == replica.url:
                    _get_json(
                        f"{self.router_url}/workers/{w['id']}", self.ns.api_key, method="DELETE"
                    )
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning(
                "could not remove replica %s from the router (%s); its health checks will",
                replica.name,
                e,
            )

    def died(self) -> list[str]:
        """The replicas and the router that had exited on their own, each as a line for the log:
        asked when a stop signal comes, which must not make the exit status 0 after a death (as
        a single server's launcher does). One ended by SIGTERM was stopped with the server."""

        procs = [
            ("the router (sglang-router)", self.router),
            *[(f"replica {r.name}", r.proc) for r in self.replicas],
        ]
        codes = [(who, proc, exit_code(proc)) for who, proc in procs if proc is not None]
        return [
            f"{who} (pid {proc.pid}) exited with code {code}"
            for who, proc, code in codes
            if code is not None and code != -signal.SIGTERM
        ]

    def stop(self) -> None:
        """The front door and the router first (no new requests; those in flight may finish),
        then every replica; SIGKILL to a process group that has not stopped after its grace period."""
        self.stopping = True
        if self.front is not None:
            self.front.stop()
        terminate([self.router], ROUTER_GRACE_SECONDS + 1.0, whole_group=True)
        # A replica drains for up to --shutdown-timeout before it stops: not SIGKILLed meanwhile.
        terminate(
            [r.proc for r in self.replicas],
            STOP_GRACE_SECONDS + self.ns.shutdown_timeout,
            whole_group=True,
        )


def startup_checks(ns: argparse.Namespace, model_path: str | None) -> socket.socket:
    """What a single server checks before any model loads: the ports (--port bound now, for the
    front door; the router's metrics port free: the router binds it once the replicas are up),
    the cache directory and the model, for the replicas. Returns the --port socket."""
    from launch.model_dir import resolve_model_dir_apart
    from relay.execution.model_files import ModelFileError, check_cache_dir

    check_cache_dir()
    sock = bind_port(ns.host, ns.port)
    bind_port(
        ns.host, ns.router_prometheus_port, "the router's metrics (--router-prometheus-port)"
    ).close()
    # Converts a GGUF once here (in a child: relay::dp holds no torch), not in N replicas at once.
    model_dir = resolve_model_dir_apart(model_path, ns.log_level.upper(), "dp")
    try:
        check_model_config(engine_config(ns), model_dir)
    except ValueError as e:
        raise ModelFileError(str(e)) from None
    return sock


def serve_dp(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from relay.execution.model_files import ModelFileError, model_name

    set_title("relay::dp")
    setup_logging(ns.log_level.upper(), "dp")
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        logger.error(
            "--dp needs sglang-router: pip install sglang-router (./scripts/install.sh installs it)"
        )
        return 2
    cfg = engine_config(ns)
    try:
        sock = startup_checks(ns, cfg.model_path)
    except (ModelFileError, PortUnavailable) as e:
        logger.error("%s", e)
        return 2
    *ports, router_port = free_ports(ns.dp + 1)
    try:
        replicas = plan_replicas(ns.dp, cfg.tp_size, cfg.device, ports)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    sup = Supervisor(parser, ns, replicas, router_port)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        sup.start_replicas()
        sup.wait_replicas(ns.startup_timeout)
        sup.start_router()
        sup.wait_router(ns.startup_timeout)
        served = cfg.served_model_name or model_name(cfg.model_path)
        sup.start_front(sock, served)
        print(
            f"Relay is ready: http://{ns.host}:{ns.port}  (model {served}, tp {cfg.tp_size}, dp {ns.dp}: "
            f"{', '.join(f'{r.name} {r.url}' for r in replicas)}; router {ns.router_policy}, "
            f"its metrics on port {ns.router_prometheus_port})",
            flush=True,
        )
        return sup.supervise()
    except KeyboardInterrupt:
        deaths = sup.died()
        for death in deaths:
            logger.error("%s before the stop signal: exiting 1", death)
        return 1 if deaths else 0
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop()
