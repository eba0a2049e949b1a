"""relay::sched: runs the step loop (relay.scheduling.step_loop) over this process's sockets.

It feeds the loop the requests and aborts it receives, sends each step to every model-runner
rank and waits for rank 0's output, and publishes the loop's records to the detokenizer in one
OutputBatch per step. While a step runs it keeps taking new requests and aborts, so batch
decisions never wait on the tokenizer or the network; with overlap the loop builds and sends
step N+1 before step N's output comes back.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import zmq

from ipc.codec import decode, encode
from ipc.messages import (
    AbortRequest,
    ControlCall,
    ControlReply,
    Heartbeat,
    OutputBatch,
    Ready,
    StopGenerating,
    TokenizedReq,
)
from ipc.nodes import NodePlan
from ipc.sockets import (
    DETOKENIZER,
    HTTP,
    RUNNER_RESULT,
    SCHEDULER,
    endpoint,
    pull,
    push,
    recv_ready,
    runner_inbox,
    send,
)
from procs.common import ProcArgs, announce_ready, child_main
from relay.config import ModelConfig
from relay.lifecycle import Tombstones
from relay.outputs import FinishReason, RequestOutput, error_output
from relay.sampling_params import InvalidParam
from relay.scheduling.factory import make_scheduler, overlap_policy
from relay.scheduling.request import Req
from relay.scheduling.step_loop import StepLoop
from relay.step import BatchInput, BatchOutput
from relay.text.tokenizer import Tokenizer, eos_ids

logger = logging.getLogger(__name__)

IDLE_CHECK_SECONDS = 5.0  # KV accounting check when idle: report, never kill the server
ABORT_TOMBSTONE_SECONDS = 60.0
COMPILE_POLL_SECONDS = 0.002  # how long an abort waits for a request still in the tokenizer


class SchedulerLoop:
    def __init__(self, args: ProcArgs, ctx: zmq.Context):
        ep = lambda name: endpoint(args.ipc_dir, name)  # noqa: E731
        self.inbox = pull(ctx, ep(SCHEDULER))
        self.results = pull(ctx, ep(RUNNER_RESULT))
        nodes = NodePlan.from_dict(
            args.extra.get("nodes")
        )  # ranks on other nodes get their steps over TCP
        self.to_runners = [
            push(
                ctx,
                nodes.inbox_endpoint(r) if nodes.is_remote(r) else ep(runner_inbox(r)),
                bind=True,
            )
            for r in range(args.engine_config.tp_size)
        ]
        self.to_detok = push(ctx, ep(DETOKENIZER))
        self.to_http = push(ctx, ep(HTTP))
        mc = ModelConfig.from_dir(args.model_dir)
        tokenizer_path = args.engine_config.tokenizer_path or args.model_dir
        eos = eos_ids(mc, Tokenizer(tokenizer_path, without_torch=True))
        info = self._wait_for_runner()
        # The step budget and page size as the runner resolved them for its device.
        cfg = dataclasses.replace(
            args.engine_config,
            chunked_prefill_size=info["chunked_prefill_size"],
            page_size=info["page_size"],
        )
        self.sched = make_scheduler(
            cfg,
            mc,
            args.model_dir,
            eos,
            info["num_pages"],
            info["context_len"],
            info["kv_window"],
            on_finish=log_request if cfg.log_requests else None,
        )
        self.info = {**info, "eos_token_ids": eos}
        self.early_aborts = Tombstones(
            ABORT_TOMBSTONE_SECONDS, clock=time.time
        )  # sent_at is http's wall clock
        self.last_check = time.monotonic()
        self.loop = StepLoop(self.sched, self, overlap_policy(cfg), self.publish)
        self.step_started: float | None = None  # when the oldest step out started running
        self.sent = {
            "runner_bytes": 0,
            "detok_bytes": 0,
        }  # for /get_server_info and `python -m scripts.bench scheduler`
        announce_ready(ctx, args.ipc_dir, Ready(args.name, info=info))

    def _wait_for_runner(self) -> dict:
        ready = decode(self.results.recv())
        if not isinstance(ready, Ready) or not ready.ok:
            raise RuntimeError(f"model runner failed to start: {getattr(ready, 'error', ready)}")
        return ready.info

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            self.handle(recv_ready(self.inbox))
            if self.loop.step():
                continue
            self.loop.flush()
            self.idle_check()
            # A compiling grammar wakes no socket: look again soon while one is.
            poller.poll(
                timeout=COMPILE_POLL_SECONDS * 1000
                if self.sched.grammar_waits.compiling
                else IDLE_CHECK_SECONDS * 1000
            )

    def submit(self, batch: BatchInput) -> None:
        """Send a step to every runner rank (StepLoop's runner)."""
        data = encode(batch)
        for sock in self.to_runners:
            sock.send(data, copy=False)
        if not self.loop.inflight:
            self.step_started = time.monotonic()
        self.sent["runner_bytes"] += len(data)

    def collect(self) -> BatchOutput:
        """The oldest step's output from rank 0; new requests and aborts are taken meanwhile."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self.inbox in ready:
                self.handle(recv_ready(self.inbox))
            if self.results in ready:
                # One output per step, in order; the runner went straight on to the next step.
                out = decode(self.results.recv())
                self.step_started = time.monotonic() if len(self.loop.inflight) > 1 else None
                return out

    # ---- messages ---------------------------------------------------------------------
    def handle(self, msgs: list) -> None:
        for msg in msgs:
            try:
                self.handle_one(msg)
            except Exception:  # one message's failure must not stop the scheduler
                logger.exception("handling %s failed", type(msg).__name__)
                if isinstance(msg, TokenizedReq):
                    self.loop.outputs.append(
                        error_output(
                            msg.rid, "the scheduler could not accept this request", status=500
                        )
                    )

    def handle_one(self, msg) -> None:
        if isinstance(msg, TokenizedReq):
            self.add(msg)
        elif isinstance(msg, AbortRequest):
            self.abort(msg)
        elif isinstance(msg, StopGenerating):
            self.sched.stop(msg.rid, msg.matched)
        elif isinstance(msg, ControlCall):
            send(self.to_http, self.control(msg))
        elif isinstance(msg, Heartbeat):
            msg.step_age = (
                0.0 if self.step_started is None else time.monotonic() - self.step_started
            )
            send(self.to_detok, msg)
        else:
            logger.error("unexpected message %s", type(msg).__name__)

    def add(self, msg: TokenizedReq) -> None:
        if self.early_aborts.laid_since(msg.rid, msg.arrival_time):
            # Its client left before it got here; the detokenizer still has its spec to drop.
            self.loop.outputs.append(RequestOutput(msg.rid, finish_reason=FinishReason.ABORT))
            return
        req = Req(
            msg.rid,
            msg.input_ids,
            msg.params,
            priority=msg.priority,
            arrival_time=time.monotonic() - max(0.0, time.time() - msg.arrival_time),
        )
        try:
            self.sched.add_request(req)
        except InvalidParam as e:
            self.loop.outputs.append(error_output(msg.rid, str(e), e.field))

    def abort(self, msg: AbortRequest) -> None:
        record = self.sched.abort(msg.rid)
        if record is not None:
            self.loop.outputs.append(record)
        else:  # not here yet (still in the tokenizer): drop it on arrival
            self.early_aborts.add(msg.rid, msg.sent_at or time.time())

    def control(self, msg: ControlCall) -> ControlReply:
        if msg.kind == "get_info":
            st = self.sched.stats()
            data = {
                **vars(st),
                "cache_hit_rate": st.cache_hit_rate,
                **self.info,
                "step_work": {**self.loop.work, **self.sent},
                "overlap": self.loop.policy.to_dict(),
            }
            return ControlReply(msg.call_id, True, data)
        if msg.kind == "flush_cache":
            if self.sched.has_work:
                return ControlReply(
                    msg.call_id, False, {"error": "requests are running; flush when idle"}
                )
            self.sched.kv.cache.reset()
            return ControlReply(msg.call_id, True, {})
        return ControlReply(msg.call_id, False, {"error": f"unknown control {msg.kind!r}"})

    def publish(self, records: list[RequestOutput]) -> None:
        """Send the records to the detokenizer in one OutputBatch (StepLoop's publish)."""
        data = encode(OutputBatch(records))
        self.to_detok.send(data, copy=False)
        self.sent["detok_bytes"] += len(data)

    def idle_check(self) -> None:
        now = time.monotonic()
        if now - self.last_check < IDLE_CHECK_SECONDS:
            return
        self.last_check = now
        try:
            self.sched.check()
        except AssertionError as e:  # report, don't kill the server over bookkeeping
            logger.error("KV accounting check failed while idle: %s", e)


def log_request(req: Req) -> None:
    """One line per finished request: id, timings and raw token ids (for debugging)."""
    e2e = time.monotonic() - req.arrival_time
    queue = -1.0 if req.queue_time is None else req.queue_time
    ttft = -1.0 if req.first_token_time is None else req.first_token_time - req.arrival_time
    reason = getattr(req.finish_reason, "value", req.finish_reason)
    logger.info(
        "request rid=%s finish=%s e2e=%.3fs ttft=%.3fs queue=%.3fs prompt_tokens=%d cached_tokens=%d "
        "completion_tokens=%d retractions=%d spec_proposed=%d spec_accepted=%d prompt_ids=%s output_ids=%s",
        req.rid,
        reason,
        e2e,
        ttft,
        queue,
        len(req.prompt_ids),
        req.cached_tokens,
        len(req.output_ids),
        req.num_retractions,
        req.spec_proposed,
        req.spec_accepted,
        req.prompt_ids,
        req.output_ids,
    )


def main(args: ProcArgs) -> None:
    SchedulerLoop(args, zmq.Context()).run()


if __name__ == "__main__":
    child_main(main)
