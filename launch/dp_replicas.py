"""The replicas of `--dp N` (launch/dp.py supervises them): the plan (a loopback port each, and
an equal share of the cores or its own --tp GPUs), each replica's launch.serve flags and the
router's, and what a replica (or the router) does first to die with the supervisor and keep to
its cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import socket
import subprocess

from procs.common import die_with_parent

logger = logging.getLogger("relay.dp")

DP_PARENT_ENV = "RELAY_DP_PARENT"  # the supervisor's pid: a replica (or the router) dies with it
DP_CORES_ENV = "RELAY_DP_CORES"  # the cores a replica keeps to, "0,1"
ROUTER_GRACE_SECONDS = 5  # the router's shutdown grace: requests in flight may finish
ROUTER_HEALTH_ARGS = [
    "--health-check-interval-secs",
    "2",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
]
# Flags of launch.serve that belong to the whole server, not to a replica.
TOP_LEVEL_FLAGS = {
    "help",
    "host",
    "port",
    "allowed_hosts",
    "dp",
    "router_policy",
    "router_prometheus_port",
    "router_args",
    "replica_name",
}


def replica_setup() -> None:
    """First thing a replica does (a no-op for a plain server): die with the supervisor,
    keep to its cores. Children inherit the affinity, not the variables."""
    parent = os.environ.pop(DP_PARENT_ENV, None)
    if parent:
        die_with_parent(int(parent))
        # The router probes a worker for gRPC as well as HTTP when it registers it: its gRPC
        # connection attempts would each be a WARNING "Invalid HTTP request received." here.
        logging.getLogger("uvicorn.error").addFilter(
            lambda record: "Invalid HTTP request received" not in record.getMessage()
        )
    cores = os.environ.pop(DP_CORES_ENV, None)
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


@dataclasses.dataclass
class Replica:
    name: str  # dp0, dp1, ...
    port: int
    cores: list[int] | None = None  # CPU: its share of the cores
    gpus: list[str] | None = None  # GPU: its CUDA_VISIBLE_DEVICES
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def share_cores(cores: list[int], n: int) -> list[list[int]]:
    """Equal shares of `cores` for n replicas (the remainder stays unused, so no replica's
    runner waits on a busier neighbour); with fewer cores than replicas, they take turns."""
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    k = len(cores) // n
    return [cores[i * k : (i + 1) * k] for i in range(n)]


def visible_gpus() -> list[str]:
    """CUDA devices this process may use, without importing torch (the supervisor stays small)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def plan_replicas(n: int, tp: int, device: str, ports: list[int]) -> list[Replica]:
    replicas = [Replica(f"dp{i}", ports[i]) for i in range(n)]
    gpus = visible_gpus() if device in ("cuda", "auto") else []
    if device == "cuda" or gpus:
        if len(gpus) < n * tp:
            raise ValueError(f"--dp {n} --tp {tp} needs {n * tp} GPUs, {len(gpus)} are visible")
        for i, r in enumerate(replicas):
            r.gpus = gpus[i * tp : (i + 1) * tp]
        return replicas
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        logger.warning("%d replicas on %d cores: replicas share cores", n, len(cores))
    for r, share in zip(replicas, share_cores(cores, n)):
        r.cores = share
    return replicas


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def replica_argv(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, replica: Replica
) -> list[str]:
    """launch.serve's flags for one replica: every flag the user set, but the whole server's."""
    argv = ["--host", "127.0.0.1", "--port", str(replica.port), "--replica-name", replica.name]
    for action in parser._actions:
        if action.dest in TOP_LEVEL_FLAGS or not action.option_strings:
            continue
        value = getattr(ns, action.dest)
        if value == action.default:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv


def router_argv(ns: argparse.Namespace, replicas: list[Replica], port: int) -> list[str]:
    """The router's flags: on 127.0.0.1:port, behind the front door on --host/--port."""
    from relay.api.guard import default_allowed_hosts

    argv = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *[r.url for r in replicas],
        "--policy",
        ns.router_policy,
        "--prometheus-host",
        ns.host,
        "--prometheus-port",
        str(ns.router_prometheus_port),
        *ROUTER_HEALTH_ARGS,
        "--shutdown-grace-period-secs",
        str(ROUTER_GRACE_SECONDS),
        "--log-level",
        "debug" if ns.log_level == "debug" else "warn",
    ]
    if ns.api_key:
        argv += ["--api-key", ns.api_key]  # it checks clients' keys, and sends it on its own probes
    # The router drops Origin and rewrites Host, so the replicas' checks cannot see a web page's
    # cross-site request: the router's CORS list keeps browsers to the origins the server answers to.
    hosts = default_allowed_hosts(
        ns.host, ns.allowed_hosts.split(",") if ns.allowed_hosts else None
    )
    if hosts is not None:
        argv += [
            "--cors-allowed-origins",
            *[f"http://{f'[{h}]' if ':' in h else h}:{ns.port}" for h in sorted(hosts)],
        ]
    return argv + shlex.split(ns.router_args)
