"""Scheduler policy tests against a fake model runner (pure Python, no torch).

The fake runner keeps a real "KV cache": every page holds the token ids written into its
slots. A forward step writes the batch's input ids at their positions through the page
tables and, where the batch samples, reads the request's whole history back through its
page table and returns a token that is a pure function of that history. So a page table
that maps the wrong page, a page freed and reused while still mapped, or a shared page
that is overwritten all show up as a wrong history, and recomputation after retraction
yields exactly the tokens a huge pool would have produced.

With depth=2 the harness drives the scheduler as the server's overlap loop does: step N+1 is
built (and run: the runner takes steps in order) before step N's output is processed, and
the fake runner fills PENDING_TOKEN inputs with the token it sampled last for that request.

With a window (a model whose every layer slides), each row reads back only what its queries
attend (the window before its first new token, and its new tokens): the pages behind it may be
given back (FREED_PAGE in the table) and reused, and a page given back too early shows up as a
wrong history.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.outputs import FinishReason, RequestOutput
from relay.sampling_params import InvalidParam
from relay.scheduling.request import Req, Status
from relay.scheduling.scheduler import Scheduler
from relay.scheduling.scheduler_stats import step_log_line
from relay.step import PENDING_TOKEN, BatchInput, BatchOutput
from tests.helpers.scheduler_harness import (
    EOS,
    VOCAB,
    Harness,
    counting_token,
    fake_logprob,
    hash_token,
    prompt,
)

# ---- finishing -------------------------------------------------------------------------


def test_step_log_line_tells_prompt_chunks_from_decodes():
    """--log-steps: a step's prompt chunks (their tokens, and the cached tokens they attend over)
    are told apart from its decode rows."""
    h = Harness(budget=64, page_size=4)
    shared = list(range(1, 33))
    h.add("a", shared + [40], max_new_tokens=8)
    while not h.events["a"]:
        h.step()  # "a" has its first token: its prompt is cached
    h.add("b", shared + [41, 42, 43], max_new_tokens=8)
    batch = h.step()
    line = step_log_line(batch, 0.0123, h.s.stats())
    # "b" reuses the 32 cached prompt tokens (8 pages) and computes its last 3; "a" decodes.
    assert line.startswith(
        f"step {batch.step}: prompt chunks 1 (3 tokens over 32 cached), decodes 1, running 2"
    )
    assert line.endswith("12.3 ms")


def test_length_at_max_new_tokens():
    h = Harness(eos=(), token_fn=hash_token)
    for i in range(4):
        h.add(f"r{i}", prompt(10 + i, i), max_new_tokens=5 + i)
    h.run()
    for i in range(4):
        assert h.final[f"r{i}"].finish_reason == FinishReason.LENGTH
        assert len(h.outputs(f"r{i}")) == 5 + i
        h.assert_finished_correctly(f"r{i}")


def test_stop_on_eos_unless_ignore_eos():
    # counting_token: a 10-token prompt produces 10, 11, 12, ...
    h = Harness(eos=(13,), token_fn=counting_token)
    h.add("eos", list(range(10)), max_new_tokens=20)
    h.add("ignore", list(range(10)), max_new_tokens=20, ignore_eos=True)
    h.run()
    assert h.outputs("eos") == [10, 11, 12, 13]
    assert h.final["eos"].finish_reason == FinishReason.STOP and h.final["eos"].matched_stop == 13
    assert h.outputs("ignore") == list(range(10, 30))
    assert h.final["ignore"].finish_reason == FinishReason.LENGTH
    for rid in ("eos", "ignore"):
        h.assert_finished_correctly(rid)


def test_stop_token_ids_and_min_new_tokens():
    h = Harness(eos=(12,), token_fn=counting_token)
    h.add("stop_ids", list(range(10)), max_new_tokens=20, stop_token_ids=[15, 11])
    h.add("min_new", list(range(10)), max_new_tokens=20, min_new_tokens=4, stop_token_ids=[11])
    h.add("min_new_eos", [1] * 10, max_new_tokens=20, min_new_tokens=3, stop_token_ids=[])
    h.add(
        "stop_even_ignoring_eos",
        list(range(10)),
        max_new_tokens=20,
        ignore_eos=True,
        stop_token_ids=[14],
    )
    h.run()
    assert h.outputs("stop_ids") == [10, 11] and h.final["stop_ids"].matched_stop == 11
    # min_new_tokens=4 suppresses stopping on 11 (2nd) and eos 12 (3rd); 13 is no stop token,
    # and no stop comes later: it runs to the length limit.
    assert h.outputs("min_new") == list(range(10, 30))
    assert h.final["min_new"].finish_reason == FinishReason.LENGTH
    # eos 12 is the 3rd token: exactly min_new_tokens, so it stops there.
    assert (
        h.outputs("min_new_eos") == [10, 11, 12]
        and h.final["min_new_eos"].finish_reason == FinishReason.STOP
    )
    assert h.outputs("stop_even_ignoring_eos") == [10, 11, 12, 13, 14]
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_length_at_the_context_limit():
    h = Harness(eos=(), context_len=20)
    h.add("r", prompt(15, 1), max_new_tokens=100)
    h.run()
    assert h.final["r"].finish_reason == FinishReason.LENGTH
    assert len(h.outputs("r")) == 5  # 15 + 5 == context_len
    h.assert_finished_correctly("r")


def test_length_when_the_sequence_outgrows_the_pool():
    """A request that alone fills the KV pool ends with "length", and the caller hears it."""
    ps = 4
    h = Harness(num_pages=5, page_size=ps, eos=(), context_len=4096)  # 16 KV tokens
    h.add("r", prompt(10, 2), max_new_tokens=100)
    h.run(max_steps=100)
    assert "r" in h.final, "the request ended without telling the caller"
    assert h.final["r"].finish_reason == FinishReason.LENGTH
    assert len(h.outputs("r")) == 7  # the 17th token is the last: the next step needs a 5th page
    h.assert_finished_correctly("r")


def test_finish_from_outside_the_scheduler():
    h = Harness(eos=())
    h.add("r", prompt(8, 3), max_new_tokens=50)
    h.step()
    h.step()
    h.s.stop("r", "stop string")  # the detokenizer already told the client: no record back
    assert h.reqs["r"].finished and h.reqs["r"].finish_reason == FinishReason.STOP
    assert h.reqs["r"].matched_stop == "stop string" and "r" not in h.final
    h.s.stop("r", "again")  # a second stop (or one for an unknown id) is a no-op
    h.assert_idle()


def test_runner_error_aborts_the_batch():
    h = Harness(eos=(), max_running=3)
    h.add("a", prompt(8, 1), max_new_tokens=50)
    h.add("b", prompt(8, 2), max_new_tokens=50)
    h.add("c", prompt(8, 3), max_new_tokens=50)
    h.add("waiting", prompt(8, 4), max_new_tokens=50, priority=-1)
    h.step()
    batch = h.s.schedule()
    assert h.s.abort("c").finish_reason == FinishReason.ABORT  # while the failing step runs
    events = h.s.process_output(batch, BatchOutput(batch.step, [], error="boom"))
    assert {e.rid for e in events} == {"a", "b"}
    assert all(e.finish_reason == FinishReason.ABORT and e.error == "boom" for e in events)
    h.s.check()
    assert [r.rid for r in h.s.table.reqs.values()] == ["waiting"]  # not in the batch: unharmed
    h.run()


def test_fail_all_ends_every_request():
    h = Harness(budget=8)
    h.add("run", prompt(6, 1), max_new_tokens=50)
    h.add("prefill", prompt(40, 2), max_new_tokens=50)
    h.add("wait", prompt(6, 3), max_new_tokens=50, priority=-1)
    h.step()
    h.step()
    events = h.s.fail_all("runner died")
    assert sorted(e.rid for e in events) == ["prefill", "run", "wait"]
    assert all(e.finish_reason == FinishReason.ABORT and e.error == "runner died" for e in events)
    h.assert_idle()


def test_logprobs_follow_their_own_tokens():
    """Only sampled rows carry logprobs; each request gets the ones of its own tokens."""
    h = Harness(budget=24, eos=())
    h.add("plain", prompt(5, 1), max_new_tokens=6)
    h.add("lp", prompt(30, 2), max_new_tokens=6, logprobs=True)  # chunked: not sampled at first
    h.add("top", prompt(7, 3), max_new_tokens=6, logprobs=True, top_logprobs=1)
    h.run()
    assert h.reqs["plain"].logprobs == [] and h.reqs["plain"].top_logprobs == []
    for rid in ("lp", "top"):
        toks = h.outputs(rid)
        assert h.reqs[rid].logprobs == [fake_logprob(t) for t in toks]
        assert [lp for ev in h.events[rid] for lp in ev.logprobs or []] == h.reqs[rid].logprobs
    assert h.reqs["lp"].top_logprobs == []
    assert h.reqs["top"].top_logprobs == [[[t], [fake_logprob(t)]] for t in h.outputs("top")]


def test_sampling_specs_are_sent_once_with_their_stop_ids():
    h = Harness(eos=(EOS, 5), budget=8)
    h.add("a", prompt(20, 1), max_new_tokens=3, stop_token_ids=[9])
    h.add(
        "b",
        prompt(4, 2),
        max_new_tokens=3,
        ignore_eos=True,
        stop_token_ids=[7],
        repetition_penalty=1.2,
    )
    h.run()
    specs = [spec for batch, _ in h.batches for spec in batch.new_specs]
    assert len(specs) == 2
    by_sid = {spec.sid: spec for spec in specs}
    a, b = by_sid[h.reqs["a"].sid], by_sid[h.reqs["b"].sid]
    assert a.stop_token_ids == [5, 9, EOS] and a.prompt_ids == []
    assert b.stop_token_ids == [7] and b.prompt_ids == h.reqs["b"].prompt_ids


# ---- batching ------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    h = Harness(budget=32, page_size=4)
    h.add("long", prompt(100, 5), max_new_tokens=3, ignore_eos=True)
    chunks = []
    while h.s.has_work:
        batch = h.step()
        chunks.append((batch.prefix_lens[0], batch.extend_lens[0], batch.sample[0]))
    assert chunks == [
        (0, 32, False),
        (32, 32, False),
        (64, 32, False),
        (96, 4, True),
        (100, 1, True),
        (101, 1, True),
    ]
    h.assert_finished_correctly("long")


def test_decodes_are_in_every_step_and_share_the_budget_with_prefill():
    h = Harness(budget=16, page_size=4)
    for i in range(3):
        h.add(f"d{i}", prompt(5, i), max_new_tokens=40, ignore_eos=True)
    h.step()  # all three prompts fit in one step
    h.add("long", prompt(90, 9), max_new_tokens=2, ignore_eos=True)
    saw_prefill = 0
    while h.s.has_work:
        decoding = {r.rid for r in h.s.table.running if not r.in_prefill}
        batch = h.step()
        reqs = h.batches[-1][1]
        in_batch = {r.rid for r in reqs}
        assert decoding <= in_batch, "a decoding request was left out of a step"
        assert batch.num_tokens <= 16
        for r, n in zip(reqs, batch.extend_lens):
            if r.rid == "long" and n > 1:
                saw_prefill += 1
                assert n <= 16 - len(decoding)
    assert saw_prefill >= 90 // 13
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_a_short_request_starts_in_the_next_step_behind_a_long_prompt():
    """Running prompts' chunks leave room for waiting requests: a short prompt that arrives
    while a long one is being prefilled is computed in the very next step (main admitted it
    only after the whole long prompt)."""
    h = Harness(budget=64, page_size=4, num_pages=1024)
    h.add("long", prompt(2000, 1), max_new_tokens=2, ignore_eos=True)
    h.step()
    h.add("short", prompt(10, 2), max_new_tokens=3, ignore_eos=True)
    batch = h.step()
    rows = {r.rid: (n, s) for r, n, s in zip(h.batches[-1][1], batch.extend_lens, batch.sample)}
    assert rows["short"] == (10, True), "the short prompt is computed whole, with its first token"
    assert rows["long"][0] == 64 - 10, "what the short request leaves goes to the long prompt"
    assert len(h.events["short"]) == 1
    h.run()
    h.assert_finished_correctly("long")
    h.assert_finished_correctly("short")


def test_a_lone_long_prompt_still_gets_the_whole_budget():
    h = Harness(budget=64, page_size=4)
    h.add("long", prompt(300, 1), max_new_tokens=1, ignore_eos=True)
    assert [h.step().extend_lens[0] for _ in range(4)] == [64] * 4


class StepClock:
    """A clock the test moves: `seconds_per_step` for every step the harness builds."""

    def __init__(self, seconds_per_step: float):
        self.now, self.per_step = 0.0, seconds_per_step

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.per_step


class BurstHarness(Harness):
    """Steps of 0.1 s (StepClock), budget 16, and decodes that yield after stall_ms."""

    def __init__(self, stall_ms: float, **kwargs):
        self.clock = StepClock(0.1)
        super().__init__(budget=16, page_size=4, stall_ms=stall_ms, clock=self.clock, **kwargs)

    def step(self, *args, **kwargs):
        batch = super().step(*args, **kwargs)
        self.clock.tick()
        return batch

    def start(self, rids: list[str], priority: int = 0) -> None:
        """Requests with 5-token prompts, decoding after two steps."""
        for i, rid in enumerate(rids):
            self.add(rid, prompt(5, i), priority=priority, max_new_tokens=60, ignore_eos=True)
        self.step()
        self.step()

    def burst(self, n: int, tokens: int, priority: int = 0) -> list[str]:
        rids = [f"b{len(self.reqs) + i}" for i in range(n)]
        for rid in rids:
            self.add(
                rid,
                prompt(tokens, 100 + len(self.reqs)),
                priority=priority,
                max_new_tokens=2,
                ignore_eos=True,
            )
        return rids

    def until_first_tokens(self, rids: list[str]) -> list[set[str]]:
        """Step until every one of rids has a token; the requests in each of those steps."""
        steps = []
        while any(not self.events[rid] for rid in rids):
            self.step()
            steps.append({r.rid for r in self.batches[-1][1]})
        return steps


def absences(steps: list[set[str]], rid: str) -> list[int]:
    """Lengths of the runs of consecutive steps that rid sat out."""
    runs, n = [], 0
    for rids in steps + [{rid}]:
        if rid in rids:
            runs, n = runs + [n] if n else runs, 0
        else:
            n += 1
    return runs


def test_a_burst_of_arrivals_gets_its_first_tokens_sooner_when_decodes_yield():
    """Prefill-first: once prompts have waited longer than max_decode_stall_ms with more prompt
    tokens than a step takes, started requests sit steps out, so the burst's last first token
    does not wait for all their decode rows; the burst's own first tokens also yield."""
    took = {}
    for stall_ms in (0, 250):
        h = BurstHarness(stall_ms)
        h.start(["d0", "d1", "d2"])
        took[stall_ms] = len(h.until_first_tokens(h.burst(6, 28)))
        h.run()
        for rid in h.reqs:
            h.assert_finished_correctly(rid)
    assert took[250] < took[0]


