"""relay::detok: a loop around relay.text.detokenizer.Detokenizer.

Records in (from the scheduler), records with text out (to http, one message for all it
drained); stop strings it finds go to the scheduler as StopGenerating.
"""

from __future__ import annotations

import zmq

from ipc.messages import Heartbeat, OutputBatch, Ready, StopGenerating
from ipc.sockets import DETOKENIZER, HTTP, SCHEDULER, endpoint, pull, push, recv_ready, send
from procs.common import ProcArgs, announce_ready, child_main
from relay.text.detokenizer import Detokenizer, DetokenizeSpec
from relay.text.tokenizer import Tokenizer


def main(args: ProcArgs) -> None:
    cfg = args.engine_config
    tok = Tokenizer(cfg.tokenizer_path or args.model_dir, without_torch=True)
    tok.warm_up()
    detok = Detokenizer(tok)
    ctx = zmq.Context()
    inbox = pull(ctx, endpoint(args.ipc_dir, DETOKENIZER))
    to_http = push(ctx, endpoint(args.ipc_dir, HTTP))
    to_sched = push(ctx, endpoint(args.ipc_dir, SCHEDULER))
    announce_ready(ctx, args.ipc_dir, Ready(args.name))
    while True:
        inbox.poll()
        shown, beats = [], []
        for msg in recv_ready(inbox):
            if isinstance(msg, Heartbeat):
                beats.append(msg)
                continue
            outs, stops = (
                detok.start(msg) if isinstance(msg, DetokenizeSpec) else detok.process(msg.outputs)
            )
            shown += outs
            for stop in stops:
                send(to_sched, StopGenerating(stop.rid, stop.matched))
        if shown:
            send(to_http, OutputBatch(shown))
        for beat in beats:  # after the outputs that came before it
            send(to_http, beat)


if __name__ == "__main__":
    child_main(main)
