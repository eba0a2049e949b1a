"""Prometheus metrics of the HTTP process, served at /metrics.

Each ServerMetrics owns its own CollectorRegistry rather than prometheus_client's global
one, so several servers (or tests) in one process never collide on metric names. Names
carry a `relay:` prefix, mirroring SGLang's `sglang:` ones, so dashboards port over. A
replica of a data-parallel server (`--dp`, `--replica-name`) labels every series with
`replica="<name>"`, so one Prometheus scrape config covers all replicas and they stay apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# 1 ms .. 60 s: a CPU-served token can take tens of ms, a queued long prompt tens of seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
)
# A label value per finish reason the engine produces; anything else is folded into "other"
# so a caller bug cannot blow up the series count.
FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})


class TokenTiming(NamedTuple):
    """What one delta of `count` tokens means for the latency histograms."""

    first_token: float | None  # seconds from arrival to the first token, on the first delta only
    inter_token: float | None  # seconds since the previous delta, on later deltas
    count: int  # tokens that gap covers


@dataclass
class RequestTimer:
    """Per-request clock that turns token arrivals into TTFT and inter-token gaps.

    Times are whatever clock the caller uses consistently (time.monotonic() or time.time()).
    """

    arrival: float
    first_token: float | None = None
    last_token: float | None = None

    def on_tokens(self, now: float, n: int) -> TokenTiming:
        if n <= 0:
            return TokenTiming(None, None, 0)
        if self.first_token is None:
            # Tokens batched with the first one arrived together; no gap is known for them.
            self.first_token = self.last_token = now
            return TokenTiming(now - self.arrival, None, 0)
        gap = now - (self.last_token if self.last_token is not None else self.first_token)
        self.last_token = now
        return TokenTiming(None, gap, n)

    def e2e(self, now: float) -> float:
        return now - self.arrival


class ServerMetrics:
    def __init__(self, replica: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.replica = replica
        r = self.registry
        self.ttft = Histogram(
            "relay:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "relay:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "relay:e2e_request_latency_seconds",
            "Time from request arrival to its end.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "relay:queue_time_seconds",
            "Time a request waited before its first prefill.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "relay:prompt_tokens_total", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "relay:generation_tokens_total", "Output tokens generated.", registry=r
        )
        self.cached_tokens = Counter(
            "relay:cached_tokens_total", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.requests = Counter(
            "relay:requests_total",
            "Finished requests, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.aborted = Counter(
            "relay:aborted_requests_total",
            "Requests ended early, by reason (client_disconnect, abort_request, ...).",
            ["reason"],
            registry=r,
        )
        self.num_running = Gauge(
            "relay:num_running_reqs", "Requests in the running batch.", registry=r
        )
        self.num_waiting = Gauge(
            "relay:num_waiting_reqs", "Requests waiting to be scheduled.", registry=r
        )
        self.kv_usage = Gauge(
            "relay:kv_usage_ratio", "Share of KV cache held by running requests.", registry=r
        )
        self.kv_used = Gauge(
            "relay:kv_used_tokens", "KV cache tokens held by running requests.", registry=r
        )
        self.hit_rate = Gauge(
            "relay:prefix_cache_hit_rate",
            "Share of prompt tokens found in the prefix cache.",
            registry=r,
        )
        self.spec = SpecCollector()
        r.register(self.spec)
        self.adaptive = AdaptiveCollector()
        r.register(self.adaptive)
        self.grammar = GrammarCollector()
        r.register(self.grammar)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        """`seconds` since the previous delta, which carried `count` tokens: observe the
        per-token gap `count` times so the histogram stays per token however the
        detokenizer batches its deltas."""
        if count <= 0:
            return
        gap = seconds / count
        for _ in range(count):
            self.itl.observe(gap)

    def on_tokens(self, timer: RequestTimer, now: float, n: int) -> None:
        """Advance `timer` by a delta of n tokens and record what it implies."""
        timing = timer.on_tokens(now, n)
        if timing.first_token is not None:
            self.observe_first_token(timing.first_token)
        if timing.inter_token is not None:
            self.observe_inter_token(timing.inter_token, timing.count)

    def observe_finish(
        self,
        e2e: float,
        queue_time: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        finish_reason: str | None,
    ) -> None:
        self.e2e.observe(e2e)
        if queue_time is not None:
            self.queue.observe(queue_time)
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, completion_tokens))
        self.cached_tokens.inc(max(0, cached_tokens))
        reason = finish_reason if finish_reason in FINISH_REASONS else "other"
        self.requests.labels(finish_reason=reason).inc()

    def observe_abort(self, reason: str, finish_seen: bool) -> None:
        """A request ended early for `reason`. finish_seen: its finish still reaches
        observe_finish (an /abort_request while its client waits); a client that left never
        sees one, so it is counted as a finished request here."""
        self.aborted.labels(reason=reason).inc()
        if not finish_seen:
            self.requests.labels(finish_reason="abort").inc()

    def set_scheduler_stats(self, d: dict[str, Any]) -> None:
        """Update gauges from a scheduler stats dict (SchedulerStats fields); absent keys
        leave their gauge as it was."""
        for key, gauge in (("num_running", self.num_running), ("num_waiting", self.num_waiting)):
            if key in d:
                gauge.set(d[key])
        used = _kv_used(d)
        if used is not None:
            self.kv_used.set(used)
            total = d.get("kv_total_tokens") or 0
            self.kv_usage.set(used / total if total > 0 else 0.0)
        rate = _hit_rate(d)
        if rate is not None:
            self.hit_rate.set(rate)
        if d.get("spec"):
            self.spec.latest = d["spec"]
        if d.get("adaptive"):
            self.adaptive.latest = d["adaptive"]
        if d.get("grammar"):
            self.grammar.latest = d["grammar"]

    def render(self) -> tuple[bytes, str]:
        source = (
            self.registry
            if self.replica is None
            else Labelled(self.registry, {"replica": self.replica})
        )
        return generate_latest(source), CONTENT_TYPE_LATEST


class Labelled:
    """A registry's metric families with constant labels added to every sample. Families
    without samples (a labelled counter nothing has incremented yet) are left out: they carry
    no data, and sglang-router's /engine_metrics, which merges the replicas' families, refuses
    one whose label names differ between replicas (none on one, `reason` on the other)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry = registry
        self.labels = labels

    def collect(self):
        for family in self.registry.collect():
            if not family.samples:
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield out