def test_a_decoding_request_yields_once_and_at_most_max_decode_stall_ms():
    h = BurstHarness(250)
    h.start(["d0", "d1"])
    steps = h.until_first_tokens(h.burst(8, 28))
    steps += h.until_first_tokens(h.burst(8, 28))  # another backlog: d0 and d1 have had their wait
    for rid in ("d0", "d1"):
        assert absences(steps, rid) == [3], "one wait of 0.25 s: three 0.1 s steps"


def test_decodes_yield_only_once_a_prompt_has_waited_longer_than_the_limit():
    h = BurstHarness(350)
    h.start(["d0"])
    steps = h.until_first_tokens(h.burst(8, 28))
    assert all("d0" in rids for rids in steps[:4]) and "d0" not in steps[4]


def test_a_higher_priority_decode_does_not_yield_to_lower_priority_prompts():
    h = BurstHarness(250)
    h.start(["vip"], priority=2)
    h.start(["d0"], priority=1)
    steps = h.until_first_tokens(h.burst(8, 28, priority=1))
    assert absences(steps, "vip") == [] and absences(steps, "d0") == [3]


@pytest.mark.parametrize("limit", [dict(max_running=2), dict(num_pages=10)])
def test_decodes_do_not_yield_to_prompts_that_cannot_run(limit):
    """A burst that cannot start (no free slot, or no KV room for its first chunk) gets
    nothing from held decodes: they run, and no step is empty."""
    h = BurstHarness(100, **limit)
    h.start(["d0", "d1"])
    h.burst(2, 20)
    for _ in range(5):
        h.step()
        assert {r.rid for r in h.batches[-1][1]} == {"d0", "d1"}


