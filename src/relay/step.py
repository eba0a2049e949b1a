"""The scheduler <-> model runner contract: a step's description in, sampled tokens out.

These are the only objects that pass between the scheduling policy and the model runner,
in one process (offline `Engine`) or across processes (the server, one runner per TP rank).
A request's state reaches the runner once and then as changes: its sampling spec when it
first runs, its page table as (first changed index, pages from there), its handle in
released_sids when it ends. They hold plain ints, floats and lists for the msgpack codec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from relay.sampling_params import SamplingParams

# An input id the scheduler does not know yet (overlap scheduling): the token the runner
# sampled for the same request in the step before. Only a decode row's one input is such.
PENDING_TOKEN = -1


@dataclass
class SamplingSpec:
    """What the runner needs to sample for one request; sent once, when it first runs."""

    sid: int
    params: SamplingParams
    stop_token_ids: list[int]  # eos ids and the user's, masked until min_new_tokens
    prompt_ids: list[int] = field(default_factory=list)  # only sent for repetition_penalty
    # Sent again after a retraction, with the output so far for the penalties' counts: the
    # runner's counts then match the output the request restarts from, not the tokens its
    # steps sampled (one the scheduler dropped, in flight when it was retracted, included).
    output_ids: list[int] = field(default_factory=list)


@dataclass
class PromptLogprobSpan:
    """Prompt positions of one row whose log-softmax the step returns (the prompt's
    log-probabilities): its tokens first .. first + len(targets) - 1, counted within the row's
    new tokens, each scored at the prompt token after it (targets), with the top_n likeliest."""

    row: int
    first: int
    targets: list[int]
    top_n: int


@dataclass
class PromptLogprobChunk:
    """What a step scored of one PromptLogprobSpan: per position the target's log-probability
    and rank (1: the likeliest), and the top_n likeliest tokens' ids and log-probabilities."""

    row: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class EmbedSpan:
    """Prompt positions of one row whose final hidden states an embedding pools: its tokens
    first .. first + count - 1, counted within the row's new tokens (relay.scheduling.pooling)."""

    row: int
    first: int
    count: int


@dataclass
class EmbedChunk:
    """What a step returns of one EmbedSpan: the sum of its positions' final hidden states
    (after the final norm), float32 little-endian bytes; a blob, not a list of floats, so that
    msgpack copies it in one piece."""

    row: int
    hidden_sum: bytes


