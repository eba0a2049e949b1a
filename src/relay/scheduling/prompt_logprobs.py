"""A request's prompt log-probabilities on the scheduler's side: which positions each prompt
chunk must score, how far the prefix cache may serve it, and the scored chunks collected into
its one record (Req.prompt_logprobs, a relay.outputs.PromptLogprobs).

The token at position t is scored by the logits of position t - 1. A request that wants them
from position s (SamplingParams.logprob_start_len) needs the logits of positions s .. P - 2
(P: the prompt's length), so those positions must be computed in a prefill, not read from the
prefix cache: its cached-prefix match stops at the first position still to score (as SGLang
limits it to logprob_start_len). Recomputing is simpler than keeping logits in the cache, and
costs only the requests that ask.
"""

from __future__ import annotations

import logging

from relay.scheduling.request import Req
from relay.step import PromptLogprobChunk, PromptLogprobSpan

logger = logging.getLogger(__name__)


def next_scored(req: Req) -> int | None:
    """The first position whose logits the request still needs; None: none (not asked, or
    all scored)."""
    lp = req.prompt_logprobs
    if lp is None or lp.complete:
        return None
    return lp.start + len(lp.logprobs) - 1


def cache_limit(req: Req, limit: int) -> int:
    """How many leading tokens the prefix cache may serve, at most limit."""
    first = next_scored(req)
    return limit if first is None else min(limit, first)


def span(req: Req, row: int, n: int) -> PromptLogprobSpan | None:
    """The positions the request's next n tokens (from kv_len on) score, or None."""
    first = next_scored(req)
    if first is None:
        return None
    lo = max(req.kv_len, first)
    hi = min(req.kv_len + n, len(req.prompt_ids) - 1)  # the last token's logits sample output
    if lo >= hi:
        return None
    targets = req.prompt_ids[lo + 1 : hi + 1]
    return PromptLogprobSpan(row, lo - req.kv_len, targets, req.params.prompt_top_logprobs)


def collect(req: Req, span: PromptLogprobSpan, chunk: PromptLogprobChunk, prefix: int) -> None:
    """Append a step's scored positions (of the row whose new tokens began at prefix) to the
    request's record; positions it already has (scored before a retraction) are skipped."""
    lp = req.prompt_logprobs
    first = next_scored(req)
    if first is None:
        return
    skip = first - (prefix + span.first)
    if skip < 0:  # a step scored nothing for it (a runner without a model): leave it short
        logger.error(
            "request %s: prompt logprobs from position %d, expected %d; dropped",
            req.rid,
            prefix + span.first,
            first,
        )
        return
    for k in range(skip, len(chunk.logprobs)):
        lp.logprobs.append(chunk.logprobs[k])
        lp.ranks.append(chunk.ranks[k])
        lp.top.append([chunk.top_ids[k], chunk.top_logprobs[k]] if span.top_n else None)
