"""relay::tokenizer: text or chat messages in, validated token ids out to the scheduler,
and to the detokenizer what it needs to turn the request's tokens back into text.

Several workers can run (`--tokenizer-workers`); the http server's PUSH socket spreads
requests over them, so tokenization never serialises on one process under load. An output
constraint passes through unread: the scheduler parses and compiles it off its loop (a deeply
nested schema takes seconds to parse, which here would hold up every request behind it).
"""

from __future__ import annotations

import dataclasses
import logging

import zmq

from ipc.messages import (
    ControlReply,
    GenerateReq,
    Heartbeat,
    OutputBatch,
    Ready,
    TokenizeCall,
    TokenizedReq,
)
from ipc.sockets import (
    DETOKENIZER,
    HTTP,
    SCHEDULER,
    TOKENIZER,
    endpoint,
    pull,
    push,
    recv_ready,
    send,
)
from procs.common import ProcArgs, announce_ready, child_main
from relay.api.tool_parsers import parser_for_template
from relay.config import ModelConfig
from relay.outputs import error_output
from relay.sampling_params import InvalidParam
from relay.text.detokenizer import DetokenizeSpec
from relay.text.tokenizer import PromptPreparer, Tokenizer

logger = logging.getLogger(__name__)


def tokenize(prep: PromptPreparer, req: GenerateReq) -> list[TokenizedReq]:
    """One TokenizedReq per choice (or per input of an embeddings request); choice i > 0 of a
    seeded request gets seed + i."""
    if req.inputs is not None:
        return [
            TokenizedReq(
                rid, ids, prep.fit_context(req.params, len(ids)), req.priority, req.arrival_time
            )
            for rid, ids in zip(req.rids, input_ids(prep, req.inputs))
        ]
    ids = prep.prompt_ids(req.text, req.input_ids, req.messages, req.chat_kwargs)
    params = prep.fit_context(req.params, len(ids))
    return [
        TokenizedReq(
            rid,
            ids,
            params
            if i == 0 or params.seed is None
            else dataclasses.replace(params, seed=params.seed + i),
            req.priority,
            req.arrival_time,
        )
        for i, rid in enumerate(req.rids)
    ]


def input_ids(prep: PromptPreparer, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's token ids; InvalidParam saying which input (item i) is refused."""
    out = []
    for i, x in enumerate(inputs):
        try:
            out.append(prep.prompt_ids(x, None) if isinstance(x, str) else prep.prompt_ids(None, x))
        except InvalidParam as e:
            raise InvalidParam(e.field, f"item {i}: {e}" if len(inputs) > 1 else str(e)) from None
    return out


def answer(prep: PromptPreparer, call: TokenizeCall) -> ControlReply:
    """/tokenize or /detokenize: the answer's data, or why not (a refusal names the field)."""
    q = call.query
    try:
        if q.kind == "detokenize":
            return ControlReply(call.call_id, True, {"prompt": prep.detokenize(q.tokens or [])})
        ids = prep.tokenize(q.text, q.messages, q.chat_kwargs, q.add_special_tokens)
        strs = {"token_strs": prep.tok.token_strs(ids)} if q.return_token_strs else {}
        return ControlReply(call.call_id, True, {"tokens": ids, **strs})
    except InvalidParam as e:
        return ControlReply(
            call.call_id, False, {"message": str(e), "param": e.field, "status": 400}
        )
    except Exception as e:  # this call's failure, never the worker's
        logger.exception("%s failed", q.kind)
        return ControlReply(
            call.call_id,
            False,
            {
                "message": f"{q.kind} failed: {type(e).__name__}: {e}",
                "param": None,
                "status": 500,
            },
        )


def main(args: ProcArgs) -> None:
    cfg = args.engine_config
    mc = ModelConfig.from_dir(args.model_dir)
    prep = PromptPreparer(
        Tokenizer(cfg.tokenizer_path or args.model_dir, cfg.chat_template, without_torch=True),
        cfg.context_length or mc.max_position_embeddings,
        mc.vocab_size,
    )
    prep.tok.warm_up()
    ctx = zmq.Context()
    inbox = pull(ctx, endpoint(args.ipc_dir, TOKENIZER), bind=False)
    to_sched = push(ctx, endpoint(args.ipc_dir, SCHEDULER))
    to_detok = push(ctx, endpoint(args.ipc_dir, DETOKENIZER))
    to_http = push(ctx, endpoint(args.ipc_dir, HTTP))
    # The architecture or the chat template says which tool-call format the model was taught
    # (--tool-call-parser's default: harmony for gpt-oss, which also splits off its reasoning).
    announce_ready(
        ctx,
        args.ipc_dir,
        Ready(
            args.name,
            info={
                "tool_call_parser": parser_for_template(
                    prep.tok.hf.chat_template
                    if isinstance(prep.tok.hf.chat_template, str)
                    else None,
                    mc.architecture,
                )
            },
        ),
    )
    while True:
        inbox.poll()
        for msg in recv_ready(inbox):
            if isinstance(msg, Heartbeat):
                send(to_sched, msg)
                continue
            if isinstance(msg, TokenizeCall):
                send(to_http, answer(prep, msg))
                continue
            try:
                reqs = tokenize(prep, msg)
            except InvalidParam as e:
                send(to_http, OutputBatch([error_output(rid, str(e), e.field) for rid in msg.rids]))
                continue
            except Exception as e:  # this request's failure, never the worker's
                logger.exception("tokenizing request %s failed", msg.rids[0])
                send(
                    to_http,
                    OutputBatch(
                        [
                            error_output(
                                rid, f"tokenization failed: {type(e).__name__}: {e}", status=500
                            )
                            for rid in msg.rids
                        ]
                    ),
                )
                continue
            for req in reqs:  # the detokenizer hears of a request before its first token can
                send(to_detok, DetokenizeSpec.of(req.rid, req.input_ids, req.params))
                send(to_sched, req)


if __name__ == "__main__":
    child_main(main)