def test_prompt_chunks_shrink_with_their_prefix_so_a_step_costs_at_most_the_budget():
    """With attention priced in, a chunk deep into a long prompt holds fewer tokens: each
    step's estimated work stays within the budget instead of growing with the prefix."""
    even, budget = 64, 64
    h = Harness(budget=budget, page_size=4, attention_break_even=even)
    h.add("long", prompt(1000, 1), max_new_tokens=2, ignore_eos=True)
    chunks = []
    while h.s.has_work:
        batch = h.step()
        p, n = batch.prefix_lens[0], batch.extend_lens[0]
        if n > 1:
            chunks.append(n)
            assert n * (1 + p / even) <= budget
    assert chunks[0] == budget > chunks[-1] >= 1 and chunks == sorted(chunks, reverse=True)
    h.assert_finished_correctly("long")


def test_a_fresh_prompt_of_the_budgets_length_runs_in_one_step():
    """With attention priced (the server's default), a prompt of exactly --chunked-prefill-size
    tokens is still one step, not a full chunk and a few leftover tokens."""
    h = Harness(budget=256, page_size=4, attention_break_even=3072)
    h.add("p", prompt(256, 3), max_new_tokens=1, ignore_eos=True)
    assert h.step().extend_lens == [256]


def test_decodes_come_before_prefill_in_the_batch():
    h = Harness(budget=64)
    h.add("a", prompt(6, 1), max_new_tokens=5, ignore_eos=True)
    h.step()
    h.add("b", prompt(30, 2), max_new_tokens=5, ignore_eos=True)
    batch = h.step()
    assert [r.rid for r in h.batches[-1][1]] == ["a", "b"]
    assert batch.extend_lens == [1, 30]


