"""Every message that crosses a process boundary. Plain dataclasses; `ipc.codec` packs them.

Flow: http -> tokenizer -> scheduler -> model runners (per step) -> scheduler -> detokenizer
-> http. Errors and control replies go straight back to http.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relay.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """http -> tokenizer: one API request; `rids` holds one id per choice (OpenAI `n`)."""
    rids: list[str]
    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the tokenizer's template
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    arrival_time: float = 0.0  # time.time() at the http server


@dataclass
class TokenizedReq:
    """tokenizer -> scheduler."""
    rid: str
    input_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0


@dataclass
class AbortReq:
    """http or detokenizer -> scheduler: end a request (client gone, or a stop string hit)."""
    rid: str
    reason: str = "abort"
    matched_stop: str | None = None
    sent_at: float = 0.0  # time.time() at the sender: an abort never drops a later request of the same id


@dataclass
class DetokInit:
    """What the detokenizer needs to know about a request, sent with its first output."""
    rid: str
    prompt_tail: list[int]
    skip_special_tokens: bool
    stop: list[str]
    include_stop_str_in_output: bool


@dataclass
class BatchTokenOut:
    """scheduler -> detokenizer: one step's new tokens and finished requests (parallel lists)."""
    rids: list[str]
    token_ids: list[int]  # -1: no new token (a request ended without one)
    finish_reasons: list[str | None]
    matched_stops: list[Any]
    logprobs: list[float | None]
    top_logprobs: list[Any]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    errors: list[str | None]
    inits: list[DetokInit] = field(default_factory=list)
    queue_times: list[float | None] = field(default_factory=list)


@dataclass
class BatchStrOut:
    """detokenizer -> http: text deltas per request (parallel lists)."""
    rids: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    matched_stops: list[Any]
    # Per request, None unless it asked for logprobs: one entry per new token,
    # [token_id, token_text, logprob, top] with top None or a list of [token_id, token_text, logprob].
    logprobs: list[list[list[Any]] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    errors: list[str | None]
    queue_times: list[float | None] = field(default_factory=list)


@dataclass
class ErrorOut:
    """tokenizer or scheduler -> http: a request rejected before it ran."""
    rid: str
    message: str
    param: str | None = None
    status: int = 400


@dataclass
class ControlReq:
    """http -> scheduler: `get_info` | `flush_cache`, answered by a ControlOut with the same id."""
    req_id: int
    kind: str


@dataclass
class ControlOut:
    req_id: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ready:
    """child -> launcher: started and ready (with what the launcher needs to know), or failed."""
    name: str
    ok: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Heartbeat:
    """http -> tokenizer -> scheduler -> detokenizer -> http: every loop on the path is turning.
    The scheduler stamps step_age, how long its current model step has been running (0: none)."""
    seq: int
    step_age: float = 0.0
