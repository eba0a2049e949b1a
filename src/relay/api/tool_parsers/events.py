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


@dataclass(frozen=True)
class Thought:
    text: str  # reasoning text the format carries itself (harmony's analysis channel)


Event = str | CallName | CallArgs | Thought


class ToolParser(Protocol):
    """One choice's output, in one model family's tool-call format."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]:
        """What is held at the end of the output (an unfinished block comes out as text)."""
        ...


def first_of(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(index, tag) of the earliest of tags in text; (-1, "") if none is there."""
    found = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(found, key=lambda f: f[0]) if found else (-1, "")


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """The length of the end of text that may be the start of one of tags."""
    return max(partial_suffix(text, t) for t in tags)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper prefix of tag (text to hold
    back: the tag may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
