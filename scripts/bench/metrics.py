"""What a load run measured, as one flat dict of SGLang bench_serving's metric names.

request_throughput   completed requests / benchmark duration
input_throughput     total input tokens / duration          (input lengths as built by the dataset)
output_throughput    total output tokens / duration         (the server's own usage count when it reports
                                                              one, else the generated text re-tokenized)
total_throughput     (input + output tokens) / duration
concurrency          sum of E2E latencies / duration        (the average number of requests in flight)
E2E latency          request sent -> last byte of the stream
TTFT                 request sent -> first chunk carrying output
TPOT                 per request (E2E - TTFT) / (output tokens - 1), requests with > 1 output token
goodput              with --goodput: completed requests / duration counting only those that met every
                     SLO given (vLLM's bench_serving option): ttft:MS (the request's TTFT) and itl:MS (the
                     p99 of the request's own ITL gaps); reported as request_goodput
ITL                  gaps between consecutive streamed chunks; a chunk carrying k tokens counts as k gaps
                     of gap/k (SGLang counts one gap per chunk), so servers that batch several tokens per
                     chunk are not flattered
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from scripts.bench.workloads import DatasetRow, encode


def _stats(name: str, values_s: list[float], pcts=(99,)) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        out = {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0}
        out.update({f"p{p}_{name}_ms": 0.0 for p in pcts})
        return out
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    out.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in pcts})
    return out


def parse_goodput(text: str | None) -> dict[str, float]:
    """'ttft:2000 itl:30' -> {'ttft': 2.0, 'itl': 0.03} (seconds)."""
    slo: dict[str, float] = {}
    for part in (text or "").replace(",", " ").split():
        name, _, ms = part.partition(":")
        if name not in ("ttft", "itl") or not ms:
            raise argparse.ArgumentTypeError(f"--goodput takes ttft:MS and itl:MS, got {part!r}")
        slo[name] = float(ms) / 1000.0
    return slo


def meets_slo(o, slo: dict[str, float]) -> bool:
    if not o.success:
        return False
    if "ttft" in slo and o.ttft > slo["ttft"]:
        return False
    return "itl" not in slo or not o.itl or float(np.percentile(o.itl, 99)) <= slo["itl"]


def calculate_metrics(
    rows: list[DatasetRow],
    outputs: list,
    duration: float,
    tokenizer,
    slo: dict[str, float] | None = None,
) -> dict[str, Any]:
    completed = total_input = total_output = total_retok = 0
    ttfts, tpots, itls, e2es = [], [], [], []
    for row, o in zip(rows, outputs):
        if not o.success:
            continue
        completed += 1
        total_input += row.prompt_len
        total_output += o.output_len
        total_retok += len(encode(tokenizer, o.generated_text))
        if o.output_len > 1:
            tpots.append((o.latency - o.ttft) / (o.output_len - 1))
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2es.append(o.latency)
    # Peak output throughput and peak concurrency, in 1-second buckets / at request boundaries.
    ok = [o for o in outputs if o.success]
    t0 = min((o.start for o in ok), default=0.0)
    buckets: dict[int, int] = {}
    events = []
    for o in ok:
        for t, n in zip(o.chunk_times, o.chunk_k):
            b = int(t - t0)
            buckets[b] = buckets.get(b, 0) + n
        events += [(o.start, 1), (o.start + o.latency, -1)]
    level = peak = 0
    for _, d in sorted(events):
        level += d
        peak = max(peak, level)
    dur = max(duration, 1e-9)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_output_tokens_retokenized": total_retok,
        "request_throughput": completed / dur,
        "input_throughput": total_input / dur,
        "output_throughput": total_output / dur,
        "output_throughput_retokenized": total_retok / dur,
        "total_throughput": (total_input + total_output) / dur,
        "total_throughput_retokenized": (total_input + total_retok) / dur,
        "max_output_tokens_per_s": float(max(buckets.values(), default=0)),
        "max_concurrent_requests": peak,
        "concurrency": float(np.sum(e2es)) / dur if e2es else 0.0,
    }
    m.update(_stats("e2e_latency", e2es, (90, 99)))
    m.update(_stats("ttft", ttfts, (99,)))
    m.update(_stats("tpot", tpots, (99,)))
    m.update(_stats("itl", itls, (95, 99)))
    m["max_itl_ms"] = float(max(itls) * 1000.0) if itls else 0.0
    if slo:
        good = sum(1 for o in outputs if meets_slo(o, slo))
        m.update(
            {
                "goodput_slo_ms": {k: v * 1000.0 for k, v in slo.items()},
                "good_requests": good,
                "request_goodput": good / dur,
            }
        )
    return m


def per_request(rows: list[DatasetRow], outputs: list, t0: float) -> list[dict[str, Any]]:
    """Each request's timeline (seconds from the run's start): when it was sent, its first token
    and end, and its inter-token gaps; what a p99 is made of (a burst's queue, a slow step)."""
    return [
        {
            "sent": o.start - t0,
            "ttft": o.ttft,
            "latency": o.latency,
            "prompt_len": row.prompt_len,
            "output_len": o.output_len,
            "ok": o.success,
            "itl": [round(g, 6) for g in o.itl],
        }
        for row, o in zip(rows, outputs)
    ]


def copied_share(tokenizer, rows: list[DatasetRow], outputs: list, n: int = 4) -> float | None:
    """The share of output tokens inside some run of `n` output tokens that also occurs in the prompt:
    roughly what an n-gram drafter can find (1.0: all copied). None without successful outputs."""
    covered = total = 0
    for row, o in zip(rows, outputs):
        if not o.success:
            continue
        prompt_ids, out_ids = encode(tokenizer, row.prompt), encode(tokenizer, o.generated_text)
        grams = {tuple(prompt_ids[i : i + n]) for i in range(len(prompt_ids) - n + 1)}
        hit = [False] * len(out_ids)
        for i in range(len(out_ids) - n + 1):
            if tuple(out_ids[i : i + n]) in grams:
                hit[i : i + n] = [True] * n
        covered += sum(hit)
        total += len(out_ids)
    return covered / total if total else None


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding over the run, from Relay's scheduler counters: the share of proposed tokens
    accepted, and tokens emitted per verify step (accepted + the target's own)."""
    rows, proposed, accepted = (
        after[k] - before[k]
        for k in ("spec_verify_rows", "spec_proposed_tokens", "spec_accepted_tokens")
    )
    return {
        "spec_verify_rows": rows,
        "spec_acceptance_rate": accepted / max(1, proposed),
        "spec_accept_length": (accepted + rows) / max(1, rows),
    }
