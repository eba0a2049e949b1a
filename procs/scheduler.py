"""relay::sched: owns the Scheduler policy; sends each step to every model-runner rank.

While a step runs it keeps taking new requests and aborts, so batch decisions never wait
on the tokenizer or the network. Per step it sends one BatchTokenOut to the detokenizer.
"""
from __future__ import annotations

import logging
import time

import zmq

from ipc.codec import decode, encode
from ipc.messages import (AbortReq, BatchTokenOut, ControlOut, ControlReq, DetokInit, ErrorOut, Heartbeat,
                          Ready, TokenizedReq)
from ipc.sockets import (DETOKENIZER, HTTP, RUNNER_RESULT, SCHEDULER, endpoint, pull, push,
                         recv_ready, runner_inbox, send)
from procs.common import ProcArgs, announce_ready, child_main
from relay.batch import BatchInput, BatchOutput
from relay.config import ModelConfig
from relay.request import Req, TokenEvent
from relay.scheduler import RequestRejected, Scheduler

logger = logging.getLogger(__name__)

IDLE_CHECK_SECONDS = 5.0  # KV accounting check when idle: report, never kill the server
ABORT_TOMBSTONE_SECONDS = 60.0  # how long an abort waits for a request still in the tokenizer
PROMPT_TAIL = 5


