"""The real Scheduler against a fake model runner (pure Python, no torch), as the scheduler
tests drive it (test_scheduler's docstring says what the fake runner catches).

The fake runner keeps a real "KV cache": every page holds the token ids written into its slots.
A forward step writes the batch's input ids at their positions through the page tables and,
where the batch samples, reads the request's whole history back through its page table and
returns a token that is a pure function of that history. With depth=2 the harness drives the
scheduler as the server's overlap loop does; with a window, each row reads back only what its
queries attend.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict, deque

from relay.config import EngineConfig
from relay.memory.kv_allocator import FREED_PAGE, pages_behind_window
from relay.outputs import FinishReason, RequestOutput
from relay.sampling_params import SamplingParams
from relay.scheduling.request import Req
from relay.scheduling.scheduler import Scheduler
from relay.step import PENDING_TOKEN, BatchInput, BatchOutput

VOCAB = 64
EOS = 63


def hash_token(history: tuple[int, ...]) -> int:
    """Deterministic, well-mixed next token; EOS about once in VOCAB tokens."""
    h = 0x811C9DC5
    for t in history:
        h = ((h ^ (t + 1)) * 0x01000193) & 0xFFFFFFFF
    return (h >> 7) % VOCAB


def counting_token(history: tuple[int, ...]) -> int:
    """Token = position: output i of a prompt of length P is P + i (mod VOCAB)."""
    return len(history) % VOCAB


class Harness:
    def __init__(
        self,
        *,
        num_pages: int = 256,
        page_size: int = 4,
        budget: int = 64,
        max_running: int = 256,
        context_len: int = 4096,
        eos: tuple[int, ...] = (EOS,),
        disable_cache: bool = False,
        token_fn=hash_token,
        attention_break_even: int | None = None,
        depth: int = 1,
        stall_ms: float = 0.0,
        clock=time.monotonic,
        window: int | None = None,
    ):
        self.cfg = EngineConfig(
            page_size=page_size,
            chunked_prefill_size=budget,
            max_running_requests=max_running,
            disable_radix_cache=disable_cache,
            max_decode_stall_ms=stall_ms,
        )
        self.s = Scheduler(
            self.cfg,
            num_pages,
            context_len,
            list(eos),
            attention_break_even=attention_break_even,
            clock=clock,
            kv_window=window,
        )
        self.ps, self.budget, self.token_fn, self.window = page_size, budget, token_fn, window
        self.kv: dict[int, list[int | None]] = {}
        self.specs: dict[int, object] = {}
        self.events: dict[str, list[RequestOutput]] = defaultdict(list)
        self.final: dict[str, RequestOutput] = {}
        self.tables: dict[
            int, list[int]
        ] = {}  # the runner's page tables, kept from the batches' changes
        self.reqs: dict[str, Req] = {}
        self.batches: list[tuple[BatchInput, list[Req]]] = []
        self.steps = 0
        self.depth = depth  # steps out at once: 2 is overlap scheduling
        self.inflight: deque[tuple[BatchInput, BatchOutput]] = deque()
        self.last_tokens: dict[int, int] = {}  # the runner's: sid -> its token sampled last

    # ---- requests -------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], priority: int = 0, **params) -> Req:
        req = Req(
            rid,
            list(prompt),
            SamplingParams(**params),
            priority=priority,
            arrival_time=self.s.clock(),
        )
        self.s.add_request(req)
        self.reqs[rid] = req
        return req

    def abort(self, rid: str) -> None:
        ev = self.s.abort(rid)
        if ev is not None:
            self._record(ev)

    def _record(self, ev: RequestOutput) -> None:
        assert ev.rid not in self.final, f"{ev.rid} got events after it finished"
        self.events[ev.rid].append(ev)
        if ev.finish_reason is not None:
            self.final[ev.rid] = ev

    # ---- the loop -------------------------------------------------------------------
    def step(self, abort_mid_step: list[str] = (), during=None) -> BatchInput | None:
        """One round of the server's loop: build a step (while fewer than `depth` are out)
        and run it; then, with `depth` out or nothing new built, process the oldest.
        Aborts and `during()` run while steps are out, as the server handles messages then.
        Returns the step built, else the one processed, else None (nothing to do)."""
        had_work = self.s.has_work
        batch = self.s.schedule() if len(self.inflight) < self.depth and had_work else None
        self.s.check()
        if batch is None and not self.inflight:
            assert not had_work or not self.s.has_work, (
                "livelock: work queued but nothing scheduled"
            )
            return None
        if batch is not None:
            self.steps += 1
            by_sid = {r.sid: r for r in self.s.table.running}
            assert len(by_sid) == len(self.s.table.running), "two running requests share a sid"
            assert len(set(batch.sids)) == len(batch.sids), "a request is twice in one batch"
            reqs = [by_sid[sid] for sid in batch.sids]
            self._validate(batch, reqs)
            self.batches.append((batch, reqs))
            self.inflight.append((batch, self._run_model(batch, reqs)))
        for rid in abort_mid_step:
            self.abort(rid)
            self.s.check()
        if during is not None:
            during()
        if batch is not None and len(self.inflight) < self.depth:
            return batch
        done, out = self.inflight.popleft()
        for ev in self.s.process_output(done, out):
            self._record(ev)
        self.s.check()
        return batch or done

    def _validate(self, batch: BatchInput, reqs: list[Req]) -> None:
        assert 0 < batch.num_tokens <= self.budget, "step over the token budget"
        assert len(reqs) <= self.cfg.max_running_requests
        assert len(self.s.table.running) <= self.cfg.max_running_requests
        assert sum(batch.extend_lens) == batch.num_tokens
        assert len(set(batch.released_sids)) == len(batch.released_sids)
        # The runner drops released sids before it installs the new specs and page tables.
        for sid in batch.released_sids:
            self.specs.pop(sid, None)
            self.tables.pop(sid, None)
            self.last_tokens.pop(sid, None)
        by_sid = {r.sid: r for r in reqs}
        for spec in batch.new_specs:
            # Sent again for a live sid only after a retraction, with the output it restarts from.
            again = spec.sid in self.specs
            assert not again or (
                by_sid[spec.sid].num_retractions and spec.output_ids == by_sid[spec.sid].output_ids
            ), "a spec for a sid that is still live"
            self.specs[spec.sid] = spec
        tree_pages = set(self.s.kv.cache.check())
        pos = 0
        for i, req in enumerate(reqs):
            p, n = batch.prefix_lens[i], batch.extend_lens[i]
            assert self.specs[batch.sids[i]].params is req.params, "runner lacks the request's spec"
            # Building the step counted its sampled token as pending (in seq_len).
            sample = batch.sample[i]
            assert n >= 1 and p + n + sample <= req.seq_len
            assert batch.sample[i] == (p + n == req.seq_len - sample)
            assert batch.input_ids[pos : pos + n] == req.input_slice(p, p + n)
            assert PENDING_TOKEN not in batch.input_ids[pos : pos + n - 1], (
                "only a decode's one input is pending"
            )
            assert batch.output_lens[i] == len(req.output_ids) + req.pending - sample
            held = self.tables.setdefault(batch.sids[i], [])
            assert batch.page_starts[i] <= len(held), "a page update with a gap"
            del held[batch.page_starts[i] :]
            held.extend(batch.new_pages[i])
            table = held
            assert table == req.pages[: len(table)], (
                "the runner's page table differs from the scheduler's"
            )
            assert len(table) == -(-(p + n) // self.ps)
            behind = pages_behind_window(p, self.window, self.ps)
            assert FREED_PAGE not in table[behind:], "a page the step reads is unmapped"
            # New KV only goes into pages the request holds privately: never into a tree page
            # another request may map.
            for q in range(p, p + n):
                assert table[q // self.ps] not in tree_pages, "a write into a shared page"
            pos += n

    def _run_model(self, batch: BatchInput, reqs: list[Req]) -> BatchOutput:
        """Write the inputs' KV, fill pending inputs from the runner's last tokens, and sample
        each sampling row from its whole history read back through its page table."""
        fill = lambda sid, ids: [self.last_tokens[sid] if t == PENDING_TOKEN else t for t in ids]  # noqa: E731
        pos, out = 0, []
        for i, sid in enumerate(batch.sids):
            p, n, table = batch.prefix_lens[i], batch.extend_lens[i], self.tables[sid]
            for q, tok in zip(range(p, p + n), fill(sid, batch.input_ids[pos : pos + n])):
                self.kv.setdefault(table[q // self.ps], [None] * self.ps)[q % self.ps] = tok
            pos += n
        ps = self.ps
        for i, sid in enumerate(batch.sids):
            p, n, table = batch.prefix_lens[i], batch.extend_lens[i], self.tables[sid]
            # What the row's queries attend: everything, or from the first one's window on.
            lo = 0 if self.window is None else max(0, p - self.window + 1)
            if batch.sample[i] or lo:
                unwritten = [None] * self.ps
                seen = [self.kv.get(table[q // ps], unwritten)[q % ps] for q in range(lo, p + n)]
                history = fill(sid, reqs[i].input_slice(0, p + n))
                assert seen == history[lo:], "the KV cache holds the wrong tokens"
            if batch.sample[i]:
                out.append(self.token_fn(tuple(history)))
                self.last_tokens[sid] = out[-1]
        sampled = [sid for sid, s in zip(batch.sids, batch.sample) if s]
        if any(self.specs[sid].params.logprobs for sid in sampled):
            # Like the real runner: one entry per sampled row when any row asks for them.
            return BatchOutput(
                batch.step,
                out,
                logprobs=[fake_logprob(t) for t in out],
                top_logprobs=[[[t], [fake_logprob(t)]] for t in out],
            )
        return BatchOutput(batch.step, out)

    def run(self, max_steps: int = 10_000) -> None:
        while self.s.has_work or self.inflight:
            assert self.steps < max_steps, "no progress: too many steps"
            self.step()
        self.assert_idle()

    def assert_idle(self) -> None:
        s = self.s
        assert (
            not s.has_work
            and not s.table.running
            and len(s.table.waiting) == 0
            and not s.table.reqs
        )
        s.check()
        st_ = s.stats()
        assert st_.kv_locked_tokens == 0
        assert st_.kv_free_tokens + st_.kv_cached_tokens == st_.kv_total_tokens
        assert s.kv.cache.locked_pages == 0

    # ---- expectations ---------------------------------------------------------------
    def outputs(self, rid: str) -> list[int]:
        return [t for ev in self.events[rid] for t in ev.token_ids]

    def assert_finished_correctly(self, rid: str) -> None:
        """The request ended once, with the reason its tokens call for."""
        req, ev = self.reqs[rid], self.final[rid]
        out = self.outputs(rid)
        assert out == req.output_ids
        assert ev.completion_tokens == len(out) and ev.prompt_tokens == len(req.prompt_ids)
        # Every token is the runner's function of the history before it.
        for i, tok in enumerate(out):
            assert tok == self.token_fn(tuple(req.prompt_ids + out[:i]))
        if ev.finish_reason == FinishReason.ABORT:
            return
        p = req.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.s.eos_token_ids))
        for i, tok in enumerate(out[:-1]):
            assert not (i + 1 >= p.min_new_tokens and tok in stops), "ran past a stop token"
        if ev.finish_reason == FinishReason.STOP:
            assert out[-1] in stops and len(out) >= p.min_new_tokens
            assert ev.matched_stop == out[-1]
        else:
            assert ev.finish_reason == FinishReason.LENGTH
            assert ev.matched_stop is None
            # The next step would need KV for all seq_len tokens: past the pool it cannot run.
            seq_len, pool = len(req.prompt_ids) + len(out), self.s.kv.allocator.capacity * self.ps
            assert (
                len(out) == p.max_new_tokens or seq_len == self.s.context_len or seq_len == pool + 1
            ), "stopped early for no reason"
        # Never past a limit, and not stopped one token late.
        assert len(out) <= p.max_new_tokens and len(req.prompt_ids) + len(out) <= self.s.context_len
        assert len(req.prompt_ids) + len(out) <= self.s.kv.allocator.capacity * self.ps + 1


def fake_logprob(token: int) -> float:
    return -(token + 1) / 100


def prompt(n: int, seed: int, alphabet: int = VOCAB - 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(alphabet) for _ in range(n)]
