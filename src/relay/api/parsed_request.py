"""The ParsedRequest every API parser produces, and the limits on what one may hold.

Conventions shared by all parsers:
- A field that is absent or JSON null takes its default; many OpenAI clients send explicit
  nulls for "not set", and treating them as errors would break those clients.
- Types are strict: a bool is not an int, a numeric string is not a number
  (relay.api.typed_fields).
- Unknown top-level fields are ignored (OpenAI SDKs pass vendor extras through), except
  inside SGLang's `sampling_params`, where a typo would otherwise be silently ignored.
- A refused request is a relay.api.errors.ProtocolError naming the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from relay.sampling_params import SamplingParams

if TYPE_CHECKING:
    from relay.api.tool_calls import ToolCalling

MAX_N = 16  # choices per request
MAX_INPUTS = 2048  # embeddings: inputs per request (OpenAI's limit)
# prompts in one completion request; each is a request in flight (--max-queued-requests)
MAX_PROMPTS = 256


class Prompt(NamedTuple):
    text: str | None
    input_ids: list[int] | None


@dataclass
class ParsedRequest:
    """One validated API request, ready to become an ipc GenerateReq."""

    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    rid: str | None = None  # /generate's client-chosen id; a batched completion's id per prompt
    # SamplingParams field -> the API field it came from, for errors found past the http
    # process (a grammar that does not parse is found by the tokenizer).
    param_names: dict[str, str] = field(default_factory=dict)
    tools: ToolCalling | None = None  # chat: the tools the model may call, and how
    reasoning: str | None = None  # chat: the --reasoning-parser that splits reasoning_content off
    echo: bool = False  # completions: the prompt comes first in the answer
    prompt_logprobs: int | None = None  # completions (vLLM's): the prompt's logprobs, top N
    inputs: list[str | list[int]] | None = None  # embeddings: one text or token ids per choice
    # completions: a list of several prompts, each its own request (relay.api.batched_prompts);
    # text and input_ids are the first's
    prompts: list[Prompt] | None = None