class SchedulerLoop:
    def __init__(self, args: ProcArgs, ctx: zmq.Context):
        cfg = args.engine_config
        ep = lambda name: endpoint(args.ipc_dir, name)  # noqa: E731
        self.inbox = pull(ctx, ep(SCHEDULER))
        self.results = pull(ctx, ep(RUNNER_RESULT))
        self.to_runners = [push(ctx, ep(runner_inbox(r)), bind=True) for r in range(cfg.tp_size)]
        self.to_detok = push(ctx, ep(DETOKENIZER))
        self.to_http = push(ctx, ep(HTTP))
        info = self._wait_for_runner()
        cfg.chunked_prefill_size = info["chunked_prefill_size"]  # resolved for the runner's device
        self.sched = Scheduler(cfg, info["num_pages"], info["context_len"], info["eos_token_ids"],
                               on_finish=log_request if cfg.log_requests else None,
                               attention_break_even=ModelConfig.from_dir(args.model_dir).attention_break_even())
        self.info = info
        self.early_aborts: dict[str, float] = {}
        self.pending_events: list[TokenEvent] = []
        self.pending_inits: list[DetokInit] = []
        self.last_check = time.monotonic()
        self.step_started: float | None = None  # while a model step runs
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
            batch = self.sched.schedule() if self.sched.has_work else None
            if batch is None:
                self.flush_events()
                self.idle_check()
                poller.poll(timeout=IDLE_CHECK_SECONDS * 1000)
                continue
            out = self.run_step(batch)
            self.pending_events.extend(self.sched.process_output(batch, out))
            self.flush_events()

    def run_step(self, batch: BatchInput) -> BatchOutput:
        """Send the step to every rank; take new requests and aborts until rank 0 answers."""
        data = encode(batch)
        for sock in self.to_runners:
            sock.send(data, copy=False)
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        self.step_started = time.monotonic()
        try:
            while True:
                ready = dict(poller.poll())
                if self.inbox in ready:
                    self.handle(recv_ready(self.inbox))
                if self.results in ready:
                    (out,) = recv_ready(self.results)
                    return out
        finally:
            self.step_started = None

    # ---- messages ---------------------------------------------------------------------
    def handle(self, msgs: list) -> None:
        for msg in msgs:
            try:
                self.handle_one(msg)
            except Exception:  # one message's failure must not stop the scheduler
                logger.exception("handling %s failed", type(msg).__name__)
                if isinstance(msg, TokenizedReq):
                    send(self.to_http, ErrorOut(msg.rid, "the scheduler could not accept this request", None, 500))

    def handle_one(self, msg) -> None:
        if isinstance(msg, TokenizedReq):
            self.add(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, ControlReq):
            send(self.to_http, self.control(msg))
        elif isinstance(msg, Heartbeat):
            msg.step_age = 0.0 if self.step_started is None else time.monotonic() - self.step_started
            send(self.to_detok, msg)
        else:
            logger.error("unexpected message %s", type(msg).__name__)

    def add(self, msg: TokenizedReq) -> None:
        aborted_at = self.early_aborts.pop(msg.rid, None)
        if aborted_at is not None and aborted_at >= msg.arrival_time:
            return  # its client left before it got here
        req = Req(msg.rid, msg.input_ids, msg.params, priority=msg.priority,
                  arrival_time=time.monotonic() - max(0.0, time.time() - msg.arrival_time))
        try:
            self.sched.add_request(req)
        except RequestRejected as e:
            send(self.to_http, ErrorOut(msg.rid, str(e), e.field))
            return
        p = msg.params
        self.pending_inits.append(DetokInit(msg.rid, msg.input_ids[-PROMPT_TAIL:], p.skip_special_tokens,
                                            p.stop, p.include_stop_str_in_output))

    def abort(self, msg: AbortReq) -> None:
        if msg.reason == "abort":
            event = self.sched.abort(msg.rid)
        else:  # the detokenizer found a stop string
            event = self.sched.finish(msg.rid, msg.reason, msg.matched_stop)
        if event is not None:
            self.pending_events.append(event)
        elif msg.reason == "abort":  # not here yet (still in the tokenizer): drop it on arrival
            now = time.time()
            self.early_aborts = {r: t for r, t in self.early_aborts.items() if now - t < ABORT_TOMBSTONE_SECONDS}
            self.early_aborts[msg.rid] = msg.sent_at or now

    def control(self, msg: ControlReq) -> ControlOut:
        if msg.kind == "get_info":
            st = self.sched.stats()
            data = {**vars(st), "cache_hit_rate": st.cache_hit_rate, **self.info}
            return ControlOut(msg.req_id, True, data)
        if msg.kind == "flush_cache":
            if self.sched.running or self.sched.num_waiting:
                return ControlOut(msg.req_id, False, {"error": "requests are running; flush when idle"})
            self.sched.cache.reset()
            return ControlOut(msg.req_id, True, {})
        return ControlOut(msg.req_id, False, {"error": f"unknown control {msg.kind!r}"})

    def flush_events(self) -> None:
        if not self.pending_events and not self.pending_inits:
            return
        events, self.pending_events = self.pending_events, []
        inits, self.pending_inits = self.pending_inits, []
        send(self.to_detok, BatchTokenOut(
            rids=[e.rid for e in events],
            token_ids=[-1 if e.token_id is None else e.token_id for e in events],
            finish_reasons=[e.finish_reason for e in events],
            matched_stops=[e.matched_stop for e in events],
            logprobs=[e.logprob for e in events],
            top_logprobs=[e.top_logprobs for e in events],
            prompt_tokens=[e.prompt_tokens for e in events],
            completion_tokens=[e.completion_tokens for e in events],
            cached_tokens=[e.cached_tokens for e in events],
            errors=[e.error for e in events],
            inits=inits,
            queue_times=[e.queue_time for e in events],
        ))

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
    logger.info("request rid=%s finish=%s e2e=%.3fs ttft=%.3fs queue=%.3fs prompt_tokens=%d cached_tokens=%d "
                "completion_tokens=%d retractions=%d prompt_ids=%s output_ids=%s", req.rid, req.finish_reason,
                e2e, ttft, queue, len(req.prompt_ids), req.cached_tokens, len(req.output_ids),
                req.num_retractions, req.prompt_ids, req.output_ids)


def main(args: ProcArgs) -> None:
    SchedulerLoop(args, zmq.Context()).run()


if __name__ == "__main__":
    child_main(main)
