"""`python -m launch.serve`: start Relay's processes, serve HTTP, supervise, shut down cleanly.

This process becomes relay::http. It converts the model once if needed, starts the
tokenizer worker(s), the scheduler, one model runner per TP rank and the detokenizer,
waits until each reports ready, then serves. If any child dies, in-flight requests fail
with an error and the server exits non-zero with every child gone.

With `--dp N` this process supervises N such servers (replicas) behind sglang-router instead
(launch/dp.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

import zmq

from ipc.sockets import make_ipc_dir, remove_ipc_dir, remove_stale_ipc_dirs
from launch.children import Child, Launcher
from launch.flags import build_parser, check_model_config, engine_config
from launch.model_dir import resolve_model_dir_apart
from launch.multinode import NodeLink, plan_from_args
from launch.ports import PortUnavailable, bind_port
from procs.common import proc_label, set_title, setup_logging
from relay.api.guard import (
    GuardConfig,
    close_idle_forever,
    default_allowed_hosts,
    default_max_connections,
    guarded_protocol,
    raise_fd_limit,
)
from relay.config import EngineConfig, ModelConfig
from relay.execution.draft_check import check_draft_model
from relay.execution.kernels import isa
from relay.execution.model_files import (
    ModelFileError,
    check_cache_dir,
    model_name,
)
from relay.optional_features import missing_features

logger = logging.getLogger("relay.launch")


# ---- HTTP -------------------------------------------------------------------------------
def serve_http(
    ns: argparse.Namespace,
    cfg: EngineConfig,
    launcher: Launcher,
    served_model: str,
    infos: dict[str, dict],
    mc: ModelConfig,
    http_socket: socket.socket,
    link: NodeLink | None = None,
) -> int:
    import uvicorn

    from procs.http_server import ZmqEngineClient, build_app
    from relay import __version__
    from relay.api.drain import drain

    tp0 = infos.get("tp0", {})
    tokenizer = next((info for name, info in infos.items() if name.startswith("tokenizer")), {})
    # The tokenizer read the chat template: it resolves the default tool-call format.
    tool_call_parser = cfg.tool_call_parser or tokenizer.get("tool_call_parser") or "hermes"
    server_info = {
        **cfg.to_dict(),
        "tool_call_parser": tool_call_parser,
        "served_model_name": served_model,
        "model_dir": launcher.model_dir,
        "max_total_tokens": tp0.get("max_total_tokens"),
        "context_len": tp0.get("context_len"),
        "hidden_size": mc.hidden_size,  # an embedding's length (/v1/embeddings' dimensions)
        "tokenizer_workers": ns.tokenizer_workers,
        "replica": ns.replica_name,
        "version": __version__,
        "cpu_isa": isa.level(),
    }
    guard = GuardConfig(
        api_key=ns.api_key,
        max_body_bytes=ns.max_request_body_bytes,
        body_timeout=ns.http_timeout,
        allowed_hosts=default_allowed_hosts(
            ns.host, (ns.allowed_hosts or "").split(",") if ns.allowed_hosts else None
        ),
    )
    max_connections = ns.max_connections or default_max_connections(raise_fd_limit())
    exit_code = 0

    class Server(uvicorn.Server):
        # Set in main(): the drain to run on the first signal, the event a second one sets, and
        # the loop the (synchronous) signal handler hands both to.
        drain: Callable[[asyncio.Event], Awaitable[int]] | None = None
        cut_drain: asyncio.Event | None = None
        loop: asyncio.AbstractEventLoop | None = None
        draining = False
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig, frame) -> None:
            """The first signal starts a drain (relay.api.drain) that ends in should_exit; another
            during the drain cuts its wait short; after it, uvicorn's own (a SIGINT forces the exit)."""
            if self.should_exit or not self.started or self.drain is None:
                return super().handle_exit(sig, frame)
            if not self.draining:
                self.draining = True
                self._captured_signals.append(
                    sig
                )  # re-raised once serve() returns: the exit-0 path
                self.loop.call_soon_threadsafe(self._start_drain)
            else:
                self.loop.call_soon_threadsafe(self.cut_drain.set)

        def _start_drain(self) -> None:
            self.drain_task = self.loop.create_task(
                self._drain()
            )  # held: a task nobody holds may be collected

        async def _drain(self) -> None:
            try:
                await self.drain(self.cut_drain)
            finally:
                self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                # A replica's line must not read "Relay is ready": that is the whole server's.
                what = f"Relay replica {ns.replica_name} is" if ns.replica_name else "Relay is"
                nodes = f", {launcher.nodes.nnodes} nodes" if launcher.nodes.multi else ""
                print(
                    f"{what} ready: http://{ns.host}:{ns.port}  (model {served_model}, tp {cfg.tp_size}{nodes})",
                    flush=True,
                )

    async def main() -> None:
        nonlocal exit_code
        client = ZmqEngineClient(
            launcher.ipc_dir,
            served_model,
            tp0.get("context_len", 0),
            cfg.max_queued_requests,
            server_info,
            vocab_size=mc.vocab_size,
            health_timeout=ns.health_timeout,
            max_constraint_bytes=cfg.max_constraint_bytes,
            max_constraint_depth=cfg.max_constraint_depth,
            max_constraint_properties=cfg.max_constraint_properties,
            reasoning_parser=cfg.reasoning_parser,
            tool_call_parser=tool_call_parser,
        )
        app = build_app(client, guard)
        loop = asyncio.get_running_loop()
        server = Server(
            uvicorn.Config(
                app,
                host=ns.host,
                port=ns.port,
                log_level=ns.log_level,
                access_log=False,
                timeout_graceful_shutdown=3,
                lifespan="off",
                http=guarded_protocol(max_connections),
                timeout_keep_alive=max(1, int(ns.http_timeout)),
            )
        )
        server.cut_drain, server.loop = asyncio.Event(), loop
        server.drain = lambda cut: drain(client, ns.shutdown_timeout, cut)

        def fail(message: str) -> None:
            nonlocal exit_code
            logger.error("%s; failing in-flight requests and shutting down", message)
            exit_code = 1
            client.fail_all(message)
            server.should_exit = True

        def child_died(child: Child, code: int) -> None:
            fail(f"relay::{child.name} (pid {child.proc.pid}) died with exit code {code}")

        launcher.watch(lambda child, code: loop.call_soon_threadsafe(child_died, child, code))
        if link is not None:  # another node gone: its ranks are part of every step
            link.on_failure(lambda reason: loop.call_soon_threadsafe(fail, reason))
        if not await client.wait_for_tokenizer(ns.startup_timeout):
            logger.error("no tokenizer process connected within %g s", ns.startup_timeout)
            exit_code = exit_code or 1
            return
        tasks = [
            asyncio.create_task(client.dispatch_forever()),
            asyncio.create_task(client.heartbeat_forever()),
            asyncio.create_task(
                close_idle_forever(server.server_state.connections, ns.http_timeout)
            ),
        ]
        try:
            await server.serve(sockets=[http_socket])
        finally:
            for task in tasks:
                task.cancel()
        if not server.started and exit_code == 0:
            exit_code = 1  # e.g. the port was taken

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return exit_code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:  # a held instruction-set level holds torch too, in every process: set before any starts
        os.environ.update(isa.torch_env())
    except ValueError as e:
        parser.error(str(e))
    if ns.dp < 1:
        parser.error("--dp must be at least 1")
    if not 0 <= ns.shutdown_timeout < float("inf"):  # NaN too
        parser.error("--shutdown-timeout must be a finite number of seconds >= 0")
    if ns.dp > 1 and ns.nnodes > 1:
        parser.error("--dp and --nnodes cannot be combined")
    try:  # options that contradict each other (--deterministic --dtype bfloat16): one line, status 2
        engine_config(ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.dp > 1:
        from launch.dp import serve_dp

        return serve_dp(parser, ns)
    from launch.dp_replicas import replica_setup

    replica_setup()  # as a --dp replica: die with the supervisor, keep to its share of the cores
    http_label = proc_label("http", ns.replica_name)
    set_title(f"relay::{http_label}")
    setup_logging(ns.log_level.upper(), http_label)
    cfg = engine_config(ns)
    try:
        nodes = plan_from_args(ns)
    except ValueError as e:
        parser.error(str(e))
    try:  # before any model loads; each failure is one line naming what to fix
        check_cache_dir()
        http_socket = bind_port(ns.host, ns.port) if nodes.node_rank == 0 else None
        # A GGUF's first conversion runs in a child: this process never holds torch.
        model_dir = resolve_model_dir_apart(cfg.model_path, ns.log_level.upper(), http_label)
    except (ModelFileError, PortUnavailable) as e:
        logger.error("%s", e)
        return 2
    try:  # fail here, not in every child
        mc = check_model_config(cfg, model_dir)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if cfg.speculative_algorithm == "standalone":
        try:
            draft = cfg.speculative_draft_model_path
            draft_dir = (
                model_dir
                if draft is None
                else resolve_model_dir_apart(draft, ns.log_level.upper(), http_label)
            )
            check_draft_model(mc, draft_dir, model_dir)
        except (ValueError, ModelFileError) as e:
            logger.error("%s", e)
            return 2
    served_model = cfg.served_model_name or model_name(cfg.model_path)
    for feature in missing_features():
        logger.warning("off: %s", feature)
    logger.info("CPU instruction-set level: %s", isa.describe())
    for path in remove_stale_ipc_dirs():
        logger.info("removed %s, left behind by a server that was killed", path)
    link = None
    if nodes.multi and nodes.node_rank == 0:
        try:  # first: a taken port must stop us before anything starts
            link = NodeLink(nodes, join_timeout=nodes.dist_timeout).start()
        except zmq.ZMQError as e:
            logger.error(
                "cannot bind node 0's launcher to %s (--dist-init-addr port + 1): %s",
                nodes.control_endpoint,
                e,
            )
            return 1
    ipc_dir = make_ipc_dir()
    launcher = Launcher(
        cfg, model_dir, ipc_dir, ns.tokenizer_workers, ns.log_level, ns.replica_name, nodes
    )
    if nodes.node_rank > 0:
        from launch.multinode import serve_worker_node

        set_title(f"relay::node{nodes.node_rank}")  # not relay::http: this node serves no HTTP
        try:
            return serve_worker_node(ns, nodes, launcher)
        finally:
            remove_ipc_dir(ipc_dir)
    # SIGTERM during startup must still clean up: turn it into an exception until uvicorn
    # installs its own handlers.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    code = 1
    try:
        launcher.start()
        infos = launcher.wait_ready(ns.startup_timeout, also=link.raise_if_failed if link else None)
        if link is not None:
            for node_infos in link.wait_all_ready(ns.startup_timeout).values():
                infos.update(node_infos)
        code = serve_http(ns, cfg, launcher, served_model, infos, mc, http_socket, link)
        return code
    except KeyboardInterrupt:
        deaths = launcher.died()
        for death in deaths:
            logger.error("%s before the stop signal: exiting 1", death)
        code = 1 if deaths else 0
        return code
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a signal now must not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if link is not None:  # first, so the other nodes hear why before their ranks see ours go
            link.close(
                "bye" if code == 0 else "down", "" if code == 0 else "node 0 stopped on an error"
            )
        launcher.stop()
        remove_ipc_dir(ipc_dir)


if __name__ == "__main__":
    sys.exit(main())
