"""Tool-call parsers, one per model family's output format (`--tool-call-parser`), the default
chosen from the chat template when the flag is not given, and, for the formats that have one,
the structural tag a forced call (tool_choice "required" or a named function) is written in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.api.tool_parsers import deepseek, harmony, qwen3_coder
from relay.api.tool_parsers.deepseek import DeepSeekParser
from relay.api.tool_parsers.events import CallArgs, CallName, Event, Thought, ToolParser
from relay.api.tool_parsers.harmony import HarmonyParser
from relay.api.tool_parsers.hermes import HermesParser
from relay.api.tool_parsers.llama3 import Llama3Parser
from relay.api.tool_parsers.mistral import MistralParser
from relay.api.tool_parsers.pythonic import PythonicParser
from relay.api.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, Callable[..., ToolParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
    "deepseek_v3": DeepSeekParser,
    "deepseek_v31": DeepSeekParser,
    "harmony": HarmonyParser,
}
DEFAULT = "hermes"
HARMONY = "harmony"
# Formats whose marker is a special token the detokenizer would otherwise drop.
NEEDS_SPECIAL_TOKENS = frozenset({"mistral", "deepseek_v3", "deepseek_v31", HARMONY})
# Formats whose parser converts arguments by the tools' schemas (given name -> schema).
_TYPED_ARGUMENTS = frozenset({"qwen3_coder"})
# A forced call in the format's own syntax: (tools as (name, parameters schema), the named
# function or None for "required", parallel_tool_calls) -> an xgrammar structural-tag format.
# Formats not listed are forced to the JSON shape of relay.api.tool_calls.ToolCalling.schema.
FORCED_CALL_FORMATS: dict[str, Callable[[list[tuple[str, Any]], str | None, bool], dict]] = {
    "qwen3_coder": qwen3_coder.forced_call_format,
    "deepseek_v3": deepseek.forced_call_format,
    "deepseek_v31": deepseek.forced_call_format_v31,
    HARMONY: harmony.forced_call_format,
}

# What a chat template says about the format it teaches the model, most specific first.
_TEMPLATE_MARKERS = (
    ("<|channel|>", HARMONY),  # gpt-oss
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),  # deepseek_v31 where no ```json fence is taught
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),  # Qwen3-Coder teaches <tool_call> too: before hermes
    ("<parameter=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("[func_name1(", "pythonic"),  # Llama 3.2 / Llama 4's pythonic instructions
    ("<|python_tag|>", "llama3"),
    ('"parameters": dictionary of argument name and its value', "llama3"),
)


# Architectures that write one format whatever template a directory ships or --chat-template
# names: gpt-oss was trained on harmony alone (its channels carry the reasoning too).
_ARCHITECTURE_FORMATS = {"GptOssForCausalLM": HARMONY}


def parser_for_template(template: str | None, architecture: str | None = None) -> str:
    """The format the model writes tool calls in: its architecture's own where it has one, else
    what its chat template asks for; hermes where neither says."""
    if architecture in _ARCHITECTURE_FORMATS:
        return _ARCHITECTURE_FORMATS[architecture]
    for marker, name in _TEMPLATE_MARKERS:
        if template and marker in template:
            if name == "deepseek_v3" and "```json" not in template:
                return "deepseek_v31"
            return name
    return DEFAULT


def make_parser(name: str, schemas: dict[str, Any] | None = None) -> ToolParser:
    """A parser of the format; schemas: the request's tools' parameters by name."""
    return PARSERS[name](schemas) if name in _TYPED_ARGUMENTS else PARSERS[name]()


__all__ = [
    "PARSERS",
    "DEFAULT",
    "HARMONY",
    "NEEDS_SPECIAL_TOKENS",
    "FORCED_CALL_FORMATS",
    "CallArgs",
    "CallName",
    "Event",
    "Thought",
    "ToolParser",
    "parser_for_template",
    "make_parser",
]
