"""Continuous-batching scheduler policy: what runs in the next forward step.

Every step packs (1) one token for each running request that is decoding, (2) the next
chunk of requests whose prompt is partly computed, and (3) newly admitted requests, in
priority order, until the step's token budget is spent. KV pages come from the radix
cache's allocator; when they run out, the lowest-priority, newest request is retracted
(its computed KV goes to the prefix cache) and recomputed later. Pure Python: no tensors.

Overlap: the caller may build step N+1 before it hands back step N's output. A request whose
step-N row samples a plain token then decodes in N+1 with PENDING_TOKEN as its input (the
runner substitutes what it sampled); if that token ends the request, N+1's row is dropped
when it comes back and its KV freed. A step's KV counts as the request's at build time
(kv_len), and as shareable only once the step is processed (written_len).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from relay.scheduling.adaptive_batching import AdaptiveLimits, StepLimits
from relay.scheduling.batch import BatchInput, BatchOutput, SamplingSpec
from relay.config import EngineConfig
from relay.memory.kv_allocator import PageAllocator
from relay.outputs import FinishReason, RequestOutput
from relay.memory.radix_cache import RadixCache
from relay.scheduling.request import Req, Status
from relay.sampling_params import InvalidParam, check_prompt_length
from relay.scheduling.speculative import SpecStats
from relay.scheduling.speculative.planner import SpecPlanner, SpecRow

if TYPE_CHECKING:
    from relay.text.grammar import GrammarBackend

logger = logging.getLogger(__name__)

# A waiting request is held back for a step when it shares at least this many uncached
# tokens with a request whose prefill is in flight: next step it reuses that KV instead.
SHARED_PREFIX_DEFER_TOKENS = 32

# Radix keys of tokens whose KV rotates with LongRoPE's long factors are token id + this (token
# ids stay below 2**31): one tree, one eviction order, no match across the two rotations.
LONG_ROPE_KEY = 1 << 32


@dataclass
class StepInFlight:
    """A step sent to the runner: who is in it, and what the step-time model learns from it."""
    reqs: list[Req]
    started: float
    decode_tokens: int = 0  # including proposals to verify
    prefill_cost: int = 0  # budget units of prompt chunks


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_total_tokens: int
    kv_free_tokens: int
    kv_locked_tokens: int  # pages running requests hold (privately or through the tree)
    kv_cached_tokens: int  # pages only the prefix cache holds (evictable)
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    num_retractions_total: int
    spec: dict | None = None  # SpecStats.to_dict() while speculative decoding is on
    adaptive: dict | None = None  # AdaptiveLimits.to_dict() while adaptive batching is on
    grammar: dict | None = None  # constrained decoding's counters, where the server has xgrammar

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens_total / max(1, self.prompt_tokens_total)


class Scheduler:
    def __init__(self, config: EngineConfig, num_pages: int, context_len: int,
                 eos_token_ids: list[int], on_finish: Callable[[Req], None] | None = None,
                 attention_break_even: int | None = None, clock: Callable[[], float] = time.monotonic,
                 grammars: GrammarBackend | None = None, long_rope_after: int | None = None):
        self.cfg = config.for_device("cpu")  # normally the runner already resolved it for its device
        # ModelConfig.attention_break_even: prompt chunks deep into a long prompt cost more
        # per token (attention over the prefix) and get fewer tokens of the step budget, so
        # a step's cost stays bounded however long the prompt. None: one token, one unit.
        self.attn_even = attention_break_even
        # LongRoPE models (ModelConfig.long_rope_after): a sequence longer than this many tokens
        # rotates every token with the long factors, as transformers' Phi-3 generate does, and a
        # request that grows past it is recomputed so (_switch_to_long_rope); None: any other rope.
        self.long_rope_after = long_rope_after
        self.on_finish = on_finish  # e.g. the server's per-request log line
        self.clock = clock  # time.monotonic; a simulated clock in tests of the latency policy
        self.page_size = self.cfg.page_size
        self.context_len = context_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.cache = RadixCache(self.allocator, disabled=config.disable_radix_cache)
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}  # every request not yet finished
        self._waiting: list[tuple[int, int, Req]] = []  # heap of (-priority, seq, req)
        self._num_waiting = 0
        self._seq = itertools.count()
        self._step = 0
        self._inflight: dict[int, StepInFlight] = {}
        self._last_output_time = 0.0
        self.last_step_seconds = 0.0  # the runner's time for the step processed last
        self._free_sids: list[int] = []
        self._next_sid = 0
        self._released_sids: list[int] = []
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0
        self._retractions_total = 0
        self.spec = SpecPlanner(self.cfg, context_len) if self.cfg.speculative_algorithm else None
        self.spec_stats = SpecStats(self.cfg.speculative_num_draft_tokens)
        self.limits = make_limits(self.cfg, self.allocator.capacity * self.page_size)
        # Constrained decoding: requests whose grammar is compiling wait (in the queue, not
        # admitted) until poll_constraints() finds it ready.
        self.grammars = grammars
        self._compiling: list[Req] = []
        self._mask_seconds = 0.0
        self._step_seconds = 0.0

    # ---- requests in and out ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; raises InvalidParam if it could never run."""
        if req.rid in self.reqs:
            raise InvalidParam("rid", f"request id {req.rid!r} is already in use")
        if not req.prompt_ids:
            raise InvalidParam("prompt", "the prompt is empty")
        check_prompt_length(len(req.prompt_ids), self.context_len)
        need = self._pages_for(len(req.prompt_ids) + 1)
        if need > self.allocator.capacity:
            raise InvalidParam("prompt", f"the prompt needs {need * self.page_size} KV tokens; the pool "
                                         f"holds {self.allocator.capacity * self.page_size}")
        constraint = req.params.constraint
        if constraint is not None:
            if self.grammars is None:
                raise InvalidParam(constraint[0], f"{constraint[0]} needs xgrammar, which this server lacks")
            req.constraint = self.grammars.start(*constraint, self.clock(), self.cfg.grammar_compile_timeout,
                                                 req.params.reasoning_tags)
            self._compiling.append(req)
        req.seq = next(self._seq)
        self.reqs[req.rid] = req
        self._push_waiting(req)

    def poll_constraints(self) -> list[RequestOutput]:
        """Make requests whose grammar compiled schedulable; end with a 400 naming the field
        those whose grammar failed (it does not parse, or matches nothing) or has not compiled
        by its deadline (grammar_compile_timeout), returning their records."""
        failed, still = [], []
        now = self.clock()
        for req in self._compiling:
            if req.status != Status.WAITING:
                continue  # it ended (an abort) while compiling
            error = req.constraint.failure(now)
            if error is not None:
                failed.append(self._finish(req, FinishReason.ABORT, error, param=req.constraint.kind))
            elif not req.constraint.ready():
                still.append(req)
        self._compiling = still
        return failed

    @property
    def compiling(self) -> bool:
        """Some request waits for its grammar to compile (poll_constraints() soon)."""
        return bool(self._compiling)

    def wait_for_constraints(self) -> None:
        """Block until a compiling grammar is compiled or the first compile deadline passes
        (the offline engine, when nothing else can run; poll_constraints() then)."""
        pending = [r.constraint for r in self._compiling if r.constraint is not None]  # None: aborted
        if pending:
            self.grammars.wait_for_any(pending, max(0.0, min(c.deadline for c in pending) - self.clock()))

    def abort(self, rid: str) -> RequestOutput | None:
        """End a request wherever it is, freeing its KV; its last record, or None if it is
        unknown or done."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT)

    def stop(self, rid: str, matched_stop: str | None) -> None:
        """Stop generating a request whose output already ended outside the scheduler (the
        detokenizer found a stop string, or failed, and told its client): free it, report
        nothing."""
        req = self.reqs.get(rid)
        if req is not None:
            req.matched_stop = matched_stop
            self._finish(req, FinishReason.STOP if matched_stop else FinishReason.ABORT)

    def fail_all(self, error: str) -> list[RequestOutput]:
        return [self._finish(req, FinishReason.ABORT, error) for req in list(self.reqs.values())]

    @property
    def has_work(self) -> bool:
        return bool(self.running or self._num_waiting)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    # ---- the step -------------------------------------------------------------------
    def schedule(self) -> BatchInput | None:
        """Decide the next forward step; None if there is nothing to run.

        Decodes go first (one token each), then prompt chunks of running requests, then new
        requests. While requests wait, running prompts' chunks take at most half of what the
        decodes leave, so a short request that arrives behind a long prompt starts within a
        step instead of after the whole prompt; whatever admission leaves goes back to them.
        Decodes that yield to a backlog of prompts (_decodes_to_hold) sit the step out."""
        self._switch_to_long_rope()
        by_rank = sorted(self.running, key=lambda r: (-r.priority, r.seq))
        decoding = [r for r in by_rank if not r.in_prefill]
        prompts = [r for r in by_rank if r.in_prefill]
        budget = self.limits.step_budget(len(decoding))
        self._preempt_for_waiting(budget)
        hold = self._decodes_to_hold(decoding, prompts, budget)
        batch: list[tuple[Req, int]] = []
        scheduled: set[int] = set()
        # In rank order, so retraction victims are never already in the batch.
        budget -= self._schedule_running([r for r in decoding if id(r) not in hold], batch, scheduled, budget)
        decodes = list(batch)
        reserved = budget // 2 if self._can_admit() else 0
        budget -= self._schedule_running(prompts, batch, scheduled, budget - reserved)
        budget = self._admit(batch, budget)
        budget = self._extend_chunks(prompts, batch, budget)
        if hold and len(batch) == len(decodes):  # no prompt could run after all: nothing to yield to
            budget -= self._schedule_running([r for r in decoding if id(r) in hold], batch, scheduled, budget)
            decodes, hold = list(batch), set()
        self._note_holds(decoding, hold)
        # Speculation takes only what prompts left: it never delays a first token.
        spec_rows = self._speculate(decodes, budget)
        if not batch:
            return None
        return self._build_batch(batch, spec_rows)

    def _decodes_to_hold(self, decoding: list[Req], prompts: list[Req], budget: int) -> set[int]:
        """ids of decoding requests that yield this step to prompts: prefill-first, as SGLang
        schedules, once a prompt has waited longer than max_decode_stall_ms and more prompt
        tokens wait than this step takes beside the decodes (a burst of arrivals), so the
        burst's last first token does not wait for every started request's decode rows. A
        request yields once, for at most max_decode_stall_ms, and never to prompts ranked below
        it: one long gap, where mixing would lengthen every step of the burst."""
        limit = self.cfg.max_decode_stall_ms / 1000
        if not limit or not decoding or self.cfg.target_itl_ms is not None:
            return set()  # off, nothing to hold, or an inter-token latency target rules the steps
        if self.allocator.num_free + self.cache.evictable_pages - self._decode_headroom() < self._pages_for(budget):
            return set()  # prompts would be short of KV for a step's worth of tokens: holding would not speed them
        now = self.clock()
        # Prompts that fit in this step beside every decode row are no backlog.
        backlog = self._backlog(prompts, budget - len(decoding))
        if backlog is None or now - backlog[1] <= limit:
            return set()
        return {id(r) for r in decoding if r.priority <= backlog[0] and not r.has_yielded
                and r.last_token_time is not None and (r.held_since is None or now - r.held_since < limit)}

    def _backlog(self, prompts: list[Req], budget: int) -> tuple[int, float] | None:
        """(highest priority, earliest arrival) among prompts (the running ones given, or ones
        waiting for a free slot) when more of their tokens are still to compute than `budget`;
        None when one step can take them."""
        prompts = [r for r in prompts if r.status == Status.RUNNING]  # not one just preempted (now waiting)
        tokens = sum(r.seq_len - r.kv_len for r in prompts)
        top = max((r.priority for r in prompts), default=None)
        first = min((r.arrival_time for r in prompts), default=math.inf)
        if len(self.running) < self.limits.max_running:
            for _, _, req in self._waiting:  # heap order: the highest-ranked (and oldest) comes first
                if tokens > budget:
                    break
                if req.status != Status.WAITING or req.grammar_compiling:
                    continue  # finished while it waited, or its grammar is still compiling
                tokens += req.seq_len  # its cached prefix is unknown until it is matched
                top = req.priority if top is None else max(top, req.priority)
                first = min(first, req.arrival_time)
        return (top, first) if tokens > budget else None

    def _note_holds(self, decoding: list[Req], hold: set[int]) -> None:
        """Start the held requests' waits; a request that decodes again has had its wait."""
        now = self.clock()
        for req in decoding:
            if id(req) in hold:
                if req.held_since is None:
                    req.held_since = now
            elif req.held_since is not None:
                req.held_since, req.has_yielded = None, True

    def _speculate(self, decodes: list[tuple[Req, int]], budget: int) -> dict[int, SpecRow]:
        """Proposals to verify (or draft KV to catch up on) for decoding requests, by id(req),
        while the batch is small enough for speculation to pay; each gets its KV pages here
        or decodes plainly."""
        if self.spec is None or not self.spec.active(len(self.running)):
            return {}
        rows: dict[int, SpecRow] = {}
        headroom = self._decode_headroom()
        for req, _ in decodes:
            if req.pending:
                continue  # its last token is not known here yet
            if req.constraint is not None and self.spec.algorithm != "ngram":
                continue  # a draft model proposes in the runner, where no matcher is
            row = self.spec.plan(req, budget)
            if row is not None and self._verify_crosses_long_rope(req, row.k):
                continue  # its proposals' logits would need the long factors: it decodes plainly
            if row is not None and req.constraint is not None:
                kept = req.constraint.allowed_prefix(row.proposals)
                row = SpecRow(len(kept), kept, []) if kept else None
            if row is None or not self._reserve(req, req.kv_len + 1 + row.k, headroom):
                continue
            rows[id(req)] = row
            budget -= row.cost
        return rows

    def _schedule_running(self, reqs: list[Req], batch: list[tuple[Req, int]], scheduled: set[int],
                          budget: int) -> int:
        """Add the next tokens of running requests (retracting lower-ranked ones for room);
        returns the tokens used."""
        used = 0
        for req in reqs:
            if req.status != Status.RUNNING or budget - used <= 0:
                continue  # retracted to make room for a request ranked above it
            if not self._may_run_ahead(req):
                continue
            n = self._chunk(req, budget - used)
            if n > 0 and self._reserve_or_retract(req, req.kv_len + n, scheduled):
                batch.append((req, n))
                scheduled.add(id(req))
                used += self._cost(req, n)
        return used

    def _extend_chunks(self, prompts: list[Req], batch: list[tuple[Req, int]], budget: int) -> int:
        """Give budget that admission left unused to running prompts (longer chunks); returns
        the budget left."""
        index = {id(req): i for i, (req, _) in enumerate(batch)}
        for req in prompts:
            if budget <= 0:
                return budget
            if req.status != Status.RUNNING or not self._may_run_ahead(req):
                continue
            i = index.get(id(req))
            n = batch[i][1] if i is not None else 0
            cost = self._cost(req, n)
            total = self._chunk(req, cost + budget)
            if total <= n or not self._reserve(req, req.kv_len + total, self._decode_headroom()):
                continue
            if i is None:
                batch.append((req, total))
            else:
                batch[i] = (req, total)
            budget -= self._cost(req, total) - cost
        return budget

    def _chunk(self, req: Req, budget: int) -> int:
        """The most next tokens of req whose _cost fits budget; at least one while any budget
        is left, so a prompt deep into a long context still advances."""
        left = req.seq_len - req.kv_len
        if budget <= 0:
            return 0
        n = budget if self.attn_even is None else int(budget / (1 + req.kv_len / self.attn_even))
        return max(1, min(left, n))

    def _cost(self, req: Req, n: int) -> int:
        """Step budget units that computing req's next n tokens takes: one per token, plus
        their attention over the cached prefix in units of a token's dense work. Attention
        among the n tokens themselves is not priced: a fresh prompt of the budget's length
        runs in one step (vLLM's and SGLang's meaning of the chunk size), and deep into a
        long prompt the prefix term is what grows."""
        if self.attn_even is None or n <= 1:
            return n
        return math.ceil(n * (1 + req.kv_len / self.attn_even))

    def _may_run_ahead(self, req: Req) -> bool:
        """Whether req can be in the step being built while an unprocessed one samples its
        next token: only a plain sample, and not one that ends it by length (a wasted row)."""
        if not req.pending:
            return True
        if self._crosses_long_rope(req):
            return False  # it restarts on the long factors once its last token is known (_switch_to_long_rope)
        p = req.params
        return (req.chainable and len(req.output_ids) + req.pending < p.max_new_tokens
                and req.seq_len < self.context_len and self._pages_for(req.seq_len) <= self.allocator.capacity)

    def _can_admit(self) -> bool:
        return self._peek_waiting() is not None and len(self.running) < self.limits.max_running

    def process_output(self, batch: BatchInput, out: BatchOutput) -> list[RequestOutput]:
        """Apply a finished step: append sampled tokens, finish requests, share new prefixes;
        one record per request that produced a token or ended."""
        step = self._inflight.pop(batch.step)
        reqs = step.reqs
        for req in reqs:
            req.inflight_steps -= 1
        now = self.clock()
        # With overlap the runner started this step when the one before it ended.
        duration = self.last_step_seconds = now - max(step.started, self._last_output_time)
        self._last_output_time = now
        if out.error is not None:
            return [self._finish(r, FinishReason.ABORT, out.error) for r in reqs if not r.finished]
        events: list[RequestOutput] = []
        gaps: dict[float, int] = {}  # inter-token gap -> tokens with it (decodes of a step share one)
        ttfts: list[float] = []
        j = 0
        for i, req in enumerate(reqs):
            token = None
            if batch.sample[i]:
                token, j = out.next_token_ids[j], j + 1
            if req.status != Status.RUNNING:
                continue  # aborted or retracted while the step ran
            if i in out.row_errors:  # this request alone failed; the rest of the batch ran
                events.append(self._finish(req, FinishReason.ABORT, out.row_errors[i]))
                continue
            req.unwritten -= batch.extend_lens[i]
            if token is not None:
                req.pending -= 1
                more = out.spec_token_ids[j - 1] if out.spec_token_ids else []
                events.append(self._append_tokens(req, [token, *more], out, j - 1))
                self._time_tokens(req, now, len(events[-1].token_ids), gaps, ttfts)
                if batch.spec_lens or batch.catchup_lens:
                    self._after_speculation(req, batch, i, batch.prefix_lens[i], len(more))
            if req.status == Status.RUNNING:
                self._cache_prefix(req)  # whole new pages go to the tree: others can share them now
        self._step_seconds += duration
        self.limits.on_step(now, duration, step.decode_tokens, step.prefill_cost, list(gaps.items()), ttfts,
                            self._num_waiting, len(self.running))
        return events

    @staticmethod
    def _time_tokens(req: Req, now: float, k: int, gaps: dict[float, int], ttfts: list[float]) -> None:
        """A first token's TTFT, or the gap each of k tokens that came out together stands for."""
        if req.last_token_time is None:
            ttfts.append(now - req.arrival_time)
        elif k:
            gap = (now - req.last_token_time) / k
            gaps[gap] = gaps.get(gap, 0) + k
        req.last_token_time = now

    def _after_speculation(self, req: Req, batch: BatchInput, i: int, start: int, accepted: int) -> None:
        """Count a verified row; give back the pages of rejected proposals; advance the draft
        model's KV over what it read and what was kept."""
        k = batch.spec_lens[i] if batch.spec_lens else 0
        if k:
            self.spec_stats.record(k, accepted)
            req.spec_proposed += k
            req.spec_accepted += accepted
        if req.status != Status.RUNNING:
            return
        keep = self._pages_for(req.kv_len)
        self.allocator.free(req.pages[keep:])  # pages beyond kv_len are private: tree_len <= kv_len
        req.set_pages(keep, [])
        if batch.catchup_lens:
            # The draft read its catch-up tokens; proposing, also the input token and every
            # proposal but the last (through position start + k - 1), valid while kept.
            req.draft_len = min(req.kv_len, start + k) if k else req.draft_len + batch.catchup_lens[i]

    # ---- admission ------------------------------------------------------------------
    def _admit(self, batch: list[tuple[Req, int]], budget: int) -> int:
        """Start waiting requests in rank order while budget and memory last; returns the
        budget left."""
        held_back: list[Req] = []
        headroom = self._decode_headroom()
        while budget > 0 and len(self.running) < self.limits.max_running:
            req = self._pop_waiting()
            if req is None:
                break
            if req.grammar_compiling or req.inflight_steps:
                held_back.append(req)  # compiling, or retracted from a step still out: others go first
                continue
            self._match(req)
            n = self._chunk(req, budget)
            defer = self._shares_inflight_prefix(req)
            if defer or n == 0 or not self._reserve(req, req.kv_len + n, headroom):
                self._unmatch(req)
                held_back.append(req)
                if defer:
                    continue
                break  # out of memory: nothing ranked below it goes first
            self._start(req)
            batch.append((req, n))
            budget -= self._cost(req, n)
        for req in held_back:
            self._push_waiting(req)
        return budget

    def _preempt_for_waiting(self, budget: int) -> None:
        """Retract lower-priority running requests a waiting one needs room (or a slot) from."""
        top = self._peek_waiting()
        if top is not None and (top.grammar_compiling or top.inflight_steps):
            return  # it cannot run yet: room made now would sit idle
        while top is not None and self.running:
            victim = self._lowest_ranked_running()
            if victim.priority >= top.priority:
                return
            if len(self.running) < self.limits.max_running and self._fits(top, budget):
                return
            self._retract(victim)

    def _fits(self, req: Req, budget: int) -> bool:
        """Whether _admit would find room for a waiting request's first chunk now.

        The same test _admit makes (cached prefix matched, decode headroom kept): a looser
        one lets a high-priority request wait, neither admitted nor preempting, until the
        lower-priority requests in its way finish on their own."""
        self._match(req)
        n = min(req.seq_len - req.kv_len, budget)
        need = self._pages_for(req.kv_len + n) - len(req.pages)
        room = self.allocator.num_free + self.cache.evictable_pages - need >= self._decode_headroom()
        self._unmatch(req)
        return room

    def _match(self, req: Req) -> None:
        """Lock the longest cached prefix of a waiting request and adopt its pages."""
        # Match at most seq_len - 1 tokens: the last one is always computed, since its
        # logits give the next token.
        req.long_rope = self._past_long_rope(req)
        pages, node = self.cache.match_prefix(self._cache_key(req, req.seq_len - 1))
        self.cache.lock(node)
        req.set_pages(0, pages)
        req.last_node = node
        # A cached page's draft KV is trusted: if whoever wrote the page never ran the draft
        # over it, proposals get worse, never the output (the target verifies them).
        req.kv_len = req.tree_len = req.draft_len = len(pages) * self.page_size

    def _unmatch(self, req: Req) -> None:
        self.allocator.free(req.pages[req.tree_len // self.page_size:])
        self.cache.unlock(req.last_node)
        req.set_pages(0, [])
        req.last_node, req.kv_len, req.tree_len, req.draft_len = None, 0, 0, 0

    def _start(self, req: Req) -> None:
        if req.sid < 0:
            req.sid = self._free_sids.pop() if self._free_sids else self._take_new_sid()
        if req.queue_time is None:  # first start, not a restart after retraction
            now = self.clock()
            req.queue_time = now - req.arrival_time
            req.cached_tokens = req.kv_len
            self._prompt_tokens_total += len(req.prompt_ids)
            self._cached_tokens_total += req.kv_len
            most = req.params.max_new_tokens or self.context_len
            self.limits.on_admit(now, min(self.context_len, len(req.prompt_ids) + most))
        req.status = Status.RUNNING
        self.running.append(req)

    def _take_new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid - 1

    def _shares_inflight_prefix(self, req: Req) -> bool:
        """True if a request whose prompt is being computed will soon cache req's next tokens."""
        if self.cache.disabled:
            return False
        lo = req.kv_len
        hi = lo + SHARED_PREFIX_DEFER_TOKENS
        if req.seq_len - 1 < hi:
            return False
        want = req.token_slice(lo, hi)
        return any(other.in_prefill and other.long_rope == self._past_long_rope(req) and other.token_slice(lo, hi) == want
                   for other in self.running)

    def _decode_headroom(self) -> int:
        """Pages to keep free so every decoding request can grow by one page next step."""
        return sum(1 for r in self.running if not r.in_prefill)

    # ---- memory -----------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve(self, req: Req, num_tokens: int, headroom: int = 0) -> bool:
        need = self._pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if self.allocator.num_free + self.cache.evictable_pages - need < headroom:
            return False
        pages = self.cache.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _reserve_or_retract(self, req: Req, num_tokens: int, scheduled: set[int]) -> bool:
        """Reserve KV for a running request, retracting lower-ranked ones if needed; False if
        it is not in this step (retracted, being the lowest-ranked, or waiting a step)."""
        if self._pages_for(num_tokens) > self.allocator.capacity:
            self._finish(req, FinishReason.LENGTH)  # it alone fills the pool: stop, don't thrash
            return False
        while not self._reserve(req, num_tokens):
            victim = self._lowest_ranked_running()
            if id(victim) in scheduled and victim is not req:
                # Decodes are scheduled before prompts, so the one to give way may already be
                # in this step: req waits a step with its KV rather than be retracted for a
                # request ranked below it (the two would retract each other in turn).
                return False
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _lowest_ranked_running(self) -> Req:
        return min(self.running, key=lambda r: (r.priority, -r.seq))

    def _retract(self, req: Req, why: str = "KV pool full") -> None:
        logger.info("%s: retracting request %s (%d tokens) for recompute", why, req.rid, req.seq_len)
        self._release_kv(req)
        req.unwritten = req.pending = 0  # what steps still out produce for it is dropped
        # ... and the runner's penalty counts with it: a penalised request's spec goes again,
        # with the output it restarts from.
        req.spec_sent = not req.params.penalised
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_retractions += 1
        self._retractions_total += 1
        self._push_waiting(req)

    def _switch_to_long_rope(self) -> None:
        """Recompute each running request whose next decode step makes its sequence longer than
        long_rope_after while its KV holds the short factors' rotation: transformers' Phi-3
        generate recomputes the whole sequence with the long factors at that step. The retracted
        request restarts on the long rows (_match): its whole sequence is now past the boundary."""
        if self.long_rope_after is None:
            return
        # One whose last token a step still out is sampling waits for it (_may_run_ahead): a
        # retraction drops tokens in flight, and without that one its sequence is not past.
        for req in [r for r in self.running if self._crosses_long_rope(r) and not r.pending]:
            self._retract(req, f"past {self.long_rope_after} tokens (LongRoPE's long factors from here)")

    def _crosses_long_rope(self, req: Req) -> bool:
        """Whether req's next decode step takes its sequence past long_rope_after on the short factors."""
        return (self.long_rope_after is not None and not req.long_rope and not req.in_prefill
                and req.kv_len >= self.long_rope_after)

    def _past_long_rope(self, req: Req) -> bool:
        """Whether a request starting (or restarting) now computes its sequence on the long factors."""
        return self.long_rope_after is not None and req.seq_len > self.long_rope_after

    def _verify_crosses_long_rope(self, req: Req, k: int) -> bool:
        """Whether verifying k proposals would read logits at a sequence length past
        long_rope_after with the KV of the short factors (plain decoding switches there first)."""
        return self.long_rope_after is not None and not req.long_rope and req.kv_len + k >= self.long_rope_after

    def _cache_key(self, req: Req, n: int) -> list[int]:
        """The radix tree's key for the request's first n tokens: the tokens, moved to a range of
        their own when their KV rotates with LongRoPE's long factors (the same tokens on the short
        factors have other keys and values)."""
        tokens = req.token_slice(0, n)
        return [t + LONG_ROPE_KEY for t in tokens] if req.long_rope else tokens

    def _cache_prefix(self, req: Req) -> None:
        """Hand the request's computed whole pages to the radix tree and lock them there."""
        n = req.written_len - req.written_len % self.page_size
        if self.cache.disabled or n <= req.tree_len:
            return
        tokens = self._cache_key(req, n)
        held = self.cache.insert(tokens, req.pages[:n // self.page_size])
        if held > req.tree_len:  # someone cached the same tokens meanwhile: use theirs
            self.allocator.free(req.pages[req.tree_len // self.page_size:held // self.page_size])
        pages, node = self.cache.match_prefix(tokens)
        first = req.tree_len // self.page_size  # pages before it were the tree's already
        if pages[first:] != req.pages[first:len(pages)]:
            req.set_pages(first, pages[first:] + req.pages[len(pages):])
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node, req.tree_len = node, n

    def _release_kv(self, req: Req) -> None:
        if req.last_node is None:
            return
        self._cache_prefix(req)
        self.allocator.free(req.pages[req.tree_len // self.page_size:])
        self.cache.unlock(req.last_node)
        req.set_pages(0, [])
        req.last_node, req.kv_len, req.tree_len, req.draft_len = None, 0, 0, 0

    # ---- finishing --------------------------------------------------------------------
    def _append_tokens(self, req: Req, tokens: list[int], out: BatchOutput, j: int) -> RequestOutput:
        """Append a step's tokens (several when proposals were accepted) up to the first that
        ends the request; one record of those appended."""
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        record = RequestOutput(req.rid, [], prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens)
        if req.params.logprobs and out.logprobs is not None:  # such requests never speculate: one token
            req.logprobs.append(out.logprobs[j])
            record.logprobs = [out.logprobs[j]]
            if req.params.top_logprobs and out.top_logprobs is not None:
                req.top_logprobs.append(out.top_logprobs[j])
                record.top_logprobs = [out.top_logprobs[j]]
        for m, token in enumerate(tokens):
            if m:
                req.kv_len += 1  # the token before it was an accepted proposal: its KV is written
            req.output_ids.append(token)
            record.token_ids.append(token)
            reason, stop = self._finish_reason(req, token)
            if req.constraint is not None and reason is None:
                reason, stop = self._grammar_finish(req, token)
            if reason is not None:
                req.matched_stop = stop
                done = self._finish(req, reason, req.error, req.error_param)
                record.finish_reason, record.matched_stop, record.queue_time = reason, stop, done.queue_time
                record.error, record.status, record.param = done.error, done.status, done.param
                break
        record.completion_tokens = len(req.output_ids)
        return record

    def _grammar_finish(self, req: Req, token: int) -> tuple[FinishReason | None, int | None]:
        """Advance req's matcher over token: STOP once the grammar is complete."""
        if req.constraint.accept(token):
            return (FinishReason.STOP, None) if req.constraint.terminated else (None, None)
        if self.grammars.allows_nothing(req.constraint):
            # The grammar led to a dead end (its mask allowed no token, so the sampler drew
            # from -inf logits): the request's own grammar is at fault, a 4xx.
            kind = req.constraint.kind
            req.error = (f"the {kind} allows no token after {len(req.output_ids) - 1} output tokens: "
                         "no output can complete it")
            req.error_param = kind
        else:
            # The sampler only draws allowed tokens; one that is not means the mask and
            # the matcher disagree. End the request rather than emit off-grammar text.
            req.error = f"token {token} does not match the grammar"
        return FinishReason.ABORT, None

    def _finish_reason(self, req: Req, token: int) -> tuple[FinishReason | None, int | None]:
        p, n = req.params, len(req.output_ids)
        if n >= p.min_new_tokens and (token in p.stop_token_ids
                                      or (not p.ignore_eos and token in self.eos_token_ids)):
            return FinishReason.STOP, token
        # The next step needs KV for all seq_len tokens. A request that alone would outgrow
        # the pool ends here, where its record reaches the caller (schedule() has no way to
        # report a finish), and never sits retracted with more KV than the pool holds.
        seen = len(req.prompt_ids) + n  # seq_len also counts tokens later steps still owe
        if (n >= p.max_new_tokens or seen >= self.context_len
                or self._pages_for(seen) > self.allocator.capacity):
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None, param: str | None = None
                ) -> RequestOutput:
        """End req wherever it is; its last record. An error with a param is the request's fault
        (a 400 naming that field), one without the server's (a 500)."""
        req.finish_reason, req.error = reason, error
        if req.constraint is not None:
            req.constraint.release()
            req.constraint = None
        if req.status == Status.RUNNING:
            self._release_kv(req)
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self._num_waiting -= 1  # its heap entry is dropped when it surfaces
        req.status = Status.FINISHED
        if req.sid >= 0:
            self._released_sids.append(req.sid)
            self._free_sids.append(req.sid)
        del self.reqs[req.rid]
        if self.on_finish is not None:
            self.on_finish(req)
        return RequestOutput(req.rid, finish_reason=reason, matched_stop=req.matched_stop,
                             prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                             cached_tokens=req.cached_tokens, queue_time=req.queue_time, error=error,
                             status=400 if param is not None else 500, param=param)

    # ---- waiting queue ----------------------------------------------------------------
    def _push_waiting(self, req: Req) -> None:
        heapq.heappush(self._waiting, (-req.priority, req.seq, req))
        self._num_waiting += 1

    def _pop_waiting(self) -> Req | None:
        req = self._peek_waiting()
        if req is not None:
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
        return req

    def _peek_waiting(self) -> Req | None:
        while self._waiting and self._waiting[0][2].status != Status.WAITING:
            heapq.heappop(self._waiting)  # finished while it waited
        return self._waiting[0][2] if self._waiting else None

    # ---- the batch message ------------------------------------------------------------
    def _build_batch(self, batch: list[tuple[Req, int]], spec_rows: dict[int, SpecRow]) -> BatchInput:
        self._step += 1
        input_ids: list[int] = []
        specs = []
        updates = []
        step = StepInFlight([req for req, _ in batch], self.clock())
        for req, n in batch:
            input_ids.extend(req.input_slice(req.kv_len, req.kv_len + n))
            k = spec_rows[id(req)].k if id(req) in spec_rows else 0
            if req.in_prefill:
                step.prefill_cost += self._cost(req, n)
            else:
                step.decode_tokens += n + k
            updates.append(req.page_update(self._pages_for(req.kv_len + n + k)))
            if not req.spec_sent:
                specs.append(self._spec(req))
                req.spec_sent = True
        released, self._released_sids = self._released_sids, []
        self._inflight[self._step] = step
        out = BatchInput(
            step=self._step,
            sids=[req.sid for req, _ in batch],
            input_ids=input_ids,
            prefix_lens=[req.kv_len for req, _ in batch],
            extend_lens=[n for _, n in batch],
            page_starts=[start for start, _ in updates],
            new_pages=[pages for _, pages in updates],
            sample=[req.kv_len + n == req.seq_len for req, n in batch],
            output_lens=[len(req.output_ids) + req.pending for req, _ in batch],
            new_specs=specs,
            released_sids=released,
            token_masks=self._token_masks(batch, spec_rows),
            rope_long=[req.long_rope for req, _ in batch] if self.long_rope_after is not None else [],
            **self._spec_fields(batch, spec_rows),
        )
        speculating = self.spec is not None and self.spec.active(len(self.running))
        for (req, n), sample in zip(batch, out.sample):
            req.kv_len += n
            req.unwritten += n
            req.inflight_steps += 1
            if sample:
                req.pending += 1
                # While speculation is on, a request waits for its token: proposals need it.
                req.chainable = req.constraint is None and not speculating
        return out

    def _token_masks(self, batch: list[tuple[Req, int]], spec_rows: dict[int, SpecRow]) -> dict[int, bytes]:
        """Per constrained row that samples, the bitmask of allowed next tokens; for a row
        verifying proposals, one after each proposal too (k + 1, concatenated)."""
        rows = [i for i, (req, n) in enumerate(batch) if req.constraint is not None and req.kv_len + n == req.seq_len]
        if not rows:
            return {}
        start = time.perf_counter()
        masks = {}
        for i in rows:
            req = batch[i][0]
            row = spec_rows.get(id(req))
            masks[i] = self.grammars.masks(req.constraint, row.proposals if row else [])
        self._mask_seconds += time.perf_counter() - start
        return masks

    def _spec_fields(self, batch: list[tuple[Req, int]], spec_rows: dict[int, SpecRow]) -> dict:
        if not spec_rows:
            return {}
        rows = [spec_rows.get(id(req)) for req, _ in batch]
        fields = {"spec_lens": [row.k if row else 0 for row in rows],
                  "proposed_ids": [t for row in rows if row for t in row.proposals]}
        if self.spec.algorithm == "standalone":
            fields["catchup_lens"] = [len(row.catchup) if row else 0 for row in rows]
            fields["catchup_ids"] = [t for row in rows if row for t in row.catchup]
            fields["draft_prefix_lens"] = [req.draft_len for req, _ in batch]
        return fields

    def _spec(self, req: Req) -> SamplingSpec:
        p = req.params
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        prompt = req.prompt_ids if p.repetition_penalty != 1.0 else []
        return SamplingSpec(req.sid, p, stops, prompt, list(req.output_ids) if p.penalised else [])

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        ps = self.page_size
        private = sum(len(r.pages) - r.tree_len // ps for r in self.running)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self._num_waiting,
            kv_total_tokens=self.allocator.capacity * ps,
            kv_free_tokens=self.allocator.num_free * ps,
            kv_locked_tokens=(private + self.cache.locked_pages) * ps,
            kv_cached_tokens=self.cache.evictable_pages * ps,
            prompt_tokens_total=self._prompt_tokens_total,
            cached_prompt_tokens_total=self._cached_tokens_total,
            num_retractions_total=self._retractions_total,
            spec=self.spec_stats.to_dict() if self.spec is not None else None,
            adaptive=self.limits.to_dict(),
            grammar=self._grammar_stats(),
        )

    def _grammar_stats(self) -> dict[str, Any] | None:
        if self.grammars is None:
            return None
        return {**self.grammars.stats(), "mask_seconds": self._mask_seconds, "step_seconds": self._step_seconds,
                "mask_step_share": self._mask_seconds / self._step_seconds if self._step_seconds else 0.0}

    def check(self) -> None:
        """Every page is free, privately held by one running request, or in the tree (locked
        or evictable), exactly once. Raises AssertionError otherwise."""
        ps = self.page_size
        tree = self.cache.check()
        tree_set = set(tree)
        private: list[int] = []
        for req in self.running:
            shared = req.pages[:req.tree_len // ps]
            assert set(shared) <= tree_set, f"request {req.rid} maps pages the tree lacks"
            private.extend(req.pages[req.tree_len // ps:])
        every = tree + private + self.allocator.free_pages()
        assert len(every) == len(set(every)), "a KV page is owned twice"
        assert sorted(every) == list(range(1, self.allocator.num_pages)), "a KV page is lost"
        if not self.running:
            assert self.cache.locked_pages == 0, "locked pages with no running request"
        if self.grammars is not None and not self.reqs:
            assert self.grammars.live == 0, f"{self.grammars.live} grammar matchers outlive their requests"


def make_limits(cfg: EngineConfig, kv_total_tokens: int) -> StepLimits:
    """Fixed limits, or adaptive ones when a latency target is set."""
    if cfg.target_itl_ms is None:
        return StepLimits(cfg.chunked_prefill_size, cfg.max_running_requests)
    ttft = None if cfg.target_ttft_ms is None else cfg.target_ttft_ms / 1e3
    return AdaptiveLimits(cfg.chunked_prefill_size, cfg.max_running_requests, kv_total_tokens,
                          cfg.target_itl_ms / 1e3, ttft, cfg.adaptive_window_s)


def step_log_line(batch: BatchInput, seconds: float, stats: SchedulerStats) -> str:
    """One line about a processed step (--log-steps): what it computed and what it cost, so a slow
    step can be told apart from a long queue: prompt chunks with their tokens and the cached
    tokens they attend over, decode rows (and proposals verified), the load, KV use, the time."""
    decode = {i for i, (n, out) in enumerate(zip(batch.extend_lens, batch.output_lens)) if n == 1 and out > 0}
    prompt = [i for i in range(len(batch.sids)) if i not in decode]
    tokens = sum(batch.extend_lens[i] for i in prompt)
    cached = sum(batch.prefix_lens[i] for i in prompt)
    proposed = sum(batch.spec_lens) if batch.spec_lens else 0
    # What running requests hold, as /metrics counts it: evictable cached pages are free for the taking.
    used = stats.kv_locked_tokens / max(1, stats.kv_total_tokens)
    return (f"step {batch.step}: prompt chunks {len(prompt)} ({tokens} tokens over {cached} cached), "
            f"decodes {len(decode)}" + (f" (+{proposed} proposed)" if proposed else "")
            + f", running {stats.num_running}, waiting {stats.num_waiting}, KV {used:.1%} used, "
            f"{seconds * 1000:.1f} ms")