def test_max_running_requests_is_respected():
    h = Harness(max_running=3, budget=256)
    for i in range(10):
        h.add(f"r{i}", prompt(7, i), max_new_tokens=4, ignore_eos=True)
    peak = 0
    while h.s.has_work:
        h.step()
        peak = max(peak, len(h.batches[-1][1]))
        assert len(h.s.table.running) <= 3
    assert peak == 3
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_sids_are_reused_and_released_sids_reported():
    h = Harness(max_running=2, budget=256)
    for i in range(5):
        h.add(f"r{i}", prompt(4, i), max_new_tokens=2 + i, ignore_eos=True)
    released, used = [], set()
    while h.s.has_work:
        batch = h.step()
        released += batch.released_sids
        used |= set(batch.sids)
    assert used == {0, 1}, "finished requests' sids are handed out again"
    # Every finished request's sid was reported once it was released (the last ones wait
    # for the next batch).
    tail = h.s.table.released_sids
    assert sorted(released + tail) == sorted(h.reqs[f"r{i}"].sid for i in range(5))
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


# ---- priority and retraction -----------------------------------------------------------


def test_priority_order_of_admission():
    h = Harness(max_running=1, budget=256)
    order = [("a", 0), ("b", 2), ("c", 1), ("d", 2), ("e", 0), ("f", 1)]
    for rid, prio in order:
        h.add(rid, prompt(5, ord(rid)), priority=prio, max_new_tokens=2, ignore_eos=True)
    admitted = []
    while h.s.has_work:
        h.step()
        for r in h.batches[-1][1]:
            if r.rid not in admitted:
                admitted.append(r.rid)
    assert admitted == ["b", "d", "c", "f", "a", "e"]


def test_priority_order_under_a_tight_pool():
    """Admission stops at the first request that does not fit: no lower one jumps ahead."""
    ps = 4
    h = Harness(num_pages=9, page_size=ps, budget=256)  # 32 KV tokens
    h.add("low_small", prompt(3, 1), priority=0, max_new_tokens=2, ignore_eos=True)
    h.add("high_big", prompt(20, 2), priority=1, max_new_tokens=8, ignore_eos=True)
    h.add("mid", prompt(14, 3), priority=1, max_new_tokens=8, ignore_eos=True)
    # high_big takes 5 of 8 pages; mid needs 4 and waits, and so must low_small, which
    # would fit in the 3 left.
    h.step()
    assert [r.rid for r in h.batches[-1][1]] == ["high_big"]
    admitted = []
    h.run()
    for _batch, reqs in h.batches:
        admitted += [r.rid for r in reqs if r.rid not in admitted]
    assert admitted == ["high_big", "mid", "low_small"]
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_high_priority_arrival_retracts_a_lower_priority_request():
    ps = 4
    h = Harness(num_pages=13, page_size=ps, budget=256)  # 48 KV tokens
    h.add("low", prompt(30, 1), priority=0, max_new_tokens=12, ignore_eos=True)
    h.step()
    h.step()
    assert [r.rid for r in h.s.table.running] == ["low"]
    h.add("high", prompt(30, 2), priority=5, max_new_tokens=4, ignore_eos=True)
    h.step()
    assert [r.rid for r in h.batches[-1][1]] == ["high"]
    assert h.reqs["low"].num_retractions == 1
    assert h.s.stats().num_retractions_total == 1
    h.run()
    assert h.final["high"].finish_reason == FinishReason.LENGTH
    for rid in h.reqs:
        h.assert_finished_correctly(rid)
    # "high" finished before "low" resumed decoding.
    steps_high = [k for k, (_, reqs) in enumerate(h.batches) if any(r.rid == "high" for r in reqs)]
    steps_low = [k for k, (_, reqs) in enumerate(h.batches) if any(r.rid == "low" for r in reqs)]
    assert max(steps_high) < max(steps_low)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_prompt_is_not_retracted_for_a_lower_priority_decode(depth):
    """The pool fills while a high-priority prompt is chunked beside a low-priority decode.
    Decodes are scheduled first, so low is in the step when high needs a page: high must
    not give way to it (the pair then retracted each other in turn, and low, retracted
    with its last token in flight, never finished)."""
    h = Harness(
        num_pages=9, page_size=4, budget=3, max_running=2, attention_break_even=4, depth=depth
    )
    h.add("high", prompt(31, 1), priority=1, max_new_tokens=1, ignore_eos=True)
    h.add("low", prompt(1, 2), priority=0, max_new_tokens=16, ignore_eos=True)
    h.run(max_steps=120)
    assert h.reqs["high"].num_retractions == 0
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def steps_until_running(h: Harness, rid: str, limit: int = 30) -> int:
    for k in range(limit):
        h.step()
        if any(r.rid == rid for r in h.batches[-1][1]):
            return k
    raise AssertionError(f"{rid} never ran")


