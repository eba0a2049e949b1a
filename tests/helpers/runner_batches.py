"""A model runner's first step built by hand: each prompt whole in pages of PS tokens, greedy
unless told otherwise (what the runner-level tests of several model families feed it)."""

from __future__ import annotations

from relay.sampling_params import SamplingParams
from relay.step import BatchInput, SamplingSpec

PS = 4


def spec(sid: int, **params) -> SamplingSpec:
    p = SamplingParams(temperature=0, **params)
    return SamplingSpec(sid, p, sorted(set(p.stop_token_ids)))


def prefill(
    sids: list[int], prompts: list[list[int]], specs: list[SamplingSpec], step: int = 1
) -> BatchInput:
    tables, first = [], 1
    for p in prompts:
        n = -(-len(p) // PS)
        tables.append(list(range(first, first + n)))
        first += n
    return BatchInput(
        step=step,
        sids=sids,
        input_ids=[t for p in prompts for t in p],
        prefix_lens=[0] * len(sids),
        extend_lens=[len(p) for p in prompts],
        page_starts=[0] * len(sids),
        new_pages=tables,
        sample=[True] * len(sids),
        output_lens=[0] * len(sids),
        new_specs=specs,
        released_sids=[],
    )
