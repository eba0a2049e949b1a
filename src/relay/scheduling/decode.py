"""Rows for requests already running: each decoding request's next token (with proposals to
verify while speculation pays) and the next chunk of a started prompt, with KV reserved for
them, retracting lower-ranked requests when the pool runs out."""

from __future__ import annotations

from relay.config import EngineConfig
from relay.outputs import FinishReason
from relay.scheduling.kv_manager import KVManager
from relay.scheduling.request import Req, Status
from relay.scheduling.request_table import RequestTable
from relay.scheduling.speculative.planner import SpecPlanner, SpecRow
from relay.scheduling.step_cost import StepCost

Batch = list[tuple[Req, int]]  # (request, tokens it computes in the step)


class DecodeManager:
    def __init__(
        self,
        cfg: EngineConfig,
        table: RequestTable,
        kv: KVManager,
        cost: StepCost,
        context_len: int,
    ):
        self.table, self.kv, self.cost = table, kv, cost
        self.context_len = context_len
        self.long_rope = kv.long_rope
        self.spec = SpecPlanner(cfg, context_len) if cfg.speculative_algorithm else None

    def schedule_running(
        self, reqs: list[Req], batch: Batch, scheduled: set[int], budget: int
    ) -> int:
        """Add the next tokens of running requests (retracting lower-ranked ones for room);
        returns the tokens used."""
        used = 0
        for req in reqs:
            if req.status != Status.RUNNING or budget - used <= 0:
                continue  # retracted to make room for a request ranked above it
            if not self.may_run_ahead(req):
                continue
            n = self.cost.chunk(req, budget - used)
            if n > 0 and self._reserve_or_retract(req, req.kv_len + n, scheduled):
                batch.append((req, n))
                scheduled.add(id(req))
                used += self.cost.cost(req, n)
        return used

    def _reserve_or_retract(self, req: Req, num_tokens: int, scheduled: set[int]) -> bool:
        """Reserve KV for a running request, retracting lower-ranked ones if needed; False if
        it is not in this step (retracted, being the lowest-ranked, or waiting a step)."""
        table = self.table
        if self.kv.pages_for(num_tokens) > self.kv.allocator.capacity:
            table.finish(req, FinishReason.LENGTH)  # it alone fills the pool: stop, don't thrash
            return False
        while not self.kv.reserve(req, num_tokens):
            victim = table.lowest_ranked_running()
            if id(victim) in scheduled and victim is not req:
                # Decodes are scheduled before prompts, so the one to give way may already be
                # in this step: req waits a step with its KV rather than be retracted for a
                # request ranked below it (the two would retract each other in turn).
                return False
            table.retract(victim)
            if victim is req:
                return False
        return True

    def may_run_ahead(self, req: Req) -> bool:
        """Whether req can be in the step being built while an unprocessed one samples its
        next token: only a plain sample, and not one that ends it by length (a wasted row)."""
        if not req.pending:
            return True
        if self.long_rope.crosses(req):
            return False  # it restarts on the long factors once its last token is known (switch_to_long_rope)
        p = req.params
        return (
            req.chainable
            and len(req.output_ids) + req.pending < p.max_new_tokens
            and req.seq_len < self.context_len
            and self.kv.pages_for(req.seq_len) <= self.kv.allocator.capacity
        )

    def speculate(self, decodes: Batch, budget: int) -> dict[int, SpecRow]:
        """Proposals to verify (or draft KV to catch up on) for decoding requests, by id(req),
        while the batch is small enough for speculation to pay; each gets its KV pages here
        or decodes plainly."""
        if self.spec is None or not self.spec.active(len(self.table.running)):
            return {}
        rows: dict[int, SpecRow] = {}
        headroom = self.table.decode_headroom()
        for req, _ in decodes:
            row = self._plan(req, budget)
            if row is None or not self.kv.reserve(req, req.kv_len + 1 + row.k, headroom):
                continue
            rows[id(req)] = row
            budget -= row.cost
        return rows

    def _plan(self, req: Req, budget: int) -> SpecRow | None:
        """req's proposals, cut to what its grammar allows; None: it decodes plainly."""
        if req.pending:
            return None  # its last token is not known here yet
        if req.constraint is not None and self.spec.algorithm != "ngram":
            return None  # a draft model proposes in the runner, where no matcher is
        row = self.spec.plan(req, budget)
        if row is not None and self.long_rope.verify_crosses(req, row.k):
            return None  # its proposals' logits would need the long factors
        if row is not None and req.constraint is not None:
            kept = req.constraint.allowed_prefix(row.proposals)
            row = SpecRow(len(kept), kept, []) if kept else None
        return row

    def switch_to_long_rope(self) -> None:
        """Recompute each running request whose next decode step makes its sequence longer than
        the LongRoPE boundary while its KV holds the short factors' rotation: transformers' Phi-3
        generate recomputes the whole sequence with the long factors at that step. The retracted
        request restarts on the long rows (KVManager.match): its whole sequence is now past it."""
        if self.long_rope.after is None:
            return
        # One whose last token a step still out is sampling waits for it (may_run_ahead): a
        # retraction drops tokens in flight, and without that one its sequence is not past.
        for req in [r for r in self.table.running if self.long_rope.crosses(r) and not r.pending]:
            self.table.retract(
                req, f"past {self.long_rope.after} tokens (LongRoPE's long factors from here)"
            )