def test_high_priority_arrival_is_not_stuck_behind_decode_headroom():
    """Room for the prompt but not for the decode headroom admission keeps: the
    lower-priority request must still make way, not run to completion first."""
    h = Harness(num_pages=4, page_size=16, budget=256)  # 3 pages of 16 tokens
    h.add("low", prompt(17, 1), priority=0, max_new_tokens=14, ignore_eos=True)  # 2 pages
    h.step()
    h.step()
    h.add("high", prompt(10, 2), priority=5, max_new_tokens=2, ignore_eos=True)  # 1 page
    assert steps_until_running(h, "high") <= 1
    assert h.reqs["low"].num_retractions == 1
    h.run()
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_high_priority_arrival_with_a_cached_prefix_and_a_long_prompt_preempts():
    """Admission of a request whose cached prefix plus first chunk need more pages than
    one budget's worth must also be able to preempt."""
    ps = 4
    h = Harness(num_pages=13, page_size=ps, budget=8)  # 12 pages
    warm = prompt(16, 3)
    h.add("warm", warm, max_new_tokens=1, ignore_eos=True)
    h.run()
    assert h.s.kv.cache.evictable_pages == 4  # warm's prompt stays cached
    h.add("low", prompt(23, 1), priority=0, max_new_tokens=30, ignore_eos=True)  # 6 pages
    for _ in range(5):
        h.step()
    h.add("high", warm + prompt(8, 4), priority=5, max_new_tokens=2, ignore_eos=True)
    assert steps_until_running(h, "high") <= 1
    assert h.reqs["high"].cached_tokens == 16
    h.run()
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_high_priority_arrival_takes_a_slot_at_max_running():
    h = Harness(max_running=2, budget=256)
    h.add("l1", prompt(5, 1), max_new_tokens=30, ignore_eos=True)
    h.add("l2", prompt(5, 2), max_new_tokens=30, ignore_eos=True)
    h.step()
    h.add("h", prompt(5, 3), priority=1, max_new_tokens=3, ignore_eos=True)
    h.step()
    assert {r.rid for r in h.s.table.running} == {"l1", "h"}  # the newest low one made room
    assert h.reqs["l2"].num_retractions == 1
    h.run()
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def run_mix(
    num_pages: int, page_size: int, budget: int, seed: int, depth: int = 1, **params
) -> tuple[Harness, dict[str, list[int]]]:
    rng = random.Random(seed)
    h = Harness(num_pages=num_pages, page_size=page_size, budget=budget, depth=depth)
    base = prompt(24, seed)
    for i in range(12):
        shared = base[: rng.randrange(0, 24)]
        h.add(
            f"r{i}",
            shared + prompt(rng.randrange(1, 20), 1000 * seed + i),
            priority=rng.randrange(2),
            max_new_tokens=rng.randrange(1, 24),
            **params,
        )
    h.run(max_steps=5000)
    return h, {rid: h.outputs(rid) for rid in h.reqs}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_tiny_pool_forces_retraction_but_tokens_match_a_huge_pool(page_size, depth):
    pages_needed = -(-(43 + 24 + 1) // page_size)  # the longest single request
    big, want = run_mix(4096, page_size, 48, seed=page_size)
    small, got = run_mix(pages_needed + 2, page_size, 48, seed=page_size, depth=depth)
    assert big.s.stats().num_retractions_total == 0
    assert small.s.stats().num_retractions_total > 0, "the small pool should force retraction"
    assert got == want
    for h in (big, small):
        for rid in h.reqs:
            assert h.final[rid].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            h.assert_finished_correctly(rid)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_retracted_penalised_request_sends_its_spec_again_with_its_output(depth):
    """The runner counts a penalised request's output tokens; after a retraction (with steps
    out, one of its tokens is dropped) its spec goes again, carrying the output it restarts
    from (the harness checks that), and only then: an unpenalised one's is sent once."""
    for penalty, resent in ((0.5, True), (0.0, False)):
        h, _ = run_mix(19, 4, 48, seed=4, depth=depth, frequency_penalty=penalty)
        specs = sum(len(b.new_specs) for b, _ in h.batches)
        assert h.s.stats().num_retractions_total > 0
        assert (specs > len(h.reqs)) == resent


def record_retractions(s: Scheduler) -> list[tuple[str, str, list[int], int]]:
    """Patch s.table.retract to log (rid, status, pages, evictable pages) right after each one."""
    log, retract = [], s.table.retract

    def spy(victim: Req) -> None:
        retract(victim)
        s.check()
        log.append((victim.rid, victim.status, list(victim.pages), s.kv.cache.evictable_pages))

    s.table.retract = spy
    return log


def test_retracted_request_resumes_from_its_cached_pages():
    ps = 4
    h = Harness(num_pages=13, page_size=ps, budget=256)  # 12 pages
    h.add("low", prompt(16, 1), max_new_tokens=10, ignore_eos=True)
    for _ in range(4):  # prefill, then 3 decodes: 20 tokens, KV for 19 in 5 pages
        h.step()
    # high needs 7 pages and decode headroom: only retracting low leaves that. low's 4
    # whole pages go to the tree, and high's 7 fit beside them in the 8 free ones.
    h.add("high", prompt(28, 2), priority=1, max_new_tokens=2, ignore_eos=True)
    low = h.reqs["low"]
    retractions = record_retractions(h.s)
    h.step()
    assert h.batches[-1][1][0].rid == "high"
    assert retractions == [("low", Status.WAITING, [], 4)]  # its 4 whole pages stay cached
    # (low's 1-page tail then fits again in the same step: admission keeps headroom only
    # for requests decoding when it starts.)
    h.run()
    batch, reqs = next((b, reqs) for b, reqs in h.batches[4:] if low in reqs)
    i = reqs.index(low)
    # It recomputes only what its cached pages lack: tokens 16..19, sampling the 5th output.
    assert (batch.prefix_lens[i], batch.extend_lens[i], batch.sample[i]) == (16, 4, True)
    assert batch.output_lens[i] == 4
    assert low.cached_tokens == 0  # counted at its first start only
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


# ---- abort -------------------------------------------------------------------------------


def test_abort_waiting_running_and_mid_prefill_frees_their_kv():
    h = Harness(budget=16, page_size=4, max_running=2)
    h.add("running", prompt(6, 1), max_new_tokens=50, ignore_eos=True)
    h.add("prefill", prompt(60, 2), max_new_tokens=50, ignore_eos=True)
    h.add("waiting", prompt(6, 3), max_new_tokens=50, ignore_eos=True)
    h.step()
    h.step()
    assert h.reqs["prefill"].in_prefill and h.reqs["prefill"].kv_len > 0
    assert h.reqs["waiting"].status == Status.WAITING
    for rid in ("waiting", "prefill", "running"):
        h.abort(rid)
        h.s.check()
        assert h.final[rid].finish_reason == FinishReason.ABORT
    assert h.s.abort("running") is None  # already gone
    assert h.s.schedule() is None
    h.assert_idle()
    assert h.final["waiting"].completion_tokens == 0
    assert h.final["running"].completion_tokens > 0
    assert h.s.stats().kv_cached_tokens > 0  # their computed prefixes stay cached


def test_abort_while_the_step_runs():
    h = Harness(budget=16, page_size=4)
    h.add("a", prompt(40, 1), max_new_tokens=5, ignore_eos=True)
    h.add("b", prompt(5, 2), max_new_tokens=5, ignore_eos=True)
    h.step(abort_mid_step=["a"])  # a is mid-prefill
    h.step()
    h.step(abort_mid_step=["b"])  # b is decoding
    h.run()
    assert h.final["a"].finish_reason == h.final["b"].finish_reason == FinishReason.ABORT
    h.add("c", prompt(40, 1), max_new_tokens=3, ignore_eos=True)  # reuses a's cached chunk
    h.run()
    h.assert_finished_correctly("c")


def test_abort_of_an_unknown_request_is_none():
    h = Harness()
    assert h.s.abort("nope") is None


# ---- prefix cache --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size,length", [(1, 20), (4, 20), (4, 22), (16, 32), (16, 40)])
def test_second_identical_prompt_is_cached_but_recomputes_at_least_one_token(page_size, length):
    h = Harness(page_size=page_size, budget=256)
    p = prompt(length, 7)
    h.add("first", p, max_new_tokens=3, ignore_eos=True)
    h.run()
    assert h.final["first"].cached_tokens == 0
    h.add("second", p, max_new_tokens=3, ignore_eos=True)
    batch = h.step()
    i = batch.sids.index(h.reqs["second"].sid)
    assert batch.prefix_lens[i] > 0 and batch.extend_lens[i] >= 1
    assert batch.prefix_lens[i] == (length - 1) // page_size * page_size
    h.run()
    assert 0 < h.final["second"].cached_tokens < length
    assert h.outputs("second") == h.outputs("first")
    assert h.s.stats().cached_prompt_tokens_total == h.final["second"].cached_tokens
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_disabled_cache_never_reuses():
    h = Harness(page_size=4, disable_cache=True)
    p = prompt(20, 7)
    h.add("first", p, max_new_tokens=3, ignore_eos=True)
    h.run()
    h.add("second", p, max_new_tokens=3, ignore_eos=True)
    h.run()
    assert h.final["second"].cached_tokens == 0
    assert h.s.stats().kv_cached_tokens == 0
    assert h.outputs("second") == h.outputs("first")


def run_shared_prefix(page_size: int, budget: int) -> tuple[Harness, list[int], int]:
    """8 requests with a common 128-token prefix, submitted at once."""
    shared = prompt(128, 11)
    h = Harness(page_size=page_size, budget=budget, num_pages=4096 // page_size)
    for i in range(8):
        h.add(f"r{i}", shared + prompt(20 + i, 100 + i), max_new_tokens=4, ignore_eos=True)
    h.run()
    computed_shared = 0  # prompt positions < 128 computed over all steps
    for batch, _ in h.batches:
        for p, n in zip(batch.prefix_lens, batch.extend_lens):
            computed_shared += max(0, min(p + n, 128) - p)
    for rid in h.reqs:
        h.assert_finished_correctly(rid)
    cached = [h.final[f"r{i}"].cached_tokens for i in range(8)]
    return h, cached, computed_shared


@pytest.mark.parametrize(
    "page_size,budget", [(1, 512), (4, 512), (16, 512), (16, 100), (4, 64), (1, 48)]
)
def test_shared_prefix_is_computed_once(page_size, budget):
    h, cached, computed_shared = run_shared_prefix(page_size, budget)
    assert cached[0] == 0 and all(c >= 128 - page_size for c in cached[1:]), cached
    assert computed_shared <= 128 + 7 * page_size


def test_shared_prefix_deferral_needs_enough_shared_uncached_tokens():
    # Budget 40 computes the prefix in chunks [0, 40), [40, 80), [80, 120), [120, 148): when
    # r1 is admitted (step 4) only 8 shared tokens are uncached, fewer than the deferral
    # threshold, so it computes them itself rather than wait a step.
    h, cached, computed_shared = run_shared_prefix(4, 40)
    assert cached[0] == 0 and cached[1] == 120 and all(c >= 124 for c in cached[2:]), cached
    assert computed_shared <= 128 + 8 + 6 * 4


# ---- rejection -----------------------------------------------------------------------------


def test_rejections():
    h = Harness(num_pages=9, page_size=4, context_len=30)  # 32 KV tokens
    with pytest.raises(InvalidParam) as e:
        h.add("empty", [])
    assert e.value.field == "prompt"
    with pytest.raises(InvalidParam):
        h.add("ctx", prompt(30, 1))  # prompt >= context
    h2 = Harness(num_pages=9, page_size=4, context_len=4096)
    with pytest.raises(InvalidParam):
        h2.add("pool", prompt(32, 1))  # needs 33 KV tokens, the pool holds 32
    h2.add("fits", prompt(31, 1), max_new_tokens=4)
    with pytest.raises(InvalidParam) as e:
        h2.add("fits", prompt(3, 1))
    assert e.value.field == "rid"
    h.add("ok", prompt(29, 1), max_new_tokens=4)
    for x in (h, h2):
        x.run()
    assert h.final["ok"].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert len(h.outputs("ok")) == 1  # 29 + 1 == context_len
    h2.assert_finished_correctly("fits")


def test_stats_while_running_and_idle():
    h = Harness(page_size=4, num_pages=65)
    h.add("a", prompt(10, 1), max_new_tokens=5, ignore_eos=True)
    h.add("b", prompt(10, 2), max_new_tokens=5, ignore_eos=True)
    st_ = h.s.stats()
    assert st_.num_waiting == 2 and st_.num_running == 0 and st_.kv_total_tokens == 256
    h.step()
    st_ = h.s.stats()
    assert st_.num_running == 2 and st_.kv_locked_tokens > 0
    assert st_.kv_free_tokens + st_.kv_locked_tokens + st_.kv_cached_tokens == st_.kv_total_tokens
    h.run()
    st_ = h.s.stats()
    assert st_.prompt_tokens_total == 20 and st_.cache_hit_rate == 0.0


# ---- property-based ------------------------------------------------------------------------


@st.composite
def workloads(draw):
    ps = draw(st.sampled_from([1, 4, 16]))
    capacity_tokens = draw(st.integers(24, 160))
    num_pages = -(-capacity_tokens // ps) + 1
    pool = (num_pages - 1) * ps
    context_len = draw(st.sampled_from([4096, draw(st.integers(8, 200))]))
    max_prompt = max(1, min(pool - 1, context_len - 1, 80))
    bases = [draw(st.lists(st.integers(0, 3), min_size=80, max_size=80)) for _ in range(2)]
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        plen = draw(st.one_of(st.integers(1, max_prompt), st.just(max_prompt)))
        # Often the whole prompt comes from a shared base, so prefixes collide (and requests
        # that share >= SHARED_PREFIX_DEFER_TOKENS uncached tokens get deferred).
        shared = draw(st.one_of(st.just(plen), st.integers(0, plen)))
        tail = draw(st.lists(st.integers(0, 5), min_size=plen - shared, max_size=plen - shared))
        reqs.append(
            dict(
                prompt=bases[draw(st.integers(0, 1))][:shared] + tail,
                priority=draw(st.integers(0, 2)),
                max_new_tokens=draw(st.integers(1, 24)),
                min_new_tokens=draw(st.integers(0, 3)),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                arrive=draw(st.one_of(st.just(0), st.integers(0, 12))),  # bursts and stragglers
                mid_step=draw(st.booleans()),  # arrives while a step is in flight
            )
        )
    aborts = draw(
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9), st.booleans()), max_size=4)
    )
    return dict(
        ps=ps,
        num_pages=num_pages,
        context_len=context_len,
        budget=draw(st.sampled_from([1, 3, 8, 32, 64, 512])),
        max_running=draw(st.integers(1, 8)),
        disable_cache=draw(st.booleans()),
        attention_break_even=draw(st.sampled_from([None, 4, 64])),
        reqs=reqs,
        aborts=aborts,
        stall_ms=draw(st.sampled_from([0.0, 20.0, 60.0])),
        # A model whose every layer slides: pages behind the window drop as requests run.
        window=draw(st.sampled_from([None, None, 1, 3, 8, 20])),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(), depth=st.sampled_from([1, 2]))
