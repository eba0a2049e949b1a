"""Continuous-batching scheduler: what runs in the next forward step.

Every step packs (1) one token for each running request that is decoding, (2) the next
chunk of requests whose prompt is partly computed, and (3) newly admitted requests, in
priority order, until the step's token budget is spent. KV pages come from the radix
cache's allocator; when they run out, the lowest-priority, newest request is retracted
(its computed KV goes to the prefix cache) and recomputed later. Where every layer of the model
slides (kv_window), pages no future query attends go back to the pool as requests run past them.
Pure Python: no tensors.

The Scheduler coordinates parts with one job each, over one record per request (Req):
  RequestTable      every live request, waiting or running; start, retract, finish
  KVManager         KV pages: reserve, share through the radix prefix cache, give back
  PrefillManager    admission from the waiting queue, prompt chunks, preemption for priority
  DecodeManager     rows of running requests (decodes, started prompts), speculation plans
  PrefillFirst      when decodes sit a step out for a burst of prompts
  BatchBuilder      the BatchInput message and the record of the step in flight
  OutputProcessor   a step's output: tokens appended, requests finished, timing learned
  GrammarWaits      requests waiting for their output grammar to compile

Overlap: the caller may build step N+1 before it hands back step N's output. A request whose
step-N row samples a plain token then decodes in N+1 with PENDING_TOKEN as its input (the
runner substitutes what it sampled); if that token ends the request, N+1's row is dropped
when it comes back and its KV freed. A step's KV counts as the request's at build time
(kv_len), and as shareable only once the step is processed (written_len).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.config import EngineConfig
from relay.outputs import FinishReason, RequestOutput
from relay.sampling_params import InvalidParam, check_prompt_length
from relay.scheduling.adaptive_batching import make_limits
from relay.scheduling.batch_builder import BatchBuilder
from relay.scheduling.decode import DecodeManager
from relay.scheduling.grammar_waits import GrammarWaits
from relay.scheduling.kv_manager import KVManager
from relay.scheduling.long_rope import LongRopeBoundary
from relay.scheduling.output_processor import OutputProcessor
from relay.scheduling.pooling import Pooling
from relay.scheduling.prefill import PrefillManager
from relay.scheduling.prefill_first import PrefillFirst
from relay.scheduling.request import Req
from relay.scheduling.request_table import RequestTable
from relay.scheduling.scheduler_stats import SchedulerStats
from relay.scheduling.speculative import SpecStats
from relay.scheduling.step_cost import StepCost
from relay.step import BatchInput, BatchOutput

if TYPE_CHECKING:
    from relay.text.grammar import GrammarBackend


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_pages: int,
        context_len: int,
        eos_token_ids: list[int],
        on_finish: Callable[[Req], None] | None = None,
        attention_break_even: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        grammars: GrammarBackend | None = None,
        long_rope_after: int | None = None,
        pooling: Pooling | None = None,
        kv_window: int | None = None,
    ):
        self.cfg = cfg = config.for_device(
            "cpu"
        )  # normally the runner already resolved it for its device
        self.clock = clock  # time.monotonic; a simulated clock in tests of the latency policy
        clock = self.now  # the parts read the scheduler's clock, so replacing it reaches them all
        self.context_len = context_len
        self.eos_token_ids = eos = frozenset(eos_token_ids)
        self.grammars = grammars
        self.pooling = pooling  # an embedding server's (EngineConfig.is_embedding); else None
        # kv_window: the runner's (ModelRunner.kv_window): how far back every layer attends.
        self.kv = KVManager(
            num_pages,
            cfg.page_size,
            cfg.disable_radix_cache,
            LongRopeBoundary(long_rope_after),
            kv_window,
        )
        self.table = RequestTable(self.kv, on_finish)
        self.limits = make_limits(cfg, self.kv.allocator.capacity * cfg.page_size)
        self.spec_stats = SpecStats(cfg.speculative_num_draft_tokens)
        cost = StepCost(attention_break_even)
        self.prefill = PrefillManager(self.table, self.kv, cost, self.limits, clock, context_len)
        self.decode = DecodeManager(cfg, self.table, self.kv, cost, context_len)
        self.prefill_first = PrefillFirst(cfg, self.table, self.kv, self.limits, clock)
        self.builder = BatchBuilder(
            self.table, self.kv, cost, self.decode.spec, eos, long_rope_after, grammars, clock
        )
        self.outputs = OutputProcessor(
            self.table, self.kv, self.limits, self.spec_stats, eos, context_len, grammars, clock
        )
        self.grammar_waits = GrammarWaits(grammars, self.table, cfg.grammar_compile_timeout, clock)

    def now(self) -> float:
        return self.clock()

    # ---- what callers read (the rest they read from the parts: table, kv, decode, ...) ----
    @property
    def has_work(self) -> bool:
        return bool(self.table.running or len(self.table.waiting))

    # ---- requests in and out ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; raises InvalidParam if it could never run."""
        if req.rid in self.table.reqs:
            raise InvalidParam("rid", f"request id {req.rid!r} is already in use")
        if not req.prompt_ids:
            raise InvalidParam("prompt", "the prompt is empty")
        check_prompt_length(len(req.prompt_ids), self.context_len)
        need = self.kv.pages_for(len(req.prompt_ids) + 1)
        capacity, page_size = self.kv.allocator.capacity, self.kv.page_size
        if need > capacity:
            raise InvalidParam(
                "prompt",
                f"the prompt needs {need * page_size} KV tokens; the pool "
                f"holds {capacity * page_size}",
            )
        if req.params.embed:
            if self.pooling is None:
                raise InvalidParam(
                    "embed", "this server does not serve embeddings: start it with --is-embedding"
                )
            req.pooled = self.pooling.start(len(req.prompt_ids))
        if req.params.constraint is not None:
            self.grammar_waits.start(req)
        self.table.add(req)

    def poll_constraints(self) -> list[RequestOutput]:
        """Make requests whose grammar compiled schedulable; end with a 400 naming the field
        those whose grammar failed (it does not parse, or matches nothing) or has not compiled
        by its deadline (grammar_compile_timeout), returning their records."""
        return self.grammar_waits.poll()

    def abort(self, rid: str) -> RequestOutput | None:
        """End a request wherever it is, freeing its KV; its last record, or None if it is
        unknown or done."""
        req = self.table.reqs.get(rid)
        if req is None:
            return None
        return self.table.finish(req, FinishReason.ABORT)

    def stop(self, rid: str, matched_stop: str | None) -> None:
        """Stop generating a request whose output already ended outside the scheduler (the
        detokenizer found a stop string, or failed, and told its client): free it, report
        nothing."""
        req = self.table.reqs.get(rid)
        if req is not None:
            req.matched_stop = matched_stop
            self.table.finish(req, FinishReason.STOP if matched_stop else FinishReason.ABORT)

    def fail_all(self, error: str) -> list[RequestOutput]:
        return [
            self.table.finish(req, FinishReason.ABORT, error)
            for req in list(self.table.reqs.values())
        ]

    # ---- the step -------------------------------------------------------------------
    def schedule(self) -> BatchInput | None:
        """Decide the next forward step; None if there is nothing to run.

        Decodes go first (one token each), then prompt chunks of running requests, then new
        requests. While requests wait, running prompts' chunks take at most half of what the
        decodes leave, so a short request that arrives behind a long prompt starts within a
        step instead of after the whole prompt; whatever admission leaves goes back to them.
        Decodes that yield to a backlog of prompts (PrefillFirst) sit the step out."""
        decode, prefill = self.decode, self.prefill
        decode.switch_to_long_rope()
        if self.kv.window is not None:  # pages behind a request's window go back before reserving
            for req in self.table.running:
                self.kv.drop_dead_pages(req)
        by_rank = sorted(self.table.running, key=lambda r: (-r.priority, r.seq))
        decoding = [r for r in by_rank if not r.in_prefill]
        prompts = [r for r in by_rank if r.in_prefill]
        budget = self.limits.step_budget(len(decoding))
        prefill.preempt_for_waiting(budget)
        hold = self.prefill_first.decodes_to_hold(decoding, prompts, budget)
        batch: list[tuple[Req, int]] = []
        scheduled: set[int] = set()
        # In rank order, so retraction victims are never already in the batch.
        budget -= decode.schedule_running(
            [r for r in decoding if id(r) not in hold], batch, scheduled, budget
        )
        decodes = list(batch)
        reserved = budget // 2 if prefill.can_admit() else 0
        budget -= decode.schedule_running(prompts, batch, scheduled, budget - reserved)
        budget = prefill.admit(batch, budget)
        budget = prefill.extend_chunks(prompts, batch, budget, decode.may_run_ahead)
        if hold and len(batch) == len(
            decodes
        ):  # no prompt could run after all: nothing to yield to
            budget -= decode.schedule_running(
                [r for r in decoding if id(r) in hold], batch, scheduled, budget
            )
            decodes, hold = list(batch), set()
        self.prefill_first.note_holds(decoding, hold)
        # Speculation takes only what prompts left: it never delays a first token.
        spec_rows = decode.speculate(decodes, budget)
        if not batch:
            return None
        return self.builder.build(batch, spec_rows)

    def process_output(self, batch: BatchInput, out: BatchOutput) -> list[RequestOutput]:
        """Apply a finished step: append sampled tokens, finish requests, share new prefixes;
        one record per request that produced a token or ended."""
        return self.outputs.process(self.builder.inflight.pop(batch.step), batch, out)

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        ps, kv, table = self.kv.page_size, self.kv, self.table
        return SchedulerStats(
            num_running=len(table.running),
            num_waiting=len(table.waiting),
            kv_total_tokens=kv.allocator.capacity * ps,
            kv_free_tokens=kv.allocator.num_free * ps,
            kv_locked_tokens=kv.locked_pages(table.running) * ps,
            kv_cached_tokens=kv.cache.evictable_pages * ps,
            prompt_tokens_total=self.prefill.prompt_tokens_total,
            cached_prompt_tokens_total=self.prefill.cached_tokens_total,
            num_retractions_total=table.retractions_total,
            spec=self.spec_stats.to_dict() if self.decode.spec is not None else None,
            adaptive=self.limits.to_dict(),
            grammar=self.grammar_waits.stats(self.builder.mask_seconds, self.outputs.step_seconds),
        )

    def check(self) -> None:
        """Every page is free, privately held by one running request, or in the tree (locked
        or evictable), exactly once; no grammar matcher outlives its request. Raises
        AssertionError otherwise."""
        self.kv.check(self.table.running)
        self.grammar_waits.check()
