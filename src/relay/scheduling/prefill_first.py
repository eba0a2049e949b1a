"""Prefill-first: when decoding requests sit a step out so a burst of prompts starts sooner."""

from __future__ import annotations

import math
from collections.abc import Callable

from relay.config import EngineConfig
from relay.scheduling.adaptive_batching import StepLimits
from relay.scheduling.kv_manager import KVManager
from relay.scheduling.request import Req, Status
from relay.scheduling.request_table import RequestTable


class PrefillFirst:
    def __init__(
        self,
        cfg: EngineConfig,
        table: RequestTable,
        kv: KVManager,
        limits: StepLimits,
        clock: Callable[[], float],
    ):
        self.cfg, self.table, self.kv, self.limits, self.clock = cfg, table, kv, limits, clock

    def decodes_to_hold(self, decoding: list[Req], prompts: list[Req], budget: int) -> set[int]:
        """ids of decoding requests that yield this step to prompts: prefill-first, as SGLang
        schedules, once a prompt has waited longer than max_decode_stall_ms and more prompt
        tokens wait than this step takes beside the decodes (a burst of arrivals), so the
        burst's last first token does not wait for every started request's decode rows. A
        request yields once, for at most max_decode_stall_ms, and never to prompts ranked below
        it: one long gap, where mixing would lengthen every step of the burst."""
        limit = self.cfg.max_decode_stall_ms / 1000
        if not limit or not decoding or self.cfg.target_itl_ms is not None:
            return set()  # off, nothing to hold, or an inter-token latency target rules the steps
        if self.kv.obtainable - self.table.decode_headroom() < self.kv.pages_for(budget):
            return set()  # prompts would be short of KV for a step's worth of tokens: holding would not speed them
        now = self.clock()
        # Prompts that fit in this step beside every decode row are no backlog.
        backlog = self._backlog(prompts, budget - len(decoding))
        if backlog is None or now - backlog[1] <= limit:
            return set()
        return {
            id(r)
            for r in decoding
            if r.priority <= backlog[0]
            and not r.has_yielded
            and r.last_token_time is not None
            and (r.held_since is None or now - r.held_since < limit)
        }

    def _backlog(self, prompts: list[Req], budget: int) -> tuple[int, float] | None:
        """(highest priority, earliest arrival) among prompts (the running ones given, or ones
        waiting for a free slot) when more of their tokens are still to compute than `budget`;
        None when one step can take them."""
        prompts = [
            r for r in prompts if r.status == Status.RUNNING
        ]  # not one just preempted (now waiting)
        tokens = sum(r.seq_len - r.kv_len for r in prompts)
        top = max((r.priority for r in prompts), default=None)
        first = min((r.arrival_time for r in prompts), default=math.inf)
        if len(self.table.running) < self.limits.max_running:
            for req in self.table.waiting.in_heap_order():
                if tokens > budget:
                    break
                if req.status != Status.WAITING or req.grammar_compiling:
                    continue  # finished while it waited, or its grammar is still compiling
                tokens += req.seq_len  # its cached prefix is unknown until it is matched
                top = req.priority if top is None else max(top, req.priority)
                first = min(first, req.arrival_time)
        return (top, first) if tokens > budget else None

    def note_holds(self, decoding: list[Req], hold: set[int]) -> None:
        """Start the held requests' waits; a request that decodes again has had its wait."""
        now = self.clock()
        for req in decoding:
            if id(req) in hold:
                if req.held_since is None:
                    req.held_since = now
            elif req.held_since is not None:
                req.held_since, req.has_yielded = None, True
