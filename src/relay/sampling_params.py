"""Per-request sampling parameters, their ranges, and their validation.

RANGES is the one declaration of each numeric parameter's legal values: validate() checks
them here, and the HTTP parsers (relay.api) check the same table so their errors can name
the API's own field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_NEW_TOKENS = 1_000_000  # above this a budget is a client bug, not a real one
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
# logit_bias: OpenAI's range; -100 bans a token in practice and +100 forces it. The entry
# count is bounded like stop_token_ids: each entry costs an index on every step.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 1024
_I64 = 2**63
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# The kinds whose text is JSON holding JSON schemas: bounded in depth and in breadth.
_SCHEMA_KINDS = ("json_schema", "structural_tag")


# A JSON text's tokens for json_depth: a whole string (so a bracket inside one is not counted)
# or a bracket. A string runs to its closing quote or, unclosed, to the end of the text: the
# match never fails once begun, so no text makes the scan start over at each quote (a string
# that could fail to close made '"' + '\\"' * 65536 take 43 s).
_JSON_NESTING = re.compile(r'"[^"\\]*(?:\\[\s\S]?[^"\\]*)*+(?:"|\Z)|[\[\]{}]')
_OPEN, _CLOSE = frozenset("[{"), frozenset("]}")


def json_depth(text: str) -> int:
    """How deep a JSON text's objects and arrays nest (a schema {"type": "object", "properties":
    {"a": ...}} is two levels per nested object). Grammar compile time grows about as the cube
    of a schema's depth (see EngineConfig.max_constraint_depth). Iterative and linear in the
    text (at most ~20 ms for 128 KiB, all brackets). A text that is not JSON is counted all the
    same (an unclosed string runs to its end); the compiler refuses it at once."""
    depth = deepest = 0
    for token in _JSON_NESTING.findall(text):
        if token in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif token in _CLOSE and depth:
            depth -= 1
    return deepest


def widest_object(text: str) -> tuple[int, str]:
    """The most optional properties (listed under "properties", not under "required") that one
    object of a JSON schema text has, and where (a JSON pointer into the text). Grammar compile
    time grows much faster than linearly in them (see EngineConfig.max_constraint_properties);
    required properties are cheap. Every object of the document counts, not only those at a
    schema's places: a property named "properties" may make its schema's keywords count, a
    handful, never a false refusal of a schema within the limit's order. A text that is not
    JSON, or nests too deep to parse, is (0, ""): the compiler or the depth limit refuses it."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return 0, ""
    # A node's path is a chain (parent's chain, key): O(1) per node; only the widest's is spelled.
    most, widest = 0, None
    stack: list[tuple[Any, Any]] = [(document, None)] if isinstance(document, (dict, list)) else []
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            optional = _optional_properties(node)
            if optional > most:
                most, widest = optional, path
            stack.extend((v, (path, k)) for k, v in node.items() if isinstance(v, (dict, list)))
        else:
            stack.extend((v, (path, i)) for i, v in enumerate(node) if isinstance(v, (dict, list)))
    return most, _json_pointer(widest) if most else ""


def _json_pointer(path: Any) -> str:
    keys = []
    while path is not None:
        path, key = path
        keys.append(str(key).replace("~", "~0").replace("/", "~1"))
    return "/" + "/".join(reversed(keys))


def _optional_properties(schema: dict) -> int:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return 0
    required = schema.get("required")
    required = (
        set(r for r in required if isinstance(r, str)) if isinstance(required, list) else set()
    )
    return sum(name not in required for name in properties)