def test_random_workloads_run_to_completion(w, depth):
    clock = StepClock(
        0.01
    )  # stall_ms 20 or 60: prompts late after 2 or 6 steps, decodes held as long
    h = Harness(
        num_pages=w["num_pages"],
        page_size=w["ps"],
        budget=w["budget"],
        max_running=w["max_running"],
        context_len=w["context_len"],
        disable_cache=w["disable_cache"],
        eos=(EOS, 5),
        attention_break_even=w["attention_break_even"],
        depth=depth,
        stall_ms=w["stall_ms"],
        clock=clock,
        window=w["window"],
    )
    pending = sorted(enumerate(w["reqs"]), key=lambda x: x[1]["arrive"])
    aborts = defaultdict(list)
    for step, i, mid in w["aborts"]:
        aborts[step].append((f"r{i}", mid))
    total = sum(len(r["prompt"]) + r["max_new_tokens"] for r in w["reqs"])
    max_steps = 50 + 4 * total
    tick = 0
    while pending or h.s.has_work or h.inflight:
        assert tick < max_steps, "no progress"

        def arrive(mid_step: bool) -> None:
            for i, r in [
                x for x in pending if x[1]["arrive"] <= tick and x[1]["mid_step"] == mid_step
            ]:
                pending.remove((i, r))
                params = {
                    k: v
                    for k, v in r.items()
                    if k not in ("prompt", "priority", "arrive", "mid_step")
                }
                params["min_new_tokens"] = min(params["min_new_tokens"], params["max_new_tokens"])
                h.add(f"r{i}", r["prompt"], priority=r["priority"], **params)

        arrive(False)
        for rid, mid in aborts.get(tick, []):
            if not mid:
                h.abort(rid)
                h.s.check()
        if (
            h.step(
                abort_mid_step=[rid for rid, mid in aborts.get(tick, []) if mid],
                during=lambda: arrive(True),
            )
            is None
        ):
            arrive(True)  # nothing ran: the arrival still comes
        tick += 1
        clock.tick()
    h.assert_idle()
    assert set(h.final) == set(h.reqs), "a request ended without a finish event"
    aborted = {f"r{i}" for _, i, _ in w["aborts"]}
    for rid in h.reqs:
        if rid not in aborted:
            assert h.final[rid].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        h.assert_finished_correctly(rid)


