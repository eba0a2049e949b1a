"""The scheduler <-> model runner contract: a batch description in, sampled tokens out.

These are the only objects that pass between the scheduling policy and the model runner,
in one process (offline `Engine`) or across processes (the server, one runner per TP rank).
They hold plain ints, floats and lists so the msgpack codec carries them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from relay.sampling_params import SamplingParams

# An input id the runner replaces with the token it sampled for that request one step
# earlier; lets the scheduler build step N+1 before step N's tokens come back.
PREVIOUS_TOKEN = -1


@dataclass
class SamplingSpec:
    """What the runner needs to sample for one request; sent once, when it first runs."""
    sid: int
    params: SamplingParams
    stop_token_ids: list[int]  # eos ids and the user's, masked until min_new_tokens
    prompt_ids: list[int] = field(default_factory=list)  # only sent for repetition_penalty


@dataclass
class BatchInput:
    step: int
    sids: list[int]  # request handles, one per request in the batch
    input_ids: list[int]  # new tokens of all requests, concatenated
    prefix_lens: list[int]  # tokens of each request already in the KV cache
    extend_lens: list[int]  # new tokens of each request in this step
    page_tables: list[list[int]]  # KV pages holding prefix + new tokens, per request
    sample: list[bool]  # False for a prefill chunk that is not the prompt's last
    output_lens: list[int]  # tokens each request has generated so far
    new_specs: list[SamplingSpec] = field(default_factory=list)
    released_sids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def without(self, rows: set[int]) -> "BatchInput":
        """The same step minus some requests (and the sampling specs of their handles)."""
        keep = [i for i in range(len(self.sids)) if i not in rows]
        starts = [0]
        for n in self.extend_lens:
            starts.append(starts[-1] + n)
        dropped = {self.sids[i] for i in rows}
        return BatchInput(
            step=self.step, sids=[self.sids[i] for i in keep],
            input_ids=[t for i in keep for t in self.input_ids[starts[i]:starts[i + 1]]],
            prefix_lens=[self.prefix_lens[i] for i in keep], extend_lens=[self.extend_lens[i] for i in keep],
            page_tables=[self.page_tables[i] for i in keep], sample=[self.sample[i] for i in keep],
            output_lens=[self.output_lens[i] for i in keep],
            new_specs=[s for s in self.new_specs if s.sid not in dropped], released_sids=self.released_sids)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)


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