class InvalidParam(ValueError):
    """A bad request field; `field` names it so the server can say which one."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class Range:
    """The legal values of one numeric parameter."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False  # lo itself is excluded
    what: str | None = None  # a description where the interval alone would mislead

    def holds(self, x: Any) -> bool:
        if isinstance(x, bool) or not isinstance(x, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(x):
            return False
        return (self.lo < x if self.lo_open else self.lo <= x) and x <= self.hi

    def describe(self) -> str:
        if self.what:
            return self.what
        lo = f"({self.lo:g}" if self.lo_open else f"[{self.lo:g}"
        return f"{'an integer' if self.integer else 'a number'} in {lo}, {self.hi:g}]"


RANGES: dict[str, Range] = {
    # 0: no output, only the prompt's log-probabilities (lm-eval's loglikelihood requests)
    "max_new_tokens": Range(0, MAX_NEW_TOKENS, integer=True),
    "min_new_tokens": Range(0, MAX_NEW_TOKENS, integer=True),
    "temperature": Range(0, 100),  # OpenAI's routes narrow it to [0, 2]
    "top_p": Range(0, 1, lo_open=True),
    "top_k": Range(-1, 2**31 - 1, integer=True, what="-1 or 0 (off), or an integer >= 1"),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, 10, lo_open=True),
    "frequency_penalty": Range(-2, 2),
    "presence_penalty": Range(-2, 2),
    "seed": Range(-_I64, _I64 - 1, integer=True, what="a 64-bit integer"),
    "top_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    # -1: none; the prompt's length bounds it too (check_logprob_start, once it is known)
    "logprob_start_len": Range(-1, MAX_NEW_TOKENS, integer=True),
    "prompt_top_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
}


