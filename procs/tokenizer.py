"""relay::tokenizer: text or chat messages in, validated token ids out to the scheduler.

Several workers can run (`--tokenizer-workers`); the http server's PUSH socket spreads
requests over them, so tokenization never serialises on one process under load.
"""
from __future__ import annotations

import logging

import zmq

from ipc.messages import ErrorOut, GenerateReq, Heartbeat, Ready, TokenizedReq
from ipc.sockets import HTTP, SCHEDULER, TOKENIZER, endpoint, pull, push, recv_ready, send
from procs.common import ProcArgs, announce_ready, child_main
from relay.config import ModelConfig
from relay.sampling_params import InvalidParam, SamplingParams
from relay.tokenizer import PromptPreparer, Tokenizer

logger = logging.getLogger(__name__)


def tokenize(prep: PromptPreparer, req: GenerateReq) -> list[TokenizedReq]:
    """One TokenizedReq per choice; choice i > 0 of a seeded request gets seed + i."""
    ids = prep.prompt_ids(req.text, req.input_ids, req.messages, req.chat_kwargs)
    params = prep.fit_context(req.params, len(ids))
    out = []
    for i, rid in enumerate(req.rids):
        p = params if i == 0 or params.seed is None else SamplingParams.from_dict(
            {**params.to_dict(), "seed": params.seed + i})
        out.append(TokenizedReq(rid, ids, p, req.priority, req.arrival_time))
    return out


def main(args: ProcArgs) -> None:
    cfg = args.engine_config
    mc = ModelConfig.from_dir(args.model_dir)
    prep = PromptPreparer(Tokenizer(cfg.tokenizer_path or args.model_dir),
                          cfg.context_length or mc.max_position_embeddings, mc.vocab_size)
    prep.tok.max_token_chars  # computed once now, not on the first long prompt
    ctx = zmq.Context()
    inbox = pull(ctx, endpoint(args.ipc_dir, TOKENIZER), bind=False)
    to_sched = push(ctx, endpoint(args.ipc_dir, SCHEDULER))
    to_http = push(ctx, endpoint(args.ipc_dir, HTTP))
    announce_ready(ctx, args.ipc_dir, Ready(args.name))
    while True:
        inbox.poll()
        for msg in recv_ready(inbox):
            if isinstance(msg, Heartbeat):
                send(to_sched, msg)
                continue
            try:
                outs = tokenize(prep, msg)
            except InvalidParam as e:
                outs = [ErrorOut(rid, str(e), e.field) for rid in msg.rids]
            except Exception as e:  # this request's failure, never the worker's
                logger.exception("tokenizing request %s failed", msg.rids[0])
                outs = [ErrorOut(rid, f"tokenization failed: {type(e).__name__}: {e}", None, 500)
                        for rid in msg.rids]
            for out in outs:
                send(to_http if isinstance(out, ErrorOut) else to_sched, out)


if __name__ == "__main__":
    child_main(main)
