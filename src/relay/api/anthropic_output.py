"""Anthropic's Messages API answer: the message, its streamed events, and its errors.

Content blocks come from the blocks of the output (relay.api.output_blocks): thinking (the
--reasoning-parser's split; its signature is empty: nothing here signs it), text, and
tool_use (input: the call's arguments object). stop_reason: end_turn, max_tokens,
stop_sequence (with the string that matched) or tool_use. usage.input_tokens counts the prompt
tokens not read from the prefix cache; cache_read_input_tokens the rest.

A stream is Anthropic's: message_start, then per block content_block_start, its deltas
(text_delta, thinking_delta, input_json_delta) and content_block_stop, then message_delta
(stop_reason and usage) and message_stop; a failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from relay.api.errors import ProtocolError, anthropic_error_body
from relay.api.output_blocks import (
    REASONING,
    TEXT,
    Block,
    BlockEvent,
    BlockStream,
    Closed,
    Grew,
)
from relay.api.parsed_request import ParsedRequest
from relay.api.serving import Choice, Usage
from relay.outputs import RequestOutput


def error_response(e: ProtocolError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(e.status, e.message), status_code=e.status)


def content_block(block: Block) -> dict[str, Any]:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": block.text}
    return {
        "type": "tool_use",
        "id": block.call_id,
        "name": block.name,
        "input": _input(block.text),
    }


def _input(arguments: str) -> dict[str, Any]:
    # A call read from free output (tool_choice auto) may carry arguments that are not an
    # object; tool_use.input must be one.
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(
    finish_reason: str | None, matched_stop: int | str | None
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched_stop, str):
        return "stop_sequence", matched_stop
    return "end_turn", None


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def message(
    rid: str,
    model: str,
    blocks: list[Block],
    finish_reason: str | None,
    matched_stop: int | str | None,
    usage: Usage,
) -> dict[str, Any]:
    reason, sequence = stop_reason(finish_reason, matched_stop)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [content_block(b) for b in blocks],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(usage),
    }


async def message_events(
    outs: AsyncIterator[Choice], parsed: ParsedRequest, rid: str, model: str
) -> AsyncIterator[bytes]:
    stream = BlockStream(parsed.tools, parsed.reasoning)
    started = False
    async for _, r in outs:
        if r.error is not None:
            yield _event("error", error=anthropic_error_body(r.status, r.error)["error"])
            return
        if not started:  # the first record knows the prompt's size
            start = {**message(rid, model, [], None, None, Usage.of([r])), "content": []}
            start.update(stop_reason=None, stop_sequence=None)
            start["usage"]["output_tokens"] = 0
            yield _event("message_start", message=start)
            started = True
        events = stream.feed(r.text)
        finish_reason = None
        if r.finished:
            rest, finish_reason = stream.finish(r.finish_reason)
            events += rest
        for e in events:
            yield _block_event(e)
        if r.finished:
            yield _final(r, finish_reason)
    yield _event("message_stop")


def _final(r: RequestOutput, finish_reason: str | None) -> bytes:
    reason, sequence = stop_reason(finish_reason, r.matched_stop)
    return _event(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": sequence},
        usage=usage_body(Usage.of([r])),
    )


def _block_event(e: BlockEvent) -> bytes:
    block = e.block
    if isinstance(e, Grew):
        if block.kind == TEXT:
            delta = {"type": "text_delta", "text": e.text}
        elif block.kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": e.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": e.text}
        return _event("content_block_delta", index=block.index, delta=delta)
    if isinstance(e, Closed):
        return _event("content_block_stop", index=block.index)
    # Opened: the block as it starts, empty (a call's input arrives as input_json_delta).
    empty = Block(block.index, block.kind, call_id=block.call_id, name=block.name)
    return _event("content_block_start", index=block.index, content_block=content_block(empty))


def _event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()