@dataclass
class SamplingParams:
    max_new_tokens: int | None = (
        128  # None: as many as the context leaves (fit_context resolves it)
    )
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # and of the n most likely tokens at each step
    # The prompt's log-probabilities from this position on (RequestOutput.prompt_logprobs);
    # -1: none. Its prefill then computes every position from here on, cached or not.
    logprob_start_len: int = -1
    prompt_top_logprobs: int = 0  # and the n most likely tokens at each prompt position
    # The prompt's pooled final hidden state (RequestOutput.embedding) and no output: a request
    # to an embedding server (EngineConfig.is_embedding), with max_new_tokens 0.
    embed: bool = False
    # Constrained decoding (relay.text.grammar), at most one: the output matches a JSON schema
    # (JSON text; '{"type": "object"}' for any JSON object), a regex, or an EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # An xgrammar structural tag (JSON text): set by the server only, for a forced tool call
    # written in a parser's own format (relay.api.tool_parsers.forced_call_format).
    structural_tag: str | None = None
    # A reasoning model's constraint rules only its answer: the output may first run free through
    # a reasoning block that ends with reasoning_close (e.g. "</think>"). reasoning_open "": the
    # output begins inside the block; otherwise the block is optional and opens with it.
    reasoning_open: str | None = None
    reasoning_close: str | None = None
    # token id -> number added to its logit before sampling (OpenAI's logit_bias); after the
    # penalties, and it cannot lift a token that min_new_tokens or a grammar masks (-inf stays).
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether sampling depends on the tokens output so far (the runner counts them)."""
        return (
            self.repetition_penalty != 1.0
            or bool(self.frequency_penalty)
            or bool(self.presence_penalty)
        )

    def validate(
        self,
        vocab_size: int | None = None,
        max_constraint_bytes: int | None = None,
        max_constraint_depth: int | None = None,
        max_constraint_properties: int | None = None,
    ) -> SamplingParams:
        """Raise InvalidParam naming the first bad field; return self for chaining. A server's
        --max-constraint-bytes caps the constraint's text, --max-constraint-depth a JSON schema's
        nesting (json_depth), --max-constraint-properties the optional properties of each of its
        objects (widest_object); None: no cap."""
        for name, rule in RANGES.items():
            value = getattr(self, name)
            if (value is not None or name not in ("max_new_tokens", "seed")) and not rule.holds(
                value
            ):
                raise InvalidParam(name, f"{name} must be {rule.describe()}, got {value!r}")
        if self.embed and self.max_new_tokens != 0:
            raise InvalidParam(
                "max_new_tokens",
                f"an embedding has no output: max_new_tokens must be 0, got {self.max_new_tokens!r}",
            )
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidParam(
                "min_new_tokens",
                f"min_new_tokens must be <= max_new_tokens, got {self.min_new_tokens!r}",
            )
        if not (
            all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= MAX_STOP_STRINGS
        ):
            raise InvalidParam(
                "stop",
                f"stop must be up to {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}",
            )
        self._validate_constraint(
            max_constraint_bytes, max_constraint_depth, max_constraint_properties
        )
        limit = vocab_size or 2**31
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit
            for t in self.stop_token_ids
        ):
            raise InvalidParam(
                "stop_token_ids",
                f"stop_token_ids must be token ids in the vocabulary, got {self.stop_token_ids!r}",
            )
        self._validate_logit_bias(vocab_size)
        return self

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam(
                "logit_bias",
                f"logit_bias allows at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
            )
        lo, hi = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidParam(
                    "logit_bias",
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r:.40}",
                )
            if vocab_size is not None and token >= vocab_size:
                raise InvalidParam(
                    "logit_bias",
                    f"logit_bias: token id {token} is outside the vocabulary ({vocab_size})",
                )
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not lo <= bias <= hi:
                raise InvalidParam(
                    "logit_bias",
                    f"logit_bias values must be numbers in [{lo:g}, {hi:g}]; token "
                    f"{token} has {bias!r:.40}",
                )

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the output's grammar: kind is one of CONSTRAINT_KINDS; None if free."""
        for kind in CONSTRAINT_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def reasoning_tags(self) -> tuple[str, str] | None:
        """(open, close) of the reasoning block before a constrained answer; None if none."""
        return (
            None
            if self.reasoning_close is None
            else (self.reasoning_open or "", self.reasoning_close)
        )

    def _validate_constraint(
        self, max_bytes: int | None, max_depth: int | None, max_properties: int | None
    ) -> None:
        if self.reasoning_close is not None or self.reasoning_open is not None:
            if not (
                isinstance(self.reasoning_close, str)
                and self.reasoning_close
                and isinstance(self.reasoning_open or "", str)
            ):
                raise InvalidParam(
                    "reasoning_close",
                    "reasoning_close must be a non-empty string (and reasoning_open a string)",
                )
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None]
        for kind in given:
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise InvalidParam(kind, f"{kind} must be a non-empty string, got {text!r:.60}")
            size = len(text.encode("utf-8", "surrogatepass"))
            if max_bytes is not None and size > max_bytes:
                raise InvalidParam(
                    kind,
                    f"{kind} must be at most {max_bytes} bytes (--max-constraint-bytes), "
                    f"got {size}",
                )
            if (
                kind in _SCHEMA_KINDS
                and max_depth is not None
                and (depth := json_depth(text)) > max_depth
            ):
                raise InvalidParam(
                    kind,
                    f"{kind} must nest at most {max_depth} levels deep "
                    f"(--max-constraint-depth), got {depth}",
                )
            # Each property is a key and a ':': a text with no more ':' than the limit needs no parse.
            if (
                kind in _SCHEMA_KINDS
                and max_properties is not None
                and text.count(":") > max_properties
            ):
                widest, where = widest_object(text)
                if widest > max_properties:
                    raise InvalidParam(
                        kind,
                        f"{kind} objects may have at most {max_properties} optional properties "
                        f"each (--max-constraint-properties; required ones are not counted), "
                        f"got {widest} at {where}",
                    )
        if len(given) > 1:
            raise InvalidParam(
                given[1],
                f"give at most one of {', '.join(CONSTRAINT_KINDS)}; got {', '.join(given)}",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise InvalidParam(key, f"unknown sampling parameter {key!r}")
        return cls(**d)


def check_logprob_start(params: SamplingParams, prompt_len: int) -> None:
    """logprob_start_len must name a position of the prompt, known once it is tokenized."""
    if params.logprob_start_len >= prompt_len:
        raise InvalidParam(
            "logprob_start_len",
            f"logprob_start_len must be -1 or a position in the prompt (below its {prompt_len} "
            f"tokens), got {params.logprob_start_len}",
        )


def check_prompt_length(
    num_tokens: int, context_len: int, field_name: str = "prompt", at_least: bool = False
) -> None:
    """The one rule for a prompt's length: it must leave room for one generated token."""
    if num_tokens >= context_len:
        raise InvalidParam(
            field_name,
            f"the prompt has {'at least ' if at_least else ''}{num_tokens} tokens; "
            f"this model's context is {context_len} tokens, output included",
        )
