"""relay::detok: token ids in, text deltas out, one message per scheduler step.

It applies stop strings: when one appears, the request's text is cut there, the http
server is told it finished, and the scheduler is told to stop generating for it.
"""
from __future__ import annotations

import logging
from dataclasses import fields

import zmq

from ipc.messages import AbortReq, BatchStrOut, BatchTokenOut, DetokInit, Heartbeat, Ready
from ipc.sockets import DETOKENIZER, HTTP, SCHEDULER, endpoint, pull, push, recv_ready, send
from procs.common import ProcArgs, announce_ready, child_main
from relay.request import FINISH_LENGTH, FINISH_STOP
from relay.sampling_params import SamplingParams
from relay.tokenizer import DecodeStream, Tokenizer

logger = logging.getLogger(__name__)


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.streams: dict[str, DecodeStream] = {}

    def start(self, init: DetokInit) -> None:
        params = SamplingParams(stop=init.stop, skip_special_tokens=init.skip_special_tokens,
                                include_stop_str_in_output=init.include_stop_str_in_output)
        self.streams[init.rid] = DecodeStream(self.tok, init.prompt_tail, params)

    def step(self, msg: BatchTokenOut) -> tuple[BatchStrOut, list[AbortReq]]:
        """Text deltas for one step, and the stop-string finishes to tell the scheduler."""
        for init in msg.inits:
            self.start(init)
        out = BatchStrOut(rids=[], texts=[], token_ids=[], finish_reasons=[], matched_stops=[], logprobs=[],
                          prompt_tokens=[], completion_tokens=[], cached_tokens=[], errors=[], queue_times=[])
        stops: list[AbortReq] = []
        for i, rid in enumerate(msg.rids):
            stream = self.streams.get(rid)
            if stream is None:
                continue  # already finished here (stop string) and now confirmed by the scheduler
            try:
                self._one(msg, i, stream, out, stops)
            except Exception as e:  # this request's failure only: end it, keep the others going
                logger.exception("detokenizing request %s failed", rid)
                self.streams.pop(rid, None)
                stops.append(AbortReq(rid))
                _append(out, rid, "", [], "abort", None, None, msg.prompt_tokens[i], msg.completion_tokens[i],
                        msg.cached_tokens[i], f"detokenization failed: {type(e).__name__}: {e}", None)
        return out, stops

    def _one(self, msg: BatchTokenOut, i: int, stream: DecodeStream, out: BatchStrOut,
             stops: list[AbortReq]) -> None:
        rid = msg.rids[i]
        token = msg.token_ids[i]
        new = [token] if token >= 0 else []
        reason = msg.finish_reasons[i]
        text = stream.add(new, finished=reason is not None)
        matched = msg.matched_stops[i]
        if stream.stopped is not None and reason in (None, FINISH_LENGTH):
            if reason is None:  # the scheduler is still generating it
                stops.append(AbortReq(rid, FINISH_STOP, stream.stopped))
            reason, matched = FINISH_STOP, stream.stopped
        if reason is not None:
            del self.streams[rid]
        _append(out, rid, text, new, reason, matched, self._logprobs(msg, i, new), msg.prompt_tokens[i],
                msg.completion_tokens[i], msg.cached_tokens[i], msg.errors[i],
                msg.queue_times[i] if msg.queue_times else None)

    def _logprobs(self, msg: BatchTokenOut, i: int, new: list[int]) -> list | None:
        if msg.logprobs[i] is None or not new:
            return None
        top = msg.top_logprobs[i]
        top_entries = None
        if top is not None:
            ids, lps = top
            top_entries = [[t, self.tok.decode([t], False), lp] for t, lp in zip(ids, lps)]
        return [[new[0], self.tok.decode(new, False), msg.logprobs[i], top_entries]]


def _append(out: BatchStrOut, rid: str, text: str, token_ids: list[int], reason: str | None, matched,
            logprobs, prompt_tokens: int, completion_tokens: int, cached_tokens: int, error: str | None,
            queue_time: float | None) -> None:
    out.rids.append(rid)
    out.texts.append(text)
    out.token_ids.append(token_ids)
    out.finish_reasons.append(reason)
    out.matched_stops.append(matched)
    out.logprobs.append(logprobs)
    out.prompt_tokens.append(prompt_tokens)
    out.completion_tokens.append(completion_tokens)
    out.cached_tokens.append(cached_tokens)
    out.errors.append(error)
    out.queue_times.append(queue_time)


def main(args: ProcArgs) -> None:
    cfg = args.engine_config
    detok = Detokenizer(Tokenizer(cfg.tokenizer_path or args.model_dir))
    ctx = zmq.Context()
    inbox = pull(ctx, endpoint(args.ipc_dir, DETOKENIZER))
    to_http = push(ctx, endpoint(args.ipc_dir, HTTP))
    to_sched = push(ctx, endpoint(args.ipc_dir, SCHEDULER))
    announce_ready(ctx, args.ipc_dir, Ready(args.name))
    while True:
        inbox.poll()
        msgs = recv_ready(inbox)
        results = [detok.step(msg) for msg in msgs if isinstance(msg, BatchTokenOut)]
        for _, stops in results:
            for stop in stops:
                send(to_sched, stop)
        if results:
            out = concat([r[0] for r in results])  # one message to http for all steps drained
            if out.rids:
                send(to_http, out)
        for beat in (msg for msg in msgs if isinstance(msg, Heartbeat)):
            send(to_http, beat)


def concat(outs: list[BatchStrOut]) -> BatchStrOut:
    if len(outs) == 1:
        return outs[0]
    return BatchStrOut(**{f.name: [x for o in outs for x in getattr(o, f.name)] for f in fields(BatchStrOut)})


if __name__ == "__main__":
    child_main(main)
