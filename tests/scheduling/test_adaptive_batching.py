"""Adaptive batching without a model or processes: the real Scheduler on a simulated clock, whose
steps take what a linear step-cost model says (base + per decode token + per prefill unit)."""

from __future__ import annotations

import random
import statistics

import pytest

from relay.config import EngineConfig
from relay.sampling_params import SamplingParams
from relay.scheduling.adaptive_batching import (
    MIN_PREFILL_BUDGET,
    AdaptiveLimits,
    LatencyWindow,
    StepCostModel,
)
from relay.scheduling.request import Req
from relay.scheduling.scheduler import Scheduler
from relay.step import BatchOutput

BASE, PER_DECODE, PER_PREFILL = (
    0.008,
    0.0006,
    0.00045,
)  # seconds: roughly the default model on 2 cores


def linear_cost(decodes: int, prefill: int) -> float:
    return BASE + PER_DECODE * decodes + PER_PREFILL * prefill


def roofline_cost(decodes: int, prefill: int) -> float:
    """A CPU's step in float32 on a 2-core Xeon (measured: 32 ms at batch 1, ~330 ms for a
    256-token chunk): reading the weights takes 30 ms whatever the rows, and past ~16 rows
    the arithmetic takes longer than the read. Not linear: a model fitted across small and
    large steps misjudges both."""
    return max(0.030, 0.012 + 0.00125 * (decodes + prefill)) + 0.0002 * decodes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sim:
    """Poisson arrivals into a Scheduler; each step advances the clock by its modelled cost."""

    def __init__(
        self,
        target_itl_ms: float | None = 40.0,
        *,
        budget: int = 256,
        max_running: int = 64,
        num_pages: int = 4096,
        window: float = 5.0,
        target_ttft_ms: float | None = None,
        noise: float = 0.05,
        seed: int = 0,
        cost=linear_cost,
        stalls: float = 0.0,
    ):
        self.clock = Clock()
        # Fixed limits here mean every decode in every step: the comparison is of step limits, not
        # of prefill-first holds (tests/scheduling/test_scheduler.py), which a latency target turns off anyway.
        cfg = EngineConfig(
            page_size=16,
            chunked_prefill_size=budget,
            max_running_requests=max_running,
            target_itl_ms=target_itl_ms,
            target_ttft_ms=target_ttft_ms,
            adaptive_window_s=window,
            max_decode_stall_ms=0,
        )
        self.s = Scheduler(cfg, num_pages, 8192, [0], clock=self.clock)
        self.rng = random.Random(seed)
        self.noise = noise
        self.cost = cost
        self.stalls = (
            stalls  # the share of steps that lose 40 ms to another process on the same cores
        )
        self.reqs: list[Req] = []
        self.gaps: list[tuple[float, float]] = []  # (time, gap) of every token after a first
        self.last: dict[str, float] = {}
        self.limits_seen: list[tuple[float, int, int]] = []
        self.n = 0

    def add(self, prompt_len: int, output_len: int, priority: int = 0) -> Req:
        self.n += 1
        req = Req(
            f"r{self.n}",
            [1 + (self.n * 7 + i) % 50 for i in range(prompt_len)],
            SamplingParams(max_new_tokens=output_len, ignore_eos=True),
            priority=priority,
            arrival_time=self.clock.now,
        )
        self.s.add_request(req)
        self.reqs.append(req)
        return req

    def step(self) -> None:
        batch = self.s.schedule()
        if batch is None:
            return
        decoding = {r.rid for r in self.s.table.running if not r.in_prefill}
        rows = {self.s.builder.inflight[batch.step].reqs[i].rid for i in range(len(batch.sids))}
        assert decoding <= rows, "every decoding request gets its token every step"
        prefill = sum(n for n, p in zip(batch.extend_lens, batch.prefix_lens) if n > 1)
        decodes = len(batch.sids) - sum(1 for n in batch.extend_lens if n > 1)
        cost = self.cost(decodes, prefill)
        self.clock.now += cost * (1 + self.rng.uniform(-self.noise, self.noise))
        if self.rng.random() < self.stalls:
            self.clock.now += 0.040
        out = BatchOutput(batch.step, [5] * sum(batch.sample))
        for record in self.s.process_output(batch, out):
            if record.token_ids:
                if record.rid in self.last:
                    self.gaps.append((self.clock.now, self.clock.now - self.last[record.rid]))
                self.last[record.rid] = self.clock.now
        limits = self.s.limits
        self.limits_seen.append(
            (
                self.clock.now,
                getattr(limits, "prefill_budget", limits.budget_cap),
                limits.max_running,
                getattr(limits, "changes", 0),
            )
        )

    def run(
        self,
        seconds: float,
        rate: float,
        prompt_lens=(64, 2048),
        output_lens=(64, 256),
        priorities=(0,),
    ) -> None:
        """Poisson arrivals at `rate` per second for `seconds` of simulated time."""
        end = self.clock.now + seconds
        next_arrival = self.clock.now + self.rng.expovariate(rate)
        while self.clock.now < end:
            while next_arrival <= self.clock.now:
                self.add(
                    self.rng.randint(*prompt_lens),
                    self.rng.randint(*output_lens),
                    self.rng.choice(priorities),
                )
                next_arrival += self.rng.expovariate(rate)
            if self.s.has_work:
                self.step()
            else:
                self.clock.now = next_arrival

    def drain(self, limit: float = 3600.0) -> None:
        end = self.clock.now + limit
        while self.s.has_work and self.clock.now < end:
            self.step()

    def p99_gap(self, since: float) -> float:
        gaps = sorted(g for t, g in self.gaps if t >= since)
        return gaps[int(0.99 * (len(gaps) - 1))]

    def changes(self, since: float) -> int:
        """Decisions the controller took (the KV-pool cap follows the mix of lengths on its own)."""
        seen = [c for t, _, _, c in self.limits_seen if t >= since]
        return seen[-1] - seen[0]

    def change_times(self, since: float) -> list[float]:
        seen = [(t, c) for t, _, _, c in self.limits_seen if t >= since]
        return [t for (t, c), (_, c0) in zip(seen[1:], seen) if c != c0]


