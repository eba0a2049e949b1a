"""Reading the reasoning and tool-call parsers' output as a client does, whole and streamed split
at every point: what test_chat_parsers and test_tool_parsers_agents share."""

from __future__ import annotations

import random

from relay.api.chat_output import ChatOutput
from relay.api.reasoning import Reasoning
from relay.api.tool_calls import ToolCalling
from relay.api.tool_output import assemble

MODEL = "m"
PARIS = '{"city": "Paris"}'


def splits(text: str):
    """The text whole, split at every point in two, one character at a time, and at random."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(10):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
        )
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def read(tools: ToolCalling | None, reasoning: str | None, deltas: list[str], finish: str = "stop"):
    """(reasoning, content, [(name, arguments)], finish_reason) of a streamed choice."""
    out, pieces = ChatOutput(tools, reasoning), []
    for d in deltas:
        pieces += out.feed(d)
    rest, reason = out.finish(finish)
    pieces += rest
    content, calls = assemble([p for p in pieces if not isinstance(p, Reasoning)])
    thought = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return thought or None, content or None, [(c.name, c.arguments) for c in calls], reason
