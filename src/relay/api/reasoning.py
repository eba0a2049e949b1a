"""Reasoning parsers (`--reasoning-parser`): a reasoning model's thinking, `<think>...</think>`,
split off its output into `reasoning_content` (as vLLM and SGLang return it), so `content` holds
only the answer (and tool calls are read from the answer alone).

- qwen3: the model opens the block itself: an output that begins (after whitespace) with
  <think> is reasoning up to </think>; one that does not (Qwen3 with enable_thinking false,
  whose template closes an empty block in the prompt) is all content.
- deepseek-r1: the template opens <think> in the prompt, so the output begins inside the
  reasoning (an opening <think> the model repeats is dropped): everything up to </think> is
  reasoning. An output with no </think> (cut short) is all reasoning. Qwen3-Thinking-2507 and
  Qwen3.5 templates, which also open the block in the prompt, read the same way.

Only the first block is reasoning; text after </think> is content whatever it holds. The
split streams: each piece of output is read once, holding back only text that may be part of
a tag; reasoning is stripped of surrounding whitespace, and so is the start of the content
after </think>. Fed the whole text at once, the split is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.api.text_trim import Trim
from relay.api.tool_parsers.events import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the template opened the block: the output begins in the reasoning
    open: str = OPEN
    close: str = CLOSE

    def grammar_tags(self) -> tuple[str, str]:
        """(open, close) for the grammar that lets reasoning run before a constrained answer
        (SamplingParams.reasoning_open / reasoning_close): open "" when the output begins
        inside the block."""
        return ("" if self.starts_inside else self.open), self.close


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_inside=True),
}


@dataclass(frozen=True)
class Reasoning:
    """A piece of reasoning text (content pieces are plain str)."""

    text: str


class ReasoningSplitter:
    """One choice's output fed as it streams, split into Reasoning and content (str) pieces."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self._state = "start"  # start | reasoning | content
        self._held = ""
        self._reasoning = Trim()
        self._content_started = False  # content after </think>: its leading whitespace is dropped

    def feed(self, text: str) -> list[Reasoning | str]:
        out: list[Reasoning | str] = []
        while text:
            text = getattr(self, f"_on_{self._state}")(text, out)
        return out

    def _on_start(self, text: str, out: list[Reasoning | str]) -> str:
        """Until the output shows whether it opens with the open tag."""
        self._held += text
        head = self._held.lstrip()
        if head.startswith(self.fmt.open):
            self._held, self._state = "", "reasoning"
            return head[len(self.fmt.open) :]
        if self.fmt.open.startswith(head):
            return ""  # whitespace so far, or the tag arriving
        held, self._held = self._held, ""
        if self.fmt.starts_inside:
            self._state = "reasoning"
        else:
            self._state, self._content_started = "content", True
        return held

    def _on_reasoning(self, text: str, out: list[Reasoning | str]) -> str:
        self._held += text
        end = self._held.find(self.fmt.close)
        if end < 0:
            cut = len(self._held) - partial_suffix(self._held, self.fmt.close)
            self._reason(self._held[:cut], out)
            self._held = self._held[cut:]
            return ""
        self._reason(self._held[:end], out)
        rest, self._held, self._state = self._held[end + len(self.fmt.close) :], "", "content"
        return rest

    def _reason(self, text: str, out: list[Reasoning | str]) -> None:
        if text := self._reasoning.push(text):
            out.append(Reasoning(text))

    def _on_content(self, text: str, out: list[Reasoning | str]) -> str:
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        if text:
            out.append(text)
        return ""

    def finish(self) -> list[Reasoning | str]:
        """What is held at the end: a partial tag is text of whichever part it was in."""
        out: list[Reasoning | str] = []
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "start" and self.fmt.starts_inside):
            self._reason(held, out)
        elif held:
            out.append(held)
        return out
