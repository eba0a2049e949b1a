"""Tensor parallelism across machines (`--nnodes`, `--node-rank`, `--dist-init-addr`; launch/multinode.py).

Unit tests of the node plan (ranks per node, the address scheme, flag checks), the heartbeat
bookkeeping, and two launchers' links over loopback. The slow tests run two "nodes" on this
machine: two `launch.serve` invocations on 127.0.0.1 with `--nnodes 2 --tp 2`, whose greedy
float32 output must equal the `--tp 1` offline engine's, and node 0 must exit non-zero, naming node 1,
once node 1 is killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ipc.messages import NodeMsg
from ipc.nodes import NodePlan
from launch.children import plan_children
from launch.flags import build_parser
from launch.multinode import NodeLink, PeerWatch, gloo_env, interface_for, plan_from_args
from relay import Engine, SamplingParams
from relay.config import EngineConfig
from tests.helpers.server_utils import ROOT, Server, alive, wait_until


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(list(flags))


def free_port_run(n: int) -> int:
    """A port P with P..P+n-1 all free on 127.0.0.1 (the address scheme uses consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


# ---- the plan -------------------------------------------------------------------------------


def test_plan_splits_ranks_and_derives_every_address_from_dist_init_addr():
    plan = plan_from_args(
        parse(
            "--tp", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "localhost:5000"
        )
    )
    assert plan.multi and plan.host == "127.0.0.1"  # resolved: ZeroMQ binds to addresses
    assert list(plan.local_ranks()) == [2, 3] and list(plan.local_ranks(0)) == [0, 1]
    assert [plan.is_remote(r) for r in range(4)] == [False, False, True, True]
    assert plan.dist_init_method == "tcp://127.0.0.1:5000"
    assert plan.control_endpoint == "tcp://127.0.0.1:5001"
    assert plan.inbox_endpoint(3) == "tcp://127.0.0.1:5005"
    assert NodePlan.from_dict(plan.to_dict()) == plan and not NodePlan.from_dict(None).multi


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tp", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"], "split evenly"),
        (["--tp", "2", "--nnodes", "2"], "--dist-init-addr"),
        (
            [
                "--tp",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--dist-init-addr",
                "127.0.0.1:5000",
            ],
            "--node-rank",
        ),
        (["--node-rank", "1"], "--nnodes"),
        (["--tp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:http"], "--dist-init-addr"),
        (["--tp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:65534"], "no room"),
    ],
)
def test_bad_multinode_flags_name_the_flag(flags, says):
    with pytest.raises(ValueError, match=says):
        plan_from_args(parse(*flags))


def test_node0_runs_everything_other_nodes_only_their_ranks():
    cfg = EngineConfig(tp_size=4)
    node0 = NodePlan(2, 0, "127.0.0.1", 5000, 4)
    node1 = NodePlan(2, 1, "127.0.0.1", 5000, 4)
    assert [c.name for c in plan_children(cfg, 1, node0)] == [
        "tp0",
        "tp1",
        "sched",
        "detok",
        "tokenizer",
    ]
    assert [(c.name, c.index) for c in plan_children(cfg, 1, node1)] == [("tp2", 2), ("tp3", 3)]
    assert [c.name for c in plan_children(cfg, 1)][:4] == [
        "tp0",
        "tp1",
        "tp2",
        "tp3",
    ]  # one node: as before


def test_gloo_talks_over_the_interface_that_reaches_node0():
    assert interface_for("127.0.0.1") == "lo"
    assert gloo_env(NodePlan()) == {}
    env = gloo_env(NodePlan(2, 0, "127.0.0.1", 5000, 2))
    assert env["GLOO_SOCKET_IFNAME"] == os.environ.get("GLOO_SOCKET_IFNAME", "lo")


# ---- liveness ---------------------------------------------------------------------------------


def test_peer_watch_names_the_node_that_is_late_down_or_gone():
    w = PeerWatch(
        [1, 2], now=0.0, join_timeout=30, heartbeat_timeout=5, describe=lambda n: f"node {n}"
    )
    assert w.check(10.0) is None
    w.heard(NodeMsg(1, "hello"), 10.0)
    w.heard(NodeMsg(1, "beat"), 30.0)
    assert w.check(31.0) == "node 2 did not connect within 30 s"

    w = PeerWatch(
        [1, 2], now=0.0, join_timeout=30, heartbeat_timeout=5, describe=lambda n: f"node {n}"
    )
    for node in (1, 2):
        w.heard(NodeMsg(node, "ready", info={"tp1": {}}), 1.0)
    assert w.all_ready and w.check(5.9) is None
    w.heard(NodeMsg(1, "beat"), 6.0)
    assert w.check(6.5) == "node 2 stopped answering (5.5 s without a heartbeat)"

    w = PeerWatch([1], now=0.0, join_timeout=30, describe=lambda n: f"node {n}")
    w.heard(NodeMsg(7, "down", "stranger"), 1.0)  # not a peer: ignored
    assert w.check(1.0) is None
    w.heard(NodeMsg(1, "down", "relay::tp1 died"), 1.0)
    assert w.check(1.0) == "node 1 went down: relay::tp1 died"


