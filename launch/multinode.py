"""Tensor parallelism across machines (`--nnodes N --node-rank K --dist-init-addr HOST:PORT`).

Node 0 runs the whole server (http, tokenizer, scheduler, detokenizer) plus its share of the TP
ranks; every other node runs only its ranks. `--tp` is the total over all nodes, split evenly
(node k holds ranks [k*tp/N, (k+1)*tp/N)). Every address derives from --dist-init-addr, which is
node 0's address, so node 0 binds nothing but what the user named:

    HOST:PORT        torch.distributed rendezvous (tcp://, hosted by rank 0)
    HOST:PORT+1      node 0's launcher: every other launcher's hello/ready/heartbeats (ROUTER)
    HOST:PORT+2+r    rank r's step inbox, for each rank r on another node (node 0's scheduler
                     binds a PUSH, the rank connects a PULL; msgpack, as over ipc)

Liveness: the launchers exchange a heartbeat every second. Node 0 stops (exit 1, naming the
node) when a node says it is going down or falls silent for HEARTBEAT_TIMEOUT; the others stop
when node 0 does. The TP group's own timeout (--dist-timeout) bounds the init and every
collective, so a rank never waits forever on a peer that is gone.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import queue
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq

from ipc.codec import decode, encode
from ipc.messages import NodeMsg
from ipc.nodes import DEFAULT_DIST_TIMEOUT, NodePlan

logger = logging.getLogger("relay.multinode")

HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = 5.0  # silence after which a peer node counts as gone


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism across machines (docs/scaling.md)")
    g.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines the --tp ranks are spread over (--tp is the total, split evenly); run "
        "launch.serve once per machine with the same flags and its own --node-rank",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's place: 0 serves HTTP and schedules, the others run only their ranks",
    )
    g.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of node 0, reachable from every node: the TP rendezvous on PORT, node "
        "0's launcher on PORT+1, remote ranks' step inboxes on PORT+2+rank (all bound to HOST)",
    )
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_DIST_TIMEOUT,
        help="--nnodes > 1: seconds the TP group waits for every rank to join, and at most for any "
        "one collective",
    )


def plan_from_args(ns: argparse.Namespace) -> NodePlan:
    """The node plan the flags describe; ValueError names the flag that is wrong."""
    if ns.nnodes < 1:
        raise ValueError("--nnodes must be at least 1")
    if ns.nnodes == 1:
        if ns.node_rank != 0:
            raise ValueError("--node-rank needs --nnodes > 1")
        return NodePlan(tp_size=ns.tp_size)
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ValueError(f"--node-rank must be in [0, {ns.nnodes})")
    if ns.tp_size % ns.nnodes:
        raise ValueError(f"--tp {ns.tp_size} cannot be split evenly over --nnodes {ns.nnodes}")
    if getattr(ns, "dp", 1) > 1:
        raise ValueError("--dp and --nnodes cannot be combined")
    if not ns.dist_init_addr or ":" not in ns.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    host, _, port = ns.dist_init_addr.rpartition(":")
    host = host.strip("[]")
    try:
        port_n = int(port)
        addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (ValueError, socket.gaierror) as e:
        raise ValueError(f"--dist-init-addr {ns.dist_init_addr!r}: {e}") from None
    if not 0 < port_n <= 65535 - 1 - ns.tp_size:  # the last one is PORT+2+(tp-1)
        raise ValueError(
            f"--dist-init-addr port {port_n} leaves no room for PORT+1 .. PORT+{1 + ns.tp_size}"
        )
    return NodePlan(ns.nnodes, ns.node_rank, addr, port_n, ns.tp_size, ns.dist_timeout)


def interface_for(host: str) -> str | None:
    """The name of the network interface this machine reaches host through (gloo and NCCL
    must talk over it: their default, the interface of the machine's own hostname, is often
    127.0.1.1 or a docker bridge). None if it cannot be told."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None


def _ipv4_of(ifname: str) -> str | None:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


