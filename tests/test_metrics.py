"""relay.metrics: private registries, metric names and what each observation records."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.metrics import RequestTimer, ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_names_are_present():
    text = ServerMetrics().render()[0].decode()
    for name in (
        "relay:time_to_first_token_seconds",
        "relay:inter_token_latency_seconds",
        "relay:e2e_request_latency_seconds",
        "relay:queue_time_seconds",
        "relay:prompt_tokens_total",
        "relay:generation_tokens_total",
        "relay:cached_tokens_total",
        "relay:requests_total",
        "relay:num_running_reqs",
        "relay:num_waiting_reqs",
        "relay:kv_usage_ratio",
        "relay:kv_used_tokens",
        "relay:prefix_cache_hit_rate",
    ):
        assert f"# TYPE {name}" in text or f"# TYPE {name.removesuffix('_total')}" in text, name


def test_observations():
    m = ServerMetrics()
    m.observe_first_token(0.02)
    m.observe_first_token(0.5)
    m.observe_inter_token(0.03, count=3)  # one delta of 3 tokens after 30 ms: three 10 ms gaps
    m.observe_finish(
        1.5, 0.1, prompt_tokens=10, completion_tokens=4, cached_tokens=6, finish_reason="stop"
    )
    m.observe_finish(
        2.0, None, prompt_tokens=5, completion_tokens=1, cached_tokens=0, finish_reason="length"
    )
    m.observe_finish(
        0.1, None, prompt_tokens=5, completion_tokens=0, cached_tokens=0, finish_reason="weird"
    )
    s = samples(m)
    assert s[("relay:time_to_first_token_seconds_count", ())] == 2
    assert s[("relay:time_to_first_token_seconds_sum", ())] == pytest.approx(0.52)
    assert s[("relay:inter_token_latency_seconds_count", ())] == 3
    assert s[("relay:inter_token_latency_seconds_bucket", (("le", "0.01"),))] == 3
    assert s[("relay:e2e_request_latency_seconds_count", ())] == 3
    assert s[("relay:queue_time_seconds_count", ())] == 1
    assert s[("relay:prompt_tokens_total", ())] == 20
    assert s[("relay:generation_tokens_total", ())] == 5
    assert s[("relay:cached_tokens_total", ())] == 6
    assert s[("relay:requests_total", (("finish_reason", "stop"),))] == 1
    assert s[("relay:requests_total", (("finish_reason", "length"),))] == 1
    assert s[("relay:requests_total", (("finish_reason", "other"),))] == 1


def test_buckets_span_ms_to_minute():
    s = samples(ServerMetrics())
    les = {
        float(dict(labels)["le"])
        for (name, labels) in s
        if name == "relay:e2e_request_latency_seconds_bucket"
    }
    assert min(les) == 0.001 and max(les - {float("inf")}) == 60.0


def test_scheduler_stats():
    m = ServerMetrics()
    m.set_scheduler_stats(
        {
            "num_running": 3,
            "num_waiting": 7,
            "kv_total_tokens": 1000,
            "kv_free_tokens": 500,
            "kv_locked_tokens": 250,
            "kv_cached_tokens": 250,
            "cache_hit_rate": 0.4,
        }
    )
    s = samples(m)
    assert s[("relay:num_running_reqs", ())] == 3 and s[("relay:num_waiting_reqs", ())] == 7
    assert s[("relay:kv_used_tokens", ())] == 250 and s[("relay:kv_usage_ratio", ())] == 0.25
    assert s[("relay:prefix_cache_hit_rate", ())] == 0.4
    # dataclasses.asdict(SchedulerStats) has the totals, not the property
    m.set_scheduler_stats({"prompt_tokens_total": 100, "cached_prompt_tokens_total": 30})
    s = samples(m)
    assert s[("relay:prefix_cache_hit_rate", ())] == pytest.approx(0.3)
    assert s[("relay:num_running_reqs", ())] == 3  # absent keys leave gauges alone


def test_two_instances_coexist():
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_finish(1.0, None, 3, 2, 0, "stop")
    assert samples(a)[("relay:prompt_tokens_total", ())] == 3
    assert samples(b)[("relay:prompt_tokens_total", ())] == 0


def test_request_timer():
    m = ServerMetrics()
    t = RequestTimer(arrival=100.0)
    m.on_tokens(t, 100.25, 2)  # first delta: TTFT only
    m.on_tokens(t, 100.35, 1)
    m.on_tokens(t, 100.55, 4)  # 200 ms for 4 tokens: four 50 ms gaps
    m.on_tokens(t, 101.0, 0)  # a finish without a token records nothing
    s = samples(m)
    assert s[("relay:time_to_first_token_seconds_sum", ())] == pytest.approx(0.25)
    assert s[("relay:inter_token_latency_seconds_count", ())] == 5
    assert s[("relay:inter_token_latency_seconds_sum", ())] == pytest.approx(0.3)
    assert t.e2e(101.0) == pytest.approx(1.0)


def test_grammar_counters():
    m = ServerMetrics()
    m.set_scheduler_stats(
        {
            "grammar": {
                "compiles": 3,
                "cache_hits": 5,
                "live_matchers": 2,
                "compile_seconds_sum": 0.05,
                "compile_seconds_buckets": [0.01, 0.1],
                "compile_seconds_counts": [1, 2, 0],
                "mask_step_share": 0.02,
            }
        }
    )
    s = samples(m)
    assert s[("relay:grammar_compile_seconds_bucket", (("le", "0.01"),))] == 1
    assert s[("relay:grammar_compile_seconds_bucket", (("le", "+Inf"),))] == 3
    assert s[("relay:grammar_compile_seconds_count", ())] == 3
    assert s[("relay:grammar_cache_hits_total", ())] == 5
    assert (
        s[("relay:grammar_matchers", ())] == 2 and s[("relay:grammar_mask_step_share", ())] == 0.02
    )