def test_two_links_exchange_ready_and_hear_a_bye_or_silence():
    plan = NodePlan(2, 0, "127.0.0.1", free_port_run(4), 2)
    hub = NodeLink(plan, join_timeout=10, heartbeat_timeout=2).start()
    worker = NodeLink(
        NodePlan(2, 1, plan.host, plan.port, 2), join_timeout=10, heartbeat_timeout=2
    ).start()
    failures: list[str] = []
    worker.on_failure(failures.append)
    try:
        worker.send("ready", info={"tp1": {"num_pages": 5}})
        assert hub.wait_all_ready(10) == {1: {"tp1": {"num_pages": 5}}}
        hub.close("bye")
        wait_until(lambda: failures, 5, "the worker hears node 0's bye")
        assert failures == ["node 0 (127.0.0.1) shut down"] and worker.watch.clean_exit
    finally:
        hub.close()
        worker.close()

    plan = NodePlan(2, 0, "127.0.0.1", free_port_run(4), 2)
    hub = NodeLink(plan, join_timeout=10, heartbeat_timeout=1.5).start()
    worker = NodeLink(NodePlan(2, 1, plan.host, plan.port, 2), join_timeout=10).start()
    try:
        wait_until(lambda: hub.watch.last[1] is not None, 5, "node 1's hello")
        worker.stopped.set()  # falls silent, as a killed machine does (no bye)
        worker.thread.join(2)
        with pytest.raises(RuntimeError, match=r"node 1 \(TP rank 1\) stopped answering"):
            wait_until(lambda: hub.raise_if_failed(), 5, "node 1 missed")
    finally:
        hub.close()


# ---- two nodes on this machine ----------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time in a land far away,"]
# Float activations: int8 block activations can round TP's other summation order into a whole step.
FLAGS = ["--dtype", "float32", "--block-activations", "float", "--kv-cache-gb", "0.1"]
TWO_NODES = [*FLAGS, "--num-threads", "1"]  # two ranks on this machine's 2 cores: one thread each


def greedy(server: Server, n: int = 12) -> list[list[int]]:
    with server.client() as c:
        return [
            c.post(
                "/generate",
                json={
                    "text": p,
                    "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                },
            ).json()["output_ids"]
            for p in PROMPTS
        ]


class Node1:
    """`launch.serve --node-rank 1` in its own session (so the test can kill the whole 'machine')."""

    def __init__(self, port: int, *flags: str):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launch.serve",
                *flags,
                "--tp",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--dist-init-addr",
                f"127.0.0.1:{port}",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.mark.slow
def test_two_nodes_equal_tp1_and_a_dead_node_stops_node0(default_model_dir):
    # The offline engine is the tp 1 reference (the server's tp 1 output equals it:
    # tests/server/test_speculative_server.py): cheaper than a third server.
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    expected = [
        o.token_ids
        for o in Engine(
            default_model_dir, dtype="float32", block_activations="float", kv_cache_gb=0.1
        ).generate(PROMPTS, params)
    ]

    port = free_port_run(5)  # rendezvous, node 0's launcher, rank 1's inbox (+ room)
    node1 = Node1(port, *TWO_NODES)
    try:
        # Overlap forced on: decodes run on PENDING_TOKEN inputs that rank 0 fills and sends to rank 1.
        node0 = Server(
            *TWO_NODES,
            "--tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--dist-init-addr",
            f"127.0.0.1:{port}",
            "--overlap-min-share",
            "0",
        )
        try:
            assert greedy(node0) == expected
            node0_children = node0.children()
            node1_pids = [
                int(p)
                for p in subprocess.run(
                    ["pgrep", "-g", str(node1.proc.pid)], capture_output=True, text=True
                ).stdout.split()
            ]
            node1.kill()  # the whole machine: its launcher and its rank
            t0 = time.monotonic()
            code = node0.proc.wait(15)
            assert code != 0, "node 0 exits non-zero"
            assert "node 1" in node0.log, node0.log[-2000:]
            print(f"node 0 exited {code} {time.monotonic() - t0:.1f} s after node 1 died")
            wait_until(
                lambda: not [p for p in node0_children if alive(p)], 10, "node 0's children gone"
            )
            assert not [p for p in node1_pids if alive(p)]
        finally:
            node0.stop()
    finally:
        node1.kill()


@pytest.mark.slow
def test_node1_exits_when_node0_goes_away():
    port = free_port_run(5)
    node1 = Node1(port, "--load-format", "dummy-null")
    try:
        node0 = Server(
            "--load-format",
            "dummy-null",
            "--tp",
            "2",
            "--nnodes",
            "2",
            "--dist-init-addr",
            f"127.0.0.1:{port}",
        )
        os.killpg(node0.proc.pid, signal.SIGKILL)  # node 0's machine dies: no bye
        node0.proc.wait()
        assert node1.proc.wait(15) == 1
    finally:
        node1.kill()