# ---- who is alive: pure bookkeeping, no sockets ---------------------------------------------
class PeerWatch:
    """Tracks peer nodes' heartbeats. check() returns why the server must stop (naming the
    node), or None. A peer has join_timeout to say hello, then heartbeat_timeout between beats."""

    def __init__(
        self,
        peers: list[int],
        now: float,
        join_timeout: float,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        describe: Callable[[int], str] = str,
    ):
        self.started = now
        self.last: dict[int, float | None] = {p: None for p in peers}
        self.ready: dict[int, dict] = {}
        self.join_timeout = join_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.describe = describe
        self.failure: str | None = None
        self.clean_exit = False  # the failure is a peer's clean shutdown

    def heard(self, msg: NodeMsg, now: float) -> None:
        if msg.node not in self.last or self.failure:
            return
        self.last[msg.node] = now
        if msg.kind == "ready":
            self.ready[msg.node] = msg.info
        elif msg.kind == "down":
            self.failure = f"{self.describe(msg.node)} went down: {msg.detail}"
        elif msg.kind == "bye":
            self.failure = f"{self.describe(msg.node)} shut down"
            self.clean_exit = True

    def check(self, now: float) -> str | None:
        if self.failure:
            return self.failure
        for node, last in self.last.items():
            if last is None and now - self.started > self.join_timeout:
                self.failure = (
                    f"{self.describe(node)} did not connect within {self.join_timeout:g} s"
                )
            elif last is not None and now - last > self.heartbeat_timeout:
                self.failure = f"{self.describe(node)} stopped answering ({now - last:.1f} s without a heartbeat)"
            if self.failure:
                break
        return self.failure

    @property
    def all_ready(self) -> bool:
        return len(self.ready) == len(self.last)