# ---- overlap scheduling ------------------------------------------------------------------


def run_overlap_mix(depth: int, **harness) -> Harness:
    h = add_overlap_mix(Harness(depth=depth, **harness))
    h.run()
    return h


def add_overlap_mix(h: Harness) -> Harness:
    for i in range(10):
        h.add(
            f"r{i}",
            prompt(3 + 7 * i, 50 + i),
            max_new_tokens=5 + 3 * i,
            min_new_tokens=i % 3,
            stop_token_ids=[7, 11][: i % 3],
            logprobs=i % 4 == 0,
        )
    return h


class HarnessRunner:
    """The harness's fake model as StepLoop's runner: a step runs when it is submitted."""

    def __init__(self, h: Harness):
        self.h, self.outs = h, deque()

    def submit(self, batch: BatchInput) -> None:
        by_sid = {r.sid: r for r in self.h.s.table.running}
        reqs = [by_sid[sid] for sid in batch.sids]
        self.h._validate(batch, reqs)
        self.h.batches.append((batch, reqs))
        self.outs.append(self.h._run_model(batch, reqs))

    def collect(self) -> BatchOutput:
        return self.outs.popleft()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_loop_gives_lockstep_tokens_and_keeps_two_steps_out_with_overlap(overlap):
    """The loop the scheduler process and the Engine run (StepLoop) gives every request the
    tokens the lockstep harness gives it; with overlap forced on it builds steps on tokens it
    has not seen yet, and publishes each request's records in order."""
    from relay.scheduling.overlap import OverlapPolicy
    from relay.scheduling.step_loop import StepLoop

    lockstep = run_overlap_mix(1)
    h = add_overlap_mix(Harness())
    published: list[RequestOutput] = []
    loop = StepLoop(
        h.s, HarnessRunner(h), OverlapPolicy(enabled=overlap, min_share=0.0), published.extend
    )
    while loop.busy:
        assert loop.step(), "work queued but nothing scheduled"
        assert len(loop.inflight) <= (2 if overlap else 1)
        h.s.check()
    for ev in published:
        h._record(ev)
    for rid in lockstep.reqs:
        assert h.outputs(rid) == lockstep.outputs(rid)
        assert h.final[rid].finish_reason == lockstep.final[rid].finish_reason
        h.assert_finished_correctly(rid)
    pending = sum(b.input_ids.count(PENDING_TOKEN) for b, _ in h.batches)
    assert (pending > 100) == overlap
    assert loop.work["steps"] == len(h.batches) and not loop.outputs


