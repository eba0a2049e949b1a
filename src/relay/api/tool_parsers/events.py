"""What a tool-call parser yields as it reads a model's output: content text, the start of a
call (its name), and pieces of the current call's arguments (JSON text, concatenated in order).

A parser is fed the output in pieces and yields events as soon as they are certain; it never
re-reads what it already decided on. Fed the whole text at once it yields the same events
joined differently, so a streamed response reassembles to exactly the whole one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CallName:
    name: str


@dataclass(frozen=True)
class CallArgs:
    text: str  # the next piece of the current call's arguments, JSON text


Event = str | CallName | CallArgs


class ToolParser(Protocol):
    """One choice's output, in one model family's tool-call format."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]:
        """What is held at the end of the output (an unfinished block comes out as text)."""
        ...


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper prefix of tag (text to hold
    back: the tag may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
