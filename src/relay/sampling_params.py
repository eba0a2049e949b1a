"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
# max_new_tokens meaning "as many as the context allows" (OpenAI chat without max_tokens);
# the tokenizer replaces it with the room the prompt leaves.
UNTIL_CONTEXT = 2**31 - 1


class InvalidParam(ValueError):
    """A bad request field; `field` names it so the server can say which one."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidParam naming the first bad field; return self for chaining."""
        checks: list[tuple[str, bool, str]] = [
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "must be an integer >= 1"),
            ("min_new_tokens", _is_int(self.min_new_tokens) and 0 <= self.min_new_tokens, "must be an integer >= 0"),
            ("min_new_tokens", not _is_int(self.min_new_tokens) or not _is_int(self.max_new_tokens)
             or self.min_new_tokens <= self.max_new_tokens, "must be <= max_new_tokens"),
            ("temperature", _is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", _is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "must be -1 (off) or >= 1"),
            ("min_p", _is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", _is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
             "must be in (0, 10]"),
            ("frequency_penalty", _is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "must be in [-2, 2]"),
            ("presence_penalty", _is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "must be in [-2, 2]"),
            ("seed", self.seed is None or _is_int(self.seed), "must be an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16,
             "must be up to 16 non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size)
                                   for t in self.stop_token_ids), "must be token ids in the vocabulary"),
            ("top_logprobs", _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"must be in [0, {MAX_TOP_LOGPROBS}]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParam(name, f"{name} {why}, got {getattr(self, name)!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise InvalidParam(key, f"unknown sampling parameter {key!r}")
        return cls(**d)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
