"""Which running requests speculate in a step, and with what (pure Python, scheduler side)."""

from __future__ import annotations

from dataclasses import dataclass

from relay.config import EngineConfig
from relay.scheduling.request import Req
from relay.scheduling.speculative.ngram import NgramIndex


@dataclass
class SpecRow:
    """One decoding request's speculation in a step."""

    k: int  # proposals to verify after its input token (0: the draft model only catches up)
    proposals: list[int]  # the n-gram proposals (a draft model makes its own in the runner)
    catchup: list[int]  # tokens the draft model reads first: its KV lags the target's

    @property
    def cost(self) -> int:
        """Step budget units: every verified position and every token the draft catches up on."""
        return self.k + len(self.catchup)


class SpecPlanner:
    def __init__(self, cfg: EngineConfig, context_len: int):
        self.algorithm = cfg.speculative_algorithm
        self.k = cfg.speculative_num_draft_tokens
        self.windows = (
            cfg.speculative_ngram_min_match_window_size,
            cfg.speculative_ngram_max_match_window_size,
        )
        self.max_batch = cfg.speculative_disable_by_batch_size
        self.context_len = context_len

    def active(self, num_running: int) -> bool:
        return num_running <= self.max_batch

    def plan(self, req: Req, budget: int) -> SpecRow | None:
        """What req (decoding: only its last token lacks KV) speculates within budget; None:
        a plain decode step."""
        p = req.params
        if p.logprobs:  # logprobs are reported for one token per step
            return None
        k = min(
            self.k,
            p.max_new_tokens - len(req.output_ids) - 1,
            self.context_len - req.seq_len,
            budget,
        )
        if k <= 0:
            return None
        if self.algorithm == "ngram":
            proposals = self._ngram(req).propose(k)
            return SpecRow(len(proposals), proposals, []) if proposals else None
        lag = req.kv_len - req.draft_len
        if lag + k <= budget:
            return SpecRow(k, [], req.token_slice(req.draft_len, req.kv_len))
        # A long lag (a prompt the draft has not read) is caught up in budget-sized chunks.
        return SpecRow(0, [], req.token_slice(req.draft_len, req.draft_len + min(lag, budget)))

    def _ngram(self, req: Req) -> NgramIndex:
        if req.ngram is None:
            req.ngram = NgramIndex(*self.windows)
        req.ngram.extend(req.token_slice(len(req.ngram), req.seq_len))
        return req.ngram
