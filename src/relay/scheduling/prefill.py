"""Admission: which waiting requests start, with how long a first prompt chunk, and which
running ones give way to a higher-priority arrival; longer chunks from budget left over."""

from __future__ import annotations

from collections.abc import Callable

from relay.scheduling.adaptive_batching import StepLimits
from relay.scheduling.kv_manager import KVManager, cache_limit
from relay.scheduling.request import Req, Status
from relay.scheduling.request_table import RequestTable
from relay.scheduling.step_cost import StepCost

# A waiting request is held back for a step when it shares at least this many uncached
# tokens with a request whose prefill is in flight: next step it reuses that KV instead.
SHARED_PREFIX_DEFER_TOKENS = 32

Batch = list[tuple[Req, int]]  # (request, tokens it computes in the step)


class PrefillManager:
    def __init__(
        self,
        table: RequestTable,
        kv: KVManager,
        cost: StepCost,
        limits: StepLimits,
        clock: Callable[[], float],
        context_len: int,
    ):
        self.table, self.kv, self.cost, self.limits = table, kv, cost, limits
        self.clock = clock
        self.context_len = context_len
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    def can_admit(self) -> bool:
        return (
            self.table.waiting.peek() is not None
            and len(self.table.running) < self.limits.max_running
        )

    def admit(self, batch: Batch, budget: int) -> int:
        """Start waiting requests in rank order while budget and memory last; returns the
        budget left."""
        table, kv = self.table, self.kv
        held_back: list[Req] = []
        headroom = table.decode_headroom()
        while budget > 0 and len(table.running) < self.limits.max_running:
            req = table.waiting.pop()
            if req is None:
                break
            if req.grammar_compiling or req.inflight_steps:
                held_back.append(
                    req
                )  # compiling, or retracted from a step still out: others go first
                continue
            kv.match(req)
            n = self.cost.chunk(req, budget)
            defer = self._shares_inflight_prefix(req)
            if defer or n == 0 or not kv.reserve(req, req.kv_len + n, headroom):
                kv.unmatch(req)
                held_back.append(req)
                if defer:
                    continue
                break  # out of memory: nothing ranked below it goes first
            self._start(req)
            batch.append((req, n))
            budget -= self.cost.cost(req, n)
        for req in held_back:
            table.waiting.push(req)
        return budget

    def _start(self, req: Req) -> None:
        if req.queue_time is None:  # first start, not a restart after retraction
            now = self.clock()
            req.queue_time = now - req.arrival_time
            req.cached_tokens = req.kv_len
            self.prompt_tokens_total += len(req.prompt_ids)
            self.cached_tokens_total += req.kv_len
            most = req.params.max_new_tokens
            most = self.context_len if most is None else most
            tokens = min(self.context_len, len(req.prompt_ids) + most)
            self.limits.on_admit(now, self.kv.most_held_tokens(tokens, self.limits.budget_cap))
        self.table.start(req)

    def _shares_inflight_prefix(self, req: Req) -> bool:
        """True if a request whose prompt is being computed will soon cache req's next tokens
        (under a sliding window, only a request that still shares them: KVManager.share_limit)."""
        if self.kv.cache.disabled:
            return False
        lo = req.kv_len
        hi = lo + SHARED_PREFIX_DEFER_TOKENS
        if req.seq_len - 1 < hi or cache_limit(req, hi) < hi:
            return False  # too short to share, or it must compute those tokens (to score, pool)
        want = req.token_slice(lo, hi)
        long_rope = self.kv.long_rope.past(req)
        return any(
            other.in_prefill
            and other.long_rope == long_rope
            and hi <= self.kv.shares_up_to(other)
            and other.token_slice(lo, hi) == want
            for other in self.table.running
        )

    def preempt_for_waiting(self, budget: int) -> None:
        """Retract lower-priority running requests a waiting one needs room (or a slot) from."""
        table = self.table
        top = table.waiting.peek()
        if top is not None and (top.grammar_compiling or top.inflight_steps):
            return  # it cannot run yet: room made now would sit idle
        while top is not None and table.running:
            victim = table.lowest_ranked_running()
            if victim.priority >= top.priority:
                return
            if len(table.running) < self.limits.max_running and self._fits(top, budget):
                return
            table.retract(victim)

    def _fits(self, req: Req, budget: int) -> bool:
        """Whether admit would find room for a waiting request's first chunk now.

        The same test admit makes (cached prefix matched, decode headroom kept): a looser
        one lets a high-priority request wait, neither admitted nor preempting, until the
        lower-priority requests in its way finish on their own."""
        kv = self.kv
        kv.match(req)
        n = min(req.seq_len - req.kv_len, budget)
        need = kv.pages_for(req.kv_len + n) - len(req.pages)
        room = kv.obtainable - need >= self.table.decode_headroom()
        kv.unmatch(req)
        return room

    def extend_chunks(
        self, prompts: list[Req], batch: Batch, budget: int, may_run_ahead: Callable[[Req], bool]
    ) -> int:
        """Give budget that admission left unused to running prompts (longer chunks); returns
        the budget left."""
        index = {id(req): i for i, (req, _) in enumerate(batch)}
        for req in prompts:
            if budget <= 0:
                return budget
            if req.status != Status.RUNNING or not may_run_ahead(req):
                continue
            i = index.get(id(req))
            n = batch[i][1] if i is not None else 0
            cost = self.cost.cost(req, n)
            total = self.cost.chunk(req, cost + budget)
            if total <= n or not self.kv.reserve(
                req, req.kv_len + total, self.table.decode_headroom()
            ):
                continue
            if i is None:
                batch.append((req, total))
            else:
                batch[i] = (req, total)
            budget -= self.cost.cost(req, total) - cost
        return budget