# ---- the pieces -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["target_itl_ms", "target_ttft_ms", "adaptive_window_s"])
def test_targets_and_window_must_be_positive(name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: 0.0})


def test_the_step_cost_model_recovers_the_costs_it_is_shown():
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(400):
        d, p = rng.randint(1, 48), rng.choice([0, 0, rng.randint(16, 256)])
        model.observe(d, p, BASE + PER_DECODE * d + PER_PREFILL * p)
    base, per_decode, per_prefill = model.coef
    assert base == pytest.approx(BASE, rel=1e-3) and per_decode == pytest.approx(
        PER_DECODE, rel=1e-3
    )
    assert per_prefill == pytest.approx(PER_PREFILL, rel=1e-3)
    assert model.prefill_for(0.036, 20) == int((0.036 - BASE - 20 * PER_DECODE) / PER_PREFILL)


def test_a_cost_model_that_never_saw_a_prompt_plans_nothing():
    model = StepCostModel()
    for d in range(1, 40):
        model.observe(d, 0, BASE + PER_DECODE * d)
    assert model.prefill_for(0.04, 8) is None


def test_window_percentiles_are_weighted_and_expire():
    w = LatencyWindow(5.0)
    w.add(0.0, 1.0, 98)
    w.add(1.0, 9.0, 2)
    assert w.percentile(50) == 1.0 and w.percentile(99) == 9.0
    w.expire(5.5)  # the 98 samples at t=0 are older than the window
    assert w.weight == 2 and w.percentile(50) == 9.0


# ---- the policy on a simulated server --------------------------------------------------------


