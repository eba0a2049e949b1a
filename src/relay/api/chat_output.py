"""One chat choice's output as the client sees it: reasoning split off (--reasoning-parser),
then tool calls read from what is left (the request's tools), the rest being the content.
The same stream serves whole and streamed responses, so both say the same thing."""

from __future__ import annotations

from typing import Any

from relay.api.reasoning import REASONING_PARSERS, Reasoning, ReasoningSplitter
from relay.api.tool_calls import ToolCalling
from relay.api.tool_output import ArgsPiece, CallStart, OutputStream, Piece, assemble
from relay.api.tool_parsers import HARMONY

ChatPiece = Piece


class ChatOutput:
    """reasoning "harmony": the output is in gpt-oss's channels, which the harmony tool parser
    splits into reasoning, content and calls in one pass (with or without tools)."""

    def __init__(self, tools: ToolCalling | None, reasoning: str | None):
        harmony = reasoning == HARMONY
        self._splitter = (
            ReasoningSplitter(REASONING_PARSERS[reasoning]) if reasoning and not harmony else None
        )
        self._tools = OutputStream(tools) if tools is not None or harmony else None

    def feed(self, text: str) -> list[ChatPiece]:
        parts = self._splitter.feed(text) if self._splitter else [text]
        return self._through_tools(parts)

    def finish(self, finish_reason: str | None) -> tuple[list[ChatPiece], str | None]:
        pieces = self._through_tools(self._splitter.finish()) if self._splitter else []
        if self._tools is not None:
            rest, finish_reason = self._tools.finish(finish_reason)
            pieces += rest
        return pieces, finish_reason

    def _through_tools(self, parts: list[Reasoning | str]) -> list[ChatPiece]:
        if self._tools is None:
            return [p for p in parts if p]
        out: list[ChatPiece] = []
        for p in parts:
            out += [p] if isinstance(p, Reasoning) else self._tools.feed(p)
        return out


def whole_message(
    tools: ToolCalling | None, reasoning: str | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message, and its finish reason ("tool_calls" once it called tools)."""
    out = ChatOutput(tools, reasoning)
    pieces = out.feed(text)
    rest, finish_reason = out.finish(finish_reason)
    pieces += rest
    content, calls = assemble([p for p in pieces if not isinstance(p, Reasoning)])
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = (
            "".join(p.text for p in pieces if isinstance(p, Reasoning)) or None
        )
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    return message, finish_reason


def piece_delta(piece: ChatPiece) -> dict[str, Any]:
    """A streamed piece as a chat.completion.chunk delta."""
    if isinstance(piece, str):
        return {"content": piece}
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    if isinstance(piece, CallStart):
        return {
            "tool_calls": [
                {
                    "index": piece.index,
                    "id": piece.id,
                    "type": "function",
                    "function": {"name": piece.name, "arguments": ""},
                }
            ]
        }
    assert isinstance(piece, ArgsPiece)
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