class LatestCollector:
    """Metric families made from the dict the scheduler last reported (none before it has)."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None

    def collect(self):
        if self.latest:
            yield from self.families(self.latest)

    def families(self, d: dict[str, Any]):
        raise NotImplementedError


class SpecCollector(LatestCollector):
    """Speculative decoding's counters as the scheduler last reported them (SpecStats.to_dict):
    the scheduler counts every verify step, this only exposes its totals."""

    def families(self, d: dict[str, Any]):
        yield CounterMetricFamily(
            "relay:spec_proposed_tokens",
            "Tokens proposed by speculative decoding.",
            value=d["spec_proposed_tokens"],
        )
        yield CounterMetricFamily(
            "relay:spec_accepted_tokens",
            "Proposed tokens the target model accepted.",
            value=d["spec_accepted_tokens"],
        )
        yield GaugeMetricFamily(
            "relay:spec_acceptance_rate",
            "Share of proposed tokens accepted.",
            value=d["spec_acceptance_rate"],
        )
        yield GaugeMetricFamily(
            "relay:spec_accept_length",
            "Tokens emitted per verify step (accepted + 1).",
            value=d["spec_accept_length"],
        )
        hist, cumulative, buckets = d["spec_accepted_hist"], 0, []
        for accepted, n in enumerate(hist):
            cumulative += n
            buckets.append((str(float(accepted)), cumulative))
        buckets.append(("+Inf", cumulative))
        yield HistogramMetricFamily(
            "relay:spec_accepted_per_verify",
            "Proposals accepted per verify step.",
            buckets=buckets,
            sum_value=float(d["spec_accepted_tokens"]),
        )


class AdaptiveCollector(LatestCollector):
    """Adaptive batching's limits, windowed latencies and step-time model as the scheduler
    last reported them (AdaptiveLimits.to_dict)."""

    def families(self, d: dict[str, Any]):
        yield GaugeMetricFamily(
            "relay:adaptive_prefill_budget_tokens",
            "Prompt tokens a step may compute now.",
            value=d["prefill_budget"],
        )
        yield GaugeMetricFamily(
            "relay:adaptive_max_running_reqs",
            "Requests that may run at once now.",
            value=d["max_running"],
        )
        yield CounterMetricFamily(
            "relay:adaptive_limit_changes",
            "Changes the controller made to the limits.",
            value=d["changes"],
        )
        for name in ("itl", "ttft"):
            target = d.get(f"target_{name}_ms")
            if target is not None:
                yield GaugeMetricFamily(
                    f"relay:adaptive_target_{name}_seconds",
                    f"The p99 {name.upper()} target.",
                    value=target / 1e3,
                )
            p99 = d.get(f"p99_{name}_ms")
            if p99 is not None:
                yield GaugeMetricFamily(
                    f"relay:adaptive_p99_{name}_seconds",
                    f"Windowed p99 {name.upper()} the scheduler measures.",
                    value=p99 / 1e3,
                )
        model = d.get("step_model")
        if model:
            g = GaugeMetricFamily(
                "relay:adaptive_step_cost_seconds",
                "The learnt step-time model: base, per decode token, per prefill token.",
                labels=["part"],
            )
            for part in ("base", "per_decode_token", "per_prefill_token"):
                g.add_metric([part], model[f"{part}_ms"] / 1e3)
            yield g


class GrammarCollector(LatestCollector):
    """Constrained decoding's counters as the scheduler last reported them."""

    def families(self, d: dict[str, Any]):
        buckets, cumulative = [], 0
        for bound, n in zip(
            [*map(str, d["compile_seconds_buckets"]), "+Inf"], d["compile_seconds_counts"]
        ):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "relay:grammar_compile_seconds",
            "Time to compile a grammar (cache misses).",
            buckets=buckets,
            sum_value=d["compile_seconds_sum"],
        )
        yield CounterMetricFamily(
            "relay:grammar_cache_hits",
            "Constrained requests whose grammar was compiled already.",
            value=d["cache_hits"],
        )
        yield GaugeMetricFamily(
            "relay:grammar_matchers",
            "Grammar matchers held by unfinished requests.",
            value=d["live_matchers"],
        )
        yield GaugeMetricFamily(
            "relay:grammar_mask_step_share",
            "Share of step time the scheduler spent filling token masks.",
            value=d["mask_step_share"],
        )


def _kv_used(d: dict[str, Any]) -> float | None:
    # "Used" is what running requests hold; evictable prefix-cache pages are free for the
    # taking, so counting them would show a full cache on an idle server.
    if "kv_locked_tokens" in d:
        return d["kv_locked_tokens"]
    if "kv_total_tokens" in d and "kv_free_tokens" in d:
        return d["kv_total_tokens"] - d["kv_free_tokens"] - d.get("kv_cached_tokens", 0)
    return None


def _hit_rate(d: dict[str, Any]) -> float | None:
    if "cache_hit_rate" in d:
        return d["cache_hit_rate"]
    # dataclasses.asdict(SchedulerStats) drops the cache_hit_rate property; rebuild it.
    if "prompt_tokens_total" in d and "cached_prompt_tokens_total" in d:
        return d["cached_prompt_tokens_total"] / max(1, d["prompt_tokens_total"])
    return None
