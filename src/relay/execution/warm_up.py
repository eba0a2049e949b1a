"""The steps a model runner runs once before the server says it is ready, so the first request
pays for no kernel build, oneDNN primitive or first-call path."""

from __future__ import annotations

import dataclasses

from relay.sampling_params import SamplingParams
from relay.step import BatchInput, SamplingSpec

WARM_UP_SIDS = (-2, -1)  # request handles of the start-up warm-up; the scheduler's are >= 0


def warm_up_steps(
    context_len: int, page_size: int, num_pages: int, speculative: bool, own_drafter: bool
) -> list[BatchInput]:
    """Every kind of step once: two prompts (one sampled greedily, one with temperature, top-p
    and top-k), a mixed step, two decode steps, with speculative decoding a step that verifies
    proposals, and the release of both requests. No steps where the pool is too small for them
    (a pool that small serves tests only)."""
    lens = [min(40, context_len - 7), min(17, context_len - 7)]
    counts = [
        -(-(n + 6) // page_size) for n in lens
    ]  # room for the decode and verify steps' tokens
    if 1 + sum(counts) > num_pages:
        return []
    pages = [list(range(1, 1 + counts[0])), list(range(1 + counts[0], 1 + sum(counts)))]
    specs = [
        SamplingSpec(WARM_UP_SIDS[0], SamplingParams(temperature=0), []),
        SamplingSpec(WARM_UP_SIDS[1], SamplingParams(temperature=1.0, top_p=0.9, top_k=20), []),
    ]
    steps = [
        BatchInput(
            -1,
            [WARM_UP_SIDS[0]],
            [1] * lens[0],
            [0],
            [lens[0]],
            [0],
            [pages[0]],
            [True],
            [0],
            specs[:1],
        ),
        BatchInput(
            -1,
            list(WARM_UP_SIDS),
            [1] * (1 + lens[1]),
            [lens[0], 0],
            [1, lens[1]],
            [len(pages[0]), 0],
            [[], pages[1]],
            [True, True],
            [1, 0],
            specs[1:],
        ),
    ]
    steps += [
        BatchInput(
            -1,
            list(WARM_UP_SIDS),
            [1, 1],
            [lens[0] + 1 + i, lens[1] + i],
            [1, 1],
            [len(pages[0]), len(pages[1])],
            [[], []],
            [True, True],
            [2 + i, 1 + i],
        )
        for i in range(2)
    ]
    if speculative:
        steps.append(_verify_step(steps[-1], lens, own_drafter))
    steps.append(BatchInput(-1, [], [], [], [], [], [], [], [], released_sids=list(WARM_UP_SIDS)))
    return steps


def _verify_step(decode: BatchInput, lens: list[int], own_drafter: bool) -> BatchInput:
    """A step verifying two proposals per request after the decode step decode."""
    verify = dataclasses.replace(
        decode,
        input_ids=[1, 1],
        prefix_lens=[lens[0] + 3, lens[1] + 2],
        output_lens=[4, 3],
        spec_lens=[2, 2],
    )
    if not own_drafter:
        verify.proposed_ids = [1, 1, 1, 1]
    else:  # the draft has read nothing of these requests yet
        verify.catchup_lens, verify.draft_prefix_lens = [lens[0] + 3, lens[1] + 2], [0, 0]
        verify.catchup_ids = [1] * sum(verify.catchup_lens)
    return verify