def test_fixed_limits_miss_a_tight_target_that_adaptive_limits_meet_on_a_steady_load():
    fixed, adaptive = Sim(target_itl_ms=None), Sim(target_itl_ms=40.0)
    for sim in (fixed, adaptive):
        sim.run(120.0, rate=0.8)
    assert fixed.p99_gap(since=30.0) > 0.1  # a 256-token prompt chunk stalls every decode ~0.12 s
    assert adaptive.p99_gap(since=30.0) < 0.040
    assert adaptive.changes(since=60.0) <= 2, "a steady load settles instead of see-sawing"
    done = [r for r in adaptive.reqs if r.finished]
    assert len(done) >= 0.9 * len([r for r in fixed.reqs if r.finished]), (
        "not by serving fewer requests"
    )
    adaptive.drain()
    assert all(r.finished for r in adaptive.reqs)


def test_on_a_roofline_cost_a_light_load_keeps_its_admission_and_meets_the_target():
    """Bench on a 2-core Xeon (float32): prompts of 64-2,048 at 0.2 req/s with a 60 ms target.
    A linear model fitted to big prompt-only steps and small decode steps made one more decode
    look like 19 ms, and stalls from other processes pushed p99 over the target whatever the
    limits: the controller cut admission to 1 and new requests queued for seconds."""
    sim = Sim(target_itl_ms=60.0, target_ttft_ms=8000.0, cost=roofline_cost, stalls=0.005, seed=3)
    sim.run(300.0, rate=0.2, prompt_lens=(64, 2048), output_lens=(64, 192))
    assert min(m for t, _, m, _ in sim.limits_seen if t > 30.0) >= 8, (
        "admission is not what limits ITL here"
    )
    assert sim.p99_gap(since=30.0) < 0.060
    started = [r for r in sim.reqs if r.queue_time is not None]
    assert max(r.queue_time for r in started) < 1.0, "nobody waits for admission at this load"
    assert max(r.first_token_time - r.arrival_time for r in started if r.first_token_time) < 8.0


def test_a_step_far_over_the_target_is_logged_with_what_the_model_expected(caplog):
    limits = AdaptiveLimits(256, 64, 100_000, target_itl=0.040)
    with caplog.at_level("INFO", logger="relay.scheduling.adaptive_batching"):
        for i in range(40):  # a fitted model: 8 ms + 0.6 ms a decode + 0.45 ms a prompt token
            d, p = 1 + i % 8, 8 * (i % 5)
            limits.on_step(i * 0.01, linear_cost(d, p), d, p, [], [], 0, d)
        limits.on_step(0.5, 0.400, 4, 16, [], [], 0, 4)  # a 400 ms stall
        limits.on_step(
            0.6, 0.400, 4, 16, [], [], 0, 4
        )  # another within the second: not logged again
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(slow) == 1 and "took 400 ms (step model: 18 ms; target 40 ms)" in slow[0], slow


def test_the_limits_react_to_a_load_step_within_the_window():
    sim = Sim(target_itl_ms=40.0, window=5.0)
    sim.run(40.0, rate=0.5, prompt_lens=(64, 128))  # light: short prompts
    settled = sim.s.limits.changes
    jump = sim.clock.now
    sim.run(60.0, rate=3.0, prompt_lens=(64, 128), output_lens=(200, 256))  # many more decodes
    change_times = sim.change_times(since=jump)
    assert sim.s.limits.changes > settled and change_times[0] - jump < 5.0
    assert sim.p99_gap(since=jump + 30.0) < 0.040


def test_an_overload_shrinks_admission_but_never_starves_anyone():
    # 40 ms cannot hold for 64 decodes (8 + 0.6 x 64 = 46 ms a step): admission must shrink too.
    sim = Sim(target_itl_ms=40.0, max_running=64, window=3.0)
    sim.run(60.0, rate=8.0, prompt_lens=(64, 256), output_lens=(128, 256))
    limits: AdaptiveLimits = sim.s.limits
    assert limits._max_running < 64
    assert all(b >= MIN_PREFILL_BUDGET and m >= 1 for _, b, m, _ in sim.limits_seen)
    sim.drain()
    assert all(r.finished for r in sim.reqs), "every request ends"
    assert not sim.s.has_work
    sim.s.check()


