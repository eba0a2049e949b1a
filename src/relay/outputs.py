"""The one record of a request's progress.

A `RequestOutput` is what one request produced since its previous record. The scheduler
makes it (token ids, finish, counts); the detokenizer fills in the text; the http process
streams or merges it; the offline Engine merges it too. A new field (an accept length, a
tool call) is added here and touches only the process that fills it and the one that reads
it. Records travel in batches: a list of them is one message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a request ended; equal to (and sent as) its OpenAI string."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


TopLogprobs = list  # [[token ids], [logprobs]] of the most likely tokens at one position


@dataclass
class PromptLogprobs:
    """A prompt's log-probabilities from position `start` on, one entry per position: the
    prompt's token there, its log-probability given the tokens before it, its rank among the
    vocabulary (1: the likeliest) and the likeliest tokens there. The first entry (position
    start) has None for all three: nothing before it is scored. The scheduler fills it in over
    the prompt's chunks; the detokenizer adds the texts."""

    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[TopLogprobs | None]
    texts: list[str] | None = None  # each token's own text
    top_texts: list[list[str] | None] | None = None  # the texts of top's tokens

    @classmethod
    def empty(cls, prompt_ids: list[int], start: int) -> PromptLogprobs:
        """Nothing scored yet: only the first position's entry (None)."""
        return cls(start, list(prompt_ids[start:]), [None], [None], [None])

    @property
    def complete(self) -> bool:
        return len(self.logprobs) == len(self.token_ids)


@dataclass
class RequestOutput:
    rid: str
    token_ids: list[int] = field(default_factory=list)  # new tokens
    logprobs: list[float] | None = None  # one per new token, when the request asked
    top_logprobs: list[TopLogprobs | None] | None = None  # one per new token, when asked
    finish_reason: str | None = None  # a FinishReason once it ended
    matched_stop: int | str | None = None  # the stop token id or string that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far, all records included
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds from arrival to first scheduling (on the finish)
    error: str | None = None  # it failed: why
    status: int = 500  # for an error: the HTTP status (4xx when the request itself was at fault)
    param: str | None = None  # for a 4xx error: the request field at fault
    # Filled by the detokenizer:
    text: str = ""  # the new text that may be shown (a stop string's beginning is held back)
    token_texts: list[str] | None = None  # each new token's own text, when logprobs were asked
    top_texts: list[list[str] | None] | None = None  # the texts of top_logprobs' tokens
    # The prompt's log-probabilities, when asked (SamplingParams.logprob_start_len): in the
    # request's first record.
    prompt_logprobs: PromptLogprobs | None = None
    # An embedding request's vector (SamplingParams.embed), float32 little-endian bytes: in its
    # last record.
    embedding: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, later: RequestOutput) -> None:
        """Append a later record of the same request: its tokens, text and logprobs follow
        these, and its finish and counts replace them."""
        self.token_ids = self.token_ids + later.token_ids
        self.text += later.text
        for name in ("logprobs", "top_logprobs", "token_texts", "top_texts"):
            mine, theirs = getattr(self, name), getattr(later, name)
            if theirs is not None:
                setattr(self, name, (mine or []) + theirs)
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.embedding = later.embedding if later.embedding is not None else self.embedding
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        self.cached_tokens = later.cached_tokens
        if later.finished or later.error is not None:
            self.finish_reason, self.matched_stop, self.queue_time = (
                later.finish_reason,
                later.matched_stop,
                later.queue_time,
            )
            self.error, self.status, self.param = later.error, later.status, later.param


def error_output(
    rid: str, message: str, param: str | None = None, status: int = 400
) -> RequestOutput:
    """A request refused or failed with no output: it ends here."""
    return RequestOutput(
        rid, finish_reason=FinishReason.ABORT, error=message, status=status, param=param
    )
