"""relay::detok: token ids in, text deltas out, one message per scheduler step.

It applies stop strings: when one appears, the request's text is cut there, the http
server is told it finished, and the scheduler is told to stop generating for it.
"""
from __future__ import annotations

from dataclasses import fields

import zmq

from ipc.messages import AbortReq, BatchStrOut, BatchTokenOut, DetokInit, Ready
from ipc.sockets import DETOKENIZER, HTTP, SCHEDULER, endpoint, pull, push, recv_ready, send
from procs.common import ProcArgs, announce_ready, child_main
from relay.request import FINISH_LENGTH, FINISH_STOP
from relay.sampling_params import SamplingParams
from relay.tokenizer import DecodeStream, Tokenizer


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
            out.rids.append(rid)
            out.texts.append(text)
            out.token_ids.append(new)
            out.finish_reasons.append(reason)
            out.matched_stops.append(matched)
            out.logprobs.append(self._logprobs(msg, i, new))
            out.prompt_tokens.append(msg.prompt_tokens[i])
            out.completion_tokens.append(msg.completion_tokens[i])
            out.cached_tokens.append(msg.cached_tokens[i])
            out.errors.append(msg.errors[i])
            out.queue_times.append(msg.queue_times[i] if msg.queue_times else None)
        return out, stops

    def _logprobs(self, msg: BatchTokenOut, i: int, new: list[int]) -> list | None:
        if msg.logprobs[i] is None or not new:
            return None
        top = msg.top_logprobs[i]
        top_entries = None
        if top is not None:
            ids, lps = top
            top_entries = [[t, self.tok.decode([t], False), lp] for t, lp in zip(ids, lps)]
        return [[new[0], self.tok.decode(new, False), msg.logprobs[i], top_entries]]


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
        results = [detok.step(msg) for msg in recv_ready(inbox)]
        for _, stops in results:
            for stop in stops:
                send(to_sched, stop)
        out = concat([r[0] for r in results])  # one message to http for all steps drained
        if out.rids:
            send(to_http, out)


def concat(outs: list[BatchStrOut]) -> BatchStrOut:
    if len(outs) == 1:
        return outs[0]
    return BatchStrOut(**{f.name: [x for o in outs for x in getattr(o, f.name)] for f in fields(BatchStrOut)})


if __name__ == "__main__":
    child_main(main)
