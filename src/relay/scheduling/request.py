"""A request as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from relay.memory.radix_cache import RadixNode
from relay.outputs import PromptLogprobs
from relay.sampling_params import SamplingParams
from relay.step import PENDING_TOKEN

if TYPE_CHECKING:
    from relay.scheduling.pooling import PoolState
    from relay.scheduling.speculative.ngram import NgramIndex
    from relay.text.grammar import Constraint


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    seq: int = 0  # admission order; FCFS tie-break within a priority
    sid: int = -1  # handle the model runner keys this request's state by
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    # KV state: pages[i] holds tokens [i*page_size, (i+1)*page_size) of prompt + output.
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # leading tokens whose KV is written (or being written: see inflight_steps)
    tree_len: int = 0  # leading tokens whose pages the radix tree owns (locked via last_node)
    # Leading pages given back because a sliding window left them behind (no future query reads
    # them): their entries are FREED_PAGE, and the request holds nothing through the tree then.
    dropped_pages: int = 0
    last_node: RadixNode | None = None
    pages_synced: int = 0  # leading pages the runner's copy of the page table has right
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_sent: bool = False  # the runner has this request's sampling spec
    long_rope: bool = False  # its KV rotates with LongRoPE's long factors (LongRopeBoundary)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    error_param: str | None = (
        None  # the request field an error blames (a 4xx); None: the server's (a 500)
    )
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    # The prompt's log-probabilities, collected over its prefill chunks when asked
    # (relay.scheduling.prompt_logprobs); the first record carries them.
    prompt_logprobs: PromptLogprobs | None = None
    # An embedding request's pooled hidden states, collected over its prefill chunks
    # (relay.scheduling.pooling); its last record carries the embedding.
    pooled: PoolState | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduling
    first_token_time: float | None = None  # time.monotonic() when the first token came out
    last_token_time: float | None = None  # when the scheduler last appended tokens (ITL)
    num_retractions: int = 0
    # Prefill-first (PrefillFirst.decodes_to_hold): when this request began yielding its decode
    # to a backlog of prompts, and whether it has had its one such wait.
    held_since: float | None = None
    has_yielded: bool = False
    # Speculative decoding: leading tokens whose draft-model KV is written (a draft model's
    # KV pages are the target's page ids in its own pool), and the n-gram index of the tokens.
    draft_len: int = 0
    ngram: NgramIndex | None = None
    spec_proposed: int = 0  # proposals verified and accepted over the request's life
    spec_accepted: int = 0
    constraint: Constraint | None = None  # the output's grammar (SamplingParams.constraint)
    # Overlap scheduling: steps sent and not yet processed may carry the request. kv_len
    # counts the tokens they write (`unwritten` of them), seq_len the tokens they sample
    # (`pending`, not yet in output_ids); `chainable`: its next step may be built before a
    # pending token is seen (a plain sample: not speculative, not grammar-constrained).
    inflight_steps: int = 0
    unwritten: int = 0
    pending: int = 0
    chainable: bool = False

    def __post_init__(self) -> None:
        start = self.params.logprob_start_len
        if start >= 0 and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs.empty(self.prompt_ids, start)

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """(prompt + output)[lo:hi] without building the concatenation."""
        p = len(self.prompt_ids)
        if hi <= p:
            return self.prompt_ids[lo:hi]
        if lo >= p:
            return self.output_ids[lo - p : hi - p]
        return self.prompt_ids[lo:] + self.output_ids[: hi - p]

    def set_pages(self, start: int, pages: list[int]) -> None:
        """Replace pages[start:] (the whole table when start is 0)."""
        del self.pages[start:]
        self.pages.extend(pages)
        self.pages_synced = min(self.pages_synced, start)

    def page_update(self, num_pages: int) -> tuple[int, list[int]]:
        """What the runner lacks of the first num_pages pages: (first index, pages from it).
        The runner then has them all."""
        start = min(self.pages_synced, num_pages)
        self.pages_synced = num_pages
        return start, self.pages[start:num_pages]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def written_len(self) -> int:
        """Leading tokens whose KV a processed step wrote (what the prefix cache may share)."""
        return self.kv_len - self.unwritten

    def input_slice(self, lo: int, hi: int) -> list[int]:
        """token_slice, with PENDING_TOKEN for positions whose token is still pending."""
        ids = self.token_slice(lo, hi)
        return ids + [PENDING_TOKEN] * (hi - lo - len(ids))

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def grammar_compiling(self) -> bool:
        """Its output grammar is still compiling: it cannot start yet."""
        return self.constraint is not None and self.constraint.matcher is None

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV (a prompt, or a recompute after retraction)."""
        return self.seq_len - self.kv_len > 1
