"""Tool-call parsers, one per model family's output format (`--tool-call-parser`), and the
default chosen from the chat template when the flag is not given."""

from __future__ import annotations

from collections.abc import Callable

from relay.api.tool_parsers.events import CallArgs, CallName, Event, ToolParser
from relay.api.tool_parsers.hermes import HermesParser
from relay.api.tool_parsers.llama3 import Llama3Parser
from relay.api.tool_parsers.mistral import MistralParser
from relay.api.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
DEFAULT = "hermes"
# Formats whose marker is a special token the detokenizer would otherwise drop.
NEEDS_SPECIAL_TOKENS = frozenset({"mistral"})

# What a chat template says about the format it teaches the model, most specific first.
_TEMPLATE_MARKERS = (
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("[func_name1(", "pythonic"),  # Llama 3.2 / Llama 4's pythonic instructions
    ("<|python_tag|>", "llama3"),
    ('"parameters": dictionary of argument name and its value', "llama3"),
)


def parser_for_template(template: str | None) -> str:
    """The format a chat template asks tool calls in; hermes where it does not say."""
    for marker, name in _TEMPLATE_MARKERS:
        if template and marker in template:
            return name
    return DEFAULT


def make_parser(name: str) -> ToolParser:
    return PARSERS[name]()


__all__ = [
    "PARSERS",
    "DEFAULT",
    "NEEDS_SPECIAL_TOKENS",
    "CallArgs",
    "CallName",
    "Event",
    "ToolParser",
    "parser_for_template",
    "make_parser",
]