# ---- the launchers' link ----------------------------------------------------------------
class NodeLink:
    """This launcher's side of the launchers' link: a thread that sends a heartbeat every
    second, hears the peers' and calls the failure callback once when a peer is gone.

    Node 0 binds a ROUTER on PORT+1 and watches every other node; another node connects a
    DEALER and watches node 0. Only the thread touches the socket (ZeroMQ sockets are not
    thread-safe): send() queues."""

    def __init__(
        self, plan: NodePlan, join_timeout: float, heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    ):
        self.plan = plan
        self.leader = plan.node_rank == 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER if self.leader else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # a last bye or down may still leave after close
        if self.leader:
            self.sock.bind(plan.control_endpoint)
        else:
            self.sock.connect(plan.control_endpoint)
        peers = [n for n in range(1, plan.nnodes)] if self.leader else [0]
        self.watch = PeerWatch(
            peers, time.monotonic(), join_timeout, heartbeat_timeout, self.describe
        )
        self.routes: dict[int, bytes] = {}  # node -> its DEALER's identity (node 0 only)
        self.outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self._on_failure: Callable[[str], None] | None = None
        self._reported = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="node-link")

    def describe(self, node: int) -> str:
        if node == 0:
            return f"node 0 ({self.plan.host})"
        ranks = self.plan.local_ranks(node)
        which = f"ranks {ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else f"rank {ranks.start}"
        return f"node {node} (TP {which})"

    def start(self) -> NodeLink:
        self.send("hello")
        self.thread.start()
        return self

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call callback(reason) from the link's thread once a peer is gone (at once if it is)."""
        with self.lock:
            self._on_failure = callback
        self._report()

    def send(self, kind: str, detail: str = "", info: dict | None = None) -> None:
        self.outbox.put(encode(NodeMsg(self.plan.node_rank, kind, detail, info or {})))

    def _run(self) -> None:
        next_beat = 0.0
        while True:
            self._flush()
            if self.stopped.is_set():
                break
            now = time.monotonic()
            if now >= next_beat:
                self.send("beat")
                next_beat = now + HEARTBEAT_SECONDS
            if self.sock.poll(100):
                for frames in self._drain():
                    self._heard(frames, time.monotonic())
            self.watch.check(time.monotonic())
            self._report()
        self._flush()
        self.sock.close()
        self.ctx.term()

    def _report(self) -> None:
        with self.lock:
            if self.watch.failure is None or self._reported or self._on_failure is None:
                return
            self._reported = True
            callback = self._on_failure
        try:
            callback(self.watch.failure)
        except RuntimeError:  # the server's event loop is closed already: it is stopping anyway
            pass

    def _flush(self) -> None:
        while True:
            try:
                data = self.outbox.get_nowait()
            except queue.Empty:
                return
            try:  # never block the link: a peer that is not there yet misses a beat, no more
                if (
                    self.leader
                ):  # to every node that has said something (a ROUTER needs its identity)
                    for route in self.routes.values():
                        self.sock.send_multipart([route, data], zmq.NOBLOCK)
                else:
                    self.sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _drain(self) -> list[list[bytes]]:
        out = []
        while True:
            try:
                out.append(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out

    def _heard(self, frames: list[bytes], now: float) -> None:
        try:
            msg = decode(frames[-1])
        except Exception:  # not one of ours: something else reached the port
            logger.warning("ignored an undecodable message on %s", self.plan.control_endpoint)
            return
        if not isinstance(msg, NodeMsg):
            return
        if self.leader and len(frames) == 2 and 0 < msg.node < self.plan.nnodes:
            self.routes[msg.node] = frames[0]
        self.watch.heard(msg, now)

    def raise_if_failed(self) -> None:
        if self.watch.failure:
            raise RuntimeError(self.watch.failure)

    def wait_all_ready(self, timeout: float) -> dict[int, dict]:
        """Node 0: block until every other node said ready; RuntimeError names the one that failed."""
        deadline = time.monotonic() + timeout
        while not self.watch.all_ready:
            self.raise_if_failed()
            if time.monotonic() > deadline:
                missing = [self.describe(n) for n in self.watch.last if n not in self.watch.ready]
                raise RuntimeError(f"timed out waiting for {', '.join(missing)}")
            time.sleep(0.05)
        return dict(self.watch.ready)

    def close(self, kind: str = "bye", detail: str = "") -> None:
        """Tell the peers why we stop (bye: a clean shutdown, down: a failure), then close."""
        if self.stopped.is_set():
            return
        self.send(kind, detail)
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(3)


# ---- a node other than 0 ----------------------------------------------------------------
def serve_worker_node(ns: argparse.Namespace, plan: NodePlan, launcher) -> int:
    """Run this node's ranks until node 0 stops, a rank dies, or SIGTERM/SIGINT.

    launcher is a launch.children.Launcher holding only this node's ranks. Exit codes: 0 when
    node 0 shut down cleanly or we were told to stop, 1 on any failure."""
    link = NodeLink(plan, join_timeout=plan.dist_timeout)
    stop = threading.Event()
    why: list[str] = []

    def fail(reason: str) -> None:
        why.append(reason)
        stop.set()

    link.start()
    link.on_failure(fail)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        launcher.start()
        infos = launcher.wait_ready(ns.startup_timeout, also=link.raise_if_failed)
        link.send("ready", info=infos)
        print(
            f"Relay {link.describe(plan.node_rank)} is ready, of tp {plan.tp_size}; node 0 at {plan.host}",
            flush=True,
        )
        launcher.watch(
            lambda child, code: fail(
                f"relay::{child.name} (pid {child.proc.pid}) died with exit code {code}"
            )
        )
        while not stop.wait(0.5):
            pass
        if link.watch.clean_exit:
            logger.info("node 0 shut down: stopping")
            link.close("bye")
            return 0
        logger.error("%s: stopping this node", why[0])
        link.close("down", why[0])
        return 1
    except KeyboardInterrupt:
        link.close("bye")
        return 0
    except RuntimeError as e:
        if link.watch.clean_exit:
            link.close("bye")
            return 0
        logger.error("%s", e)
        link.close("down", str(e))
        return 1
    finally:
        launcher.stop()


def gloo_env(plan: NodePlan) -> dict[str, str]:
    """GLOO/NCCL_SOCKET_IFNAME for a rank's environment, unless the user set them."""
    if not plan.multi:
        return {}
    name = interface_for(plan.host)
    if not name:
        return {}
    return {k: os.environ.get(k, name) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