def test_under_pressure_the_lower_priority_requests_wait():
    sim = Sim(target_itl_ms=40.0, max_running=64, window=3.0)
    sim.run(60.0, rate=8.0, prompt_lens=(64, 256), output_lens=(128, 256), priorities=(0, 1))
    sim.drain()
    waited = {
        p: statistics.median(r.queue_time for r in sim.reqs if r.priority == p) for p in (0, 1)
    }
    assert waited[1] < waited[0] / 2, waited


def test_the_running_cap_follows_what_the_kv_pool_holds():
    # 4096-token requests in a pool of 128 pages x 16 tokens: one at a time (retraction aside).
    sim = Sim(target_itl_ms=1000.0, num_pages=129, max_running=64)
    sim.add(1024, 3072)
    sim.step()
    assert sim.s.limits.max_running == 1
    assert sim.s.stats().adaptive["max_running_by_kv"] == 1


def test_server_info_shows_the_limits_the_model_and_the_latency():
    sim = Sim(target_itl_ms=40.0)
    sim.run(30.0, rate=1.0)
    info = sim.s.stats().adaptive
    assert info["target_itl_ms"] == 40.0 and info["prefill_budget"] < 256 and info["changes"] >= 1
    model = info["step_model"]
    assert model["per_prefill_token_ms"] == pytest.approx(PER_PREFILL * 1e3, rel=0.25)
    assert info["p99_itl_ms"] is not None and "target" in info["last_reason"]
    assert Sim(target_itl_ms=None).s.stats().adaptive is None


# ---- on the real server ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_server_steers_its_limits_under_load_and_shows_them():
    """A target no step can meet (50 us): under load the controller cuts the prefill budget and
    then admission, says so in the log and on /get_server_info and /metrics, and every request
    still ends with all its tokens. The load lasts until the server shows both cuts (or a
    deadline), so a slow or busy machine gets as many decisions as a fast one."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.server_utils import Server

    s = Server("--load-format", "dummy-null", "--target-itl-ms", "0.05", "--adaptive-window-s", "2")
    try:
        done = threading.Event()

        def client(i: int) -> list[int]:
            got = []
            with s.client() as c:
                while not done.is_set() or not got:
                    r = c.post(
                        "/generate",
                        json={
                            "input_ids": [5 + i] * 300,
                            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                        },
                    )
                    assert r.status_code == 200, r.text
                    got.append(r.json()["meta_info"]["completion_tokens"])
            return got

        def adaptive() -> dict:
            with s.client() as c:
                return c.get("/get_server_info").json()["scheduler"]["adaptive"]

        def both_cut(info: dict) -> bool:
            return info["prefill_budget"] == MIN_PREFILL_BUDGET and info["max_running"] < 12

        with ThreadPoolExecutor(12) as pool:
            clients = [pool.submit(client, i) for i in range(12)]
            deadline = time.monotonic() + 120
            while (
                not both_cut(adaptive())
                and time.monotonic() < deadline
                and not any(f.done() for f in clients)
            ):
                time.sleep(0.2)  # polling the condition, with a deadline
            done.set()
            counts = [n for f in clients for n in f.result()]
        assert counts and set(counts) == {200}
        info = adaptive()
        with s.client() as c:
            metrics = c.get("/metrics").text
        assert info["target_itl_ms"] == 0.05 and info["changes"] >= 2
        assert both_cut(info), info
        assert f"relay:adaptive_prefill_budget_tokens {float(MIN_PREFILL_BUDGET)}" in metrics
        assert "relay:adaptive_target_itl_seconds 5e-05" in metrics
        assert (
            "adaptive batching: prefill budget 256 -> " in s.log
            and "fewer running requests" in s.log
        )
    finally:
        s.stop()
