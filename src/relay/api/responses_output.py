"""The Responses API's answer: the response object, and its streamed events.

Output items come from the blocks of the output (relay.api.output_blocks): reasoning (the
--reasoning-parser's split, as `reasoning_text` content), an assistant message with one
`output_text` part, and function calls. A response cut short by max_output_tokens is
`incomplete` (incomplete_details.reason "max_output_tokens"), its last item too.

A stream is OpenAI's event sequence: response.created, response.in_progress, then per item
output_item.added, its content_part.added, deltas (output_text, reasoning_text,
function_call_arguments), their .done, content_part.done and output_item.done; then
response.completed (or response.incomplete) carrying the whole response and its usage. A
failure mid-stream is an `error` event and response.failed. Every event has its
sequence_number and an SSE `event:` line naming its type.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from relay.api.output_blocks import (
    CALL,
    REASONING,
    TEXT,
    Block,
    BlockEvent,
    BlockStream,
    Grew,
    Opened,
)
from relay.api.responses_request import ResponsesRequest
from relay.api.serving import Choice, Usage
from relay.outputs import RequestOutput

_ID_PREFIX = {REASONING: "rs", TEXT: "msg", CALL: "fc"}
# The events that grow and close each kind of item: <name>.delta, <name>.done.
_DELTA = {
    REASONING: "response.reasoning_text",
    TEXT: "response.output_text",
    CALL: "response.function_call_arguments",
}


def item_id(rid: str, block: Block) -> str:
    """One id for the item in the stream and in the final response."""
    return f"{_ID_PREFIX[block.kind]}_{rid.split('-', 1)[-1]}_{block.index}"


def output_item(rid: str, block: Block, status: str) -> dict[str, Any]:
    iid = item_id(rid, block)
    if block.kind == REASONING:
        return {
            "id": iid,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": block.text}],
            "status": status,
        }
    if block.kind == TEXT:
        return {
            "id": iid,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_text_part(block.text)],
        }
    return {
        "id": iid,
        "type": "function_call",
        "call_id": block.call_id,
        "name": block.name,
        "arguments": block.text,
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_status(block: Block, blocks: list[Block], finish_reason: str | None) -> str:
    cut = finish_reason == "length" and block is blocks[-1]
    return "incomplete" if cut else "completed"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        # Reasoning tokens are not counted apart: the split is made on text, not tokens.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(
    req: ResponsesRequest,
    rid: str,
    created: int,
    model: str,
    blocks: list[Block],
    finish_reason: str | None,
    usage: Usage | None,
    status: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response; status "in_progress" (a stream's first events) or "failed" when given,
    else completed or incomplete by the finish reason."""
    incomplete = finish_reason == "length"
    status = status or ("incomplete" if incomplete else "completed")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": [output_item(rid, b, _item_status(b, blocks, finish_reason)) for b in blocks],
        "usage": usage_body(usage) if usage is not None else None,
        **req.echo,
    }


class ResponseEvents:
    """One streamed response's events; on_done(blocks) runs once it completed (to store it)."""

    def __init__(
        self,
        req: ResponsesRequest,
        rid: str,
        created: int,
        model: str,
        on_done: Callable[[list[Block]], None],
    ):
        self.req, self.rid, self.created, self.model = req, rid, created, model
        self.on_done = on_done
        self._seq = 0

    async def events(self, outs: AsyncIterator[Choice]) -> AsyncIterator[bytes]:
        start = response_object(self.req, self.rid, self.created, self.model, [], None, None)
        yield self._event("response.created", response={**start, "status": "in_progress"})
        yield self._event("response.in_progress", response={**start, "status": "in_progress"})
        stream = BlockStream(self.req.parsed.tools, self.req.parsed.reasoning)
        last: RequestOutput | None = None
        finish_reason = None
        async for _, r in outs:
            if r.error is not None:
                for chunk in self._failed(stream.blocks, r):
                    yield chunk
                return
            events = stream.feed(r.text)
            if r.finished:
                rest, finish_reason = stream.finish(r.finish_reason)
                events += rest
            for e in events:
                for chunk in self._block_events(e, stream.blocks, finish_reason):
                    yield chunk
            last = r
        assert last is not None and last.finished
        done = response_object(
            self.req,
            self.rid,
            self.created,
            self.model,
            stream.blocks,
            finish_reason,
            Usage.of([last]),
        )
        self.on_done(stream.blocks)
        yield self._event(f"response.{done['status']}", response=done)

    def _failed(self, blocks: list[Block], r: RequestOutput) -> list[bytes]:
        error = {"code": "server_error", "message": r.error}
        failed = response_object(
            self.req, self.rid, self.created, self.model, blocks, None, None, "failed", error
        )
        return [
            self._event("error", code="server_error", message=r.error, param=r.param),
            self._event("response.failed", response=failed),
        ]

    def _block_events(
        self, e: BlockEvent, blocks: list[Block], finish_reason: str | None
    ) -> list[bytes]:
        block = e.block
        where = {"item_id": item_id(self.rid, block), "output_index": block.index}
        if block.kind != CALL:  # a message's or reasoning item's one content part
            where["content_index"] = 0
        extra = {"logprobs": []} if block.kind == TEXT else {}
        if isinstance(e, Opened):
            return self._opened(block, where)
        if isinstance(e, Grew):
            return [self._event(f"{_DELTA[block.kind]}.delta", **where, delta=e.text, **extra)]
        item = output_item(self.rid, block, _item_status(block, blocks, finish_reason))
        if block.kind == CALL:
            done = {"name": block.name, "arguments": block.text}
            out = [self._event(f"{_DELTA[CALL]}.done", **where, **done)]
        else:
            part = item["content"][0]
            out = [
                self._event(f"{_DELTA[block.kind]}.done", **where, text=block.text, **extra),
                self._event("response.content_part.done", **where, part=part),
            ]
        out.append(self._event("response.output_item.done", output_index=block.index, item=item))
        return out

    def _opened(self, block: Block, where: dict[str, Any]) -> list[bytes]:
        item = output_item(self.rid, block, "in_progress")
        if block.kind == CALL:
            return [self._event("response.output_item.added", output_index=block.index, item=item)]
        item["content"] = []  # its part arrives in content_part.added
        part = _text_part("") if block.kind == TEXT else {"type": "reasoning_text", "text": ""}
        return [
            self._event("response.output_item.added", output_index=block.index, item=item),
            self._event("response.content_part.added", **where, part=part),
        ]

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()
