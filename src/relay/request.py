"""A request as the scheduler tracks it, and what it reports per step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from relay.radix_cache import RadixNode
from relay.sampling_params import SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    seq: int = 0  # admission order; FCFS tie-break within a priority
    sid: int = -1  # handle the model runner keys sampling state by
    status: str = WAITING
    output_ids: list[int] = field(default_factory=list)
    # KV state: pages[i] holds tokens [i*page_size, (i+1)*page_size) of all_ids.
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # leading tokens whose KV is written
    tree_len: int = 0  # leading tokens whose pages the radix tree owns (locked via last_node)
    last_node: RadixNode | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_sent: bool = False  # the runner has this request's sampling spec
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    queue_time: float | None = None  # seconds from arrival to first scheduling
    first_token_time: float | None = None  # time.monotonic() when the first token came out
    num_retractions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """all_ids[lo:hi] without building all_ids."""
        p = len(self.prompt_ids)
        if hi <= p:
            return self.prompt_ids[lo:hi]
        if lo >= p:
            return self.output_ids[lo - p:hi - p]
        return self.prompt_ids[lo:] + self.output_ids[:hi - p]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV (a prompt, or a recompute after retraction)."""
        return self.seq_len - self.kv_len > 1


@dataclass
class TokenEvent:
    """One request's progress in one step, as the scheduler reports it."""
    rid: str
    token_id: int | None  # None: the request ended without a new token (abort, error)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    logprob: float | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    error: str | None = None