@dataclass
class BatchInput:
    step: int
    sids: list[int]  # request handles, one per request in the batch
    input_ids: list[int]  # new tokens of all requests, concatenated; PENDING_TOKEN: see above
    prefix_lens: list[int]  # tokens of each request already in the KV cache
    extend_lens: list[int]  # new tokens of each request in this step
    # Per request: the runner's page table from this index on is replaced by these pages;
    # afterwards it holds exactly the pages for prefix + new tokens.
    page_starts: list[int]
    new_pages: list[list[int]]
    sample: list[bool]  # False for a prefill chunk that is not the prompt's last
    output_lens: list[int]  # tokens each request has generated so far
    new_specs: list[SamplingSpec] = field(default_factory=list)
    released_sids: list[int] = field(default_factory=list)  # ended: forget their state first
    # Speculative decoding. spec_lens: per row, tokens proposed after its input token, to be
    # verified in this step (0: none; empty list: no row speculates). The page table covers
    # them. proposed_ids: the scheduler's proposals (n-gram), concatenated. catchup_ids and
    # catchup_lens (a draft model): per speculating row, the tokens before its input token
    # that its draft KV lacks (from draft_prefix_lens on), which the draft model reads first;
    # a row that only catches up (spec_len 0) reads part of them.
    spec_lens: list[int] = field(default_factory=list)
    proposed_ids: list[int] = field(default_factory=list)
    catchup_ids: list[int] = field(default_factory=list)
    catchup_lens: list[int] = field(default_factory=list)
    draft_prefix_lens: list[int] = field(default_factory=list)
    # Constrained decoding: batch row -> bitmask of the tokens its next token may be
    # (relay.execution.step_sampling.apply_token_masks); such rows never speculate.
    token_masks: dict[int, bytes] = field(default_factory=dict)
    # LongRoPE models: per row, whether its tokens rotate with the long factors everywhere (its
    # sequence is longer than original_max_position_embeddings: relay.rope); empty: no row does.
    rope_long: list[bool] = field(default_factory=list)
    prompt_logprob_spans: list[PromptLogprobSpan] = field(default_factory=list)
    embed_spans: list[EmbedSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    def without(self, rows: set[int]) -> BatchInput:
        """The same step minus some requests (and the sampling specs of their handles)."""
        keep = [i for i in range(len(self.sids)) if i not in rows]
        starts = [0]
        for n in self.extend_lens:
            starts.append(starts[-1] + n)
        dropped = {self.sids[i] for i in rows}
        pick = lambda values: [values[i] for i in keep]  # noqa: E731
        spec_lens = self.spec_lens or [0] * len(self.sids)
        catchup_lens = self.catchup_lens or [0] * len(self.sids)
        return BatchInput(
            step=self.step,
            sids=pick(self.sids),
            input_ids=[t for i in keep for t in self.input_ids[starts[i] : starts[i + 1]]],
            prefix_lens=pick(self.prefix_lens),
            extend_lens=pick(self.extend_lens),
            page_starts=pick(self.page_starts),
            new_pages=pick(self.new_pages),
            sample=pick(self.sample),
            output_lens=pick(self.output_lens),
            new_specs=[s for s in self.new_specs if s.sid not in dropped],
            released_sids=self.released_sids,
            spec_lens=pick(self.spec_lens) if self.spec_lens else [],
            proposed_ids=_pick_runs(self.proposed_ids, spec_lens, keep)
            if self.proposed_ids
            else [],
            catchup_ids=_pick_runs(self.catchup_ids, catchup_lens, keep)
            if self.catchup_ids
            else [],
            catchup_lens=pick(self.catchup_lens) if self.catchup_lens else [],
            draft_prefix_lens=pick(self.draft_prefix_lens) if self.draft_prefix_lens else [],
            token_masks={
                new: self.token_masks[old]
                for new, old in enumerate(keep)
                if old in self.token_masks
            },
            rope_long=pick(self.rope_long) if self.rope_long else [],
            prompt_logprob_spans=_renumber(self.prompt_logprob_spans, rows, keep),
            embed_spans=_renumber(self.embed_spans, rows, keep),
        )

    def row_runs(self, values: list[int], lens: list[int]) -> list[list[int]]:
        """values split into one run per row by lens (e.g. proposed_ids by spec_lens)."""
        return _split(values, lens or [0] * len(self.sids))


def _renumber(spans: list, rows: set[int], keep: list[int]) -> list:
    """The spans of the kept rows, their row numbers those rows' after `without`."""
    return [dataclasses.replace(s, row=keep.index(s.row)) for s in spans if s.row not in rows]


def _split(values: list[int], lens: list[int]) -> list[list[int]]:
    out, at = [], 0
    for n in lens:
        out.append(values[at : at + n])
        at += n
    return out


def _pick_runs(values: list[int], lens: list[int], keep: list[int]) -> list[int]:
    runs = _split(values, lens)
    return [t for i in keep for t in runs[i]]


@dataclass
class BatchOutput:
    step: int
    next_token_ids: list[int]  # one per request with sample=True, in batch order
    logprobs: list[float] | None = None  # of the chosen tokens, where any request asked
    top_logprobs: list[list[list[float]]] | None = None  # per sampled request: [ids, logprobs]
    error: str | None = None  # the runner failed this step; the scheduler fails the batch
    # Batch rows that failed on their own (bad input caught before the forward, or their
    # sampling raised), with why; the other rows ran. A failed row's token is -1.
    row_errors: dict[int, str] = field(default_factory=dict)
    # Speculative decoding: per sampling row, the tokens verified after next_token_ids' one,
    # in order (accepted proposals, then the target's own next token); None: no row speculated.
    spec_token_ids: list[list[int]] | None = None
    # The prompt log-probabilities of the step's PromptLogprobSpans (rows that ran), by row.
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)
    # The hidden-state sums of the step's EmbedSpans (rows that ran), by row.
    embed_chunks: list[EmbedChunk] = field(default_factory=list)
