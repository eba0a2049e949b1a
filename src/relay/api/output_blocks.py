"""A chat choice's output (relay.api.chat_output) as a sequence of blocks: reasoning, answer
text and tool calls, each opened, grown and closed in order. The Responses API (output items)
and Anthropic's Messages API (content blocks) both answer in this shape; they differ only in
how they name the events, so both render these.

A whole response is the stream fed its whole text at once, so a streamed response reassembles
to exactly the blocks of the whole one (as chat completions do).
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.api.chat_output import ChatOutput, ChatPiece
from relay.api.reasoning import Reasoning
from relay.api.tool_calls import ToolCalling
from relay.api.tool_output import ArgsPiece, CallStart

REASONING, TEXT, CALL = "reasoning", "text", "call"


@dataclass
class Block:
    index: int  # its position among the response's blocks
    kind: str  # REASONING | TEXT | CALL
    text: str = ""  # the reasoning or answer text, or the call's arguments (JSON text)
    call_id: str = ""  # CALL: its id
    name: str = ""  # CALL: the function's name


@dataclass(frozen=True)
class Opened:
    block: Block


@dataclass(frozen=True)
class Grew:
    block: Block
    text: str  # what was appended to block.text


@dataclass(frozen=True)
class Closed:
    block: Block


BlockEvent = Opened | Grew | Closed


class BlockStream:
    """One choice's output fed as it streams, as block events."""

    def __init__(self, tools: ToolCalling | None, reasoning: str | None):
        self._output = ChatOutput(tools, reasoning)
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, text: str) -> list[BlockEvent]:
        return self._events(self._output.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[BlockEvent], str | None]:
        """The last events (the open block closes), and the finish reason: "tool_calls" once
        the output called a tool (relay.api.tool_output)."""
        pieces, finish_reason = self._output.finish(finish_reason)
        events = self._events(pieces)
        if self._open is not None:
            events.append(Closed(self._open))
            self._open = None
        return events, finish_reason

    def _events(self, pieces: list[ChatPiece]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for piece in pieces:
            if isinstance(piece, ArgsPiece):  # always the open call's: calls stream one by one
                events.append(self._grow(piece.text))
                continue
            kind = REASONING if isinstance(piece, Reasoning) else TEXT
            if isinstance(piece, CallStart) or self._open is None or self._open.kind != kind:
                events += self._start(piece)
            if not isinstance(piece, CallStart):
                events.append(self._grow(piece if isinstance(piece, str) else piece.text))
        return events

    def _start(self, piece: ChatPiece) -> list[BlockEvent]:
        events: list[BlockEvent] = [Closed(self._open)] if self._open is not None else []
        index = len(self.blocks)
        if isinstance(piece, CallStart):
            block = Block(index, CALL, call_id=piece.id, name=piece.name)
        else:
            block = Block(index, REASONING if isinstance(piece, Reasoning) else TEXT)
        self.blocks.append(block)
        self._open = block
        return [*events, Opened(block)]

    def _grow(self, text: str) -> Grew:
        assert self._open is not None
        self._open.text += text
        return Grew(self._open, text)


def whole_blocks(
    tools: ToolCalling | None, reasoning: str | None, text: str, finish_reason: str | None
) -> tuple[list[Block], str | None]:
    """A whole choice's blocks and finish reason."""
    stream = BlockStream(tools, reasoning)
    stream.feed(text)
    _, finish_reason = stream.finish(finish_reason)
    return stream.blocks, finish_reason


def assistant_message(blocks: list[Block]) -> dict[str, object]:
    """The blocks as the chat-template assistant turn that a later request continues from
    (reasoning is left out: templates drop earlier turns' reasoning)."""
    message: dict[str, object] = {
        "role": "assistant",
        "content": "".join(b.text for b in blocks if b.kind == TEXT),
    }
    calls = [
        {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
        for b in blocks
        if b.kind == CALL
    ]
    if calls:
        message["tool_calls"] = calls
    return message