def test_overlap_gives_the_same_tokens_and_chains_decodes():
    lockstep, overlap = run_overlap_mix(1), run_overlap_mix(2)
    for rid in lockstep.reqs:
        assert overlap.outputs(rid) == lockstep.outputs(rid)
        assert overlap.final[rid].finish_reason == lockstep.final[rid].finish_reason
        assert [e.logprobs for e in overlap.events[rid]] == [
            e.logprobs for e in lockstep.events[rid]
        ]
        overlap.assert_finished_correctly(rid)
    pending = sum(b.input_ids.count(PENDING_TOKEN) for b, _ in overlap.batches)
    assert pending > 100, "decodes should run on tokens the scheduler has not seen yet"
    assert all(PENDING_TOKEN not in b.input_ids for b, _ in lockstep.batches)


def test_overlap_never_builds_a_row_past_max_new_tokens():
    h = Harness(depth=2, eos=())
    h.add("r", prompt(6, 1), max_new_tokens=7)
    h.run()
    assert len(h.outputs("r")) == 7
    sampled = sum(b.sample[i] for b, reqs in h.batches for i, r in enumerate(reqs) if r.rid == "r")
    assert sampled == 7, "a row whose token could only be dropped was built"


def test_overlap_drops_the_row_after_a_stop_token_and_frees_its_kv():
    """Token = position, so stop token 9 comes out at position 9: the step after it is
    already out with the request in it; that row's output is dropped."""
    h = Harness(depth=2, eos=(), token_fn=counting_token, page_size=4)
    h.add("r", list(range(6)), max_new_tokens=20, stop_token_ids=[9])
    h.add("long", list(range(6)), max_new_tokens=20)
    h.run()
    assert h.outputs("r") == [6, 7, 8, 9] and h.final["r"].finish_reason == FinishReason.STOP
    rows = [r.rid for _, reqs in h.batches for r in reqs].count("r")
    assert rows == 5, "one extra decode row (after the stop) ran and was dropped"
    assert h.outputs("long") == list(range(6, 26))
    h.assert_idle()


def test_overlap_abort_and_retraction_while_two_steps_are_out():
    h = Harness(depth=2, eos=(), page_size=4, num_pages=12, budget=32)  # 44 KV tokens
    h.add("a", prompt(10, 1), max_new_tokens=30)
    h.add("b", prompt(10, 2), max_new_tokens=30)
    while h.s.kv.allocator.num_free > 1:
        h.step()
    assert len(h.inflight) == 1 and h.reqs["b"].inflight_steps == 1
    h.add("hi", prompt(10, 3), max_new_tokens=8, priority=5)  # retracts b, whose step is out
    h.step(abort_mid_step=["a"])
    assert h.reqs["b"].num_retractions == 1
    h.run()
    assert h.final["a"].finish_reason == FinishReason.ABORT
    assert h.reqs["b"].num_retractions > 0
    for rid in ("b", "hi"):
        h.assert_finished_correctly(rid)
    want = Harness(eos=())
    want.add("b", prompt(10, 2), max_new_tokens=30)
    want.run()
    assert h.outputs("b") == want.outputs("b")


def test_overlap_runner_error_fails_its_requests_and_drops_their_next_rows():
    h = Harness(depth=2, eos=(), max_running=2)
    h.add("a", prompt(8, 1), max_new_tokens=20)
    h.add("b", prompt(8, 2), max_new_tokens=20)
    h.step()
    h.step()  # step 2 built and out, step 1 processed
    failed = h.s.schedule()  # step 3 out too; step 2 fails
    step2, _ = h.inflight.popleft()
    events = h.s.process_output(step2, BatchOutput(step2.step, [], error="boom"))
    assert {e.rid: e.error for e in events} == {"a": "boom", "b": "boom"}
    assert h.s.process_output(failed, BatchOutput(failed.step, [1, 2])) == []  # their rows: dropped
    h.s.check()
    h.assert_idle()


def test_overlap_policy_overlaps_only_where_the_scheduler_is_a_real_share_of_a_step():
    from relay.scheduling.overlap import OverlapPolicy

    cpu, gpu, off, always = (
        OverlapPolicy(),
        OverlapPolicy(),
        OverlapPolicy(enabled=False),
        OverlapPolicy(min_share=0),
    )
    assert cpu.depth == 1 and always.depth == 2  # nothing measured yet: lockstep, unless forced
    for _ in range(20):
        cpu.record(busy_s=0.002, step_s=0.180)  # a float32 model step on 2 cores
        gpu.record(busy_s=0.0015, step_s=0.005)  # a CUDA-graph decode step
        off.record(busy_s=0.0015, step_s=0.005)
    assert (cpu.depth, gpu.depth, off.depth) == (1, 2, 1)
    for _ in range(20):
        cpu.record(busy_s=0.002, step_s=0.004)  # the load changed: steps became short
    assert cpu.depth == 2 and cpu.to_dict()["depth"] == 2
