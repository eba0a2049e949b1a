"""dp: data-parallel replicas behind sglang-router: cache-aware against round-robin routing.

Starts `python -m launch.serve --dp N` (its router routes cache_aware) and, by hand, a second
sglang-router with --policy round_robin in front of the same replicas (as on a multi-host
setup). Then runs the serving subcommand's generated-shared-prefix workload through each router in
turn, --runs times, alternating which goes first, each run on flushed replica caches; and
reports per policy (medians over the runs):

  cache hit rate   cached prompt tokens / prompt tokens over the run, summed over the replicas'
                   own counters (GET /get_server_info of each replica, before and after)
  TTFT p50 / p99, output tok/s, E2E p50   as the serving subcommand measures them
  per replica      requests, prompt and cached tokens, output tok/s (the replica's /metrics)

With --baseline it first runs the same workload on one server with all the cores (--dp 1).

  python -m scripts.bench dp                                   # dp 2, 3 runs per policy, baseline
  python -m scripts.bench dp --runs 1 --gsp-num-groups 4 --no-baseline     # a quick look
  python -m scripts.bench dp --server-args '--dtype float32' --output-json .bench/dp.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import statistics
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from scripts.bench import serving
from scripts.bench.client import benchmark, complete, model_name, server_info
from scripts.bench.results import BENCH_DIR, ResultFile
from scripts.bench.servers import Server, free_port, relay_server
from scripts.bench.table import markdown
from scripts.bench.workloads import build_dataset, load_tokenizer


def replica_counters(url: str) -> dict[str, float]:
    """The replica's own counters: its scheduler's prompt/cached totals, its http process's requests and
    output tokens."""
    sched = server_info(url)["scheduler"]
    out = {
        "prompt": sched["prompt_tokens_total"],
        "cached": sched["cached_prompt_tokens_total"],
        "requests": 0.0,
        "output": 0.0,
    }
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "relay:requests_total":
                out["requests"] += s.value
            elif s.name == "relay:generation_tokens_total":
                out["output"] += s.value
    return out


def one_run(router_url: str, replicas: dict[str, str], bench_args, rows, tokenizer, model) -> dict:
    for url in replicas.values():
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    before = {name: replica_counters(url) for name, url in replicas.items()}
    args = argparse.Namespace(**{**vars(bench_args), "base_url": router_url})
    m = asyncio.run(benchmark(args, rows, tokenizer, model, args.max_concurrency))
    after = {name: replica_counters(url) for name, url in replicas.items()}
    per = {}
    for name in replicas:
        d = {k: after[name][k] - before[name][k] for k in before[name]}
        per[name] = {
            "requests": int(d["requests"]),
            "prompt_tokens": int(d["prompt"]),
            "cached_tokens": int(d["cached"]),
            "hit_rate": d["cached"] / max(1.0, d["prompt"]),
            "output_tok_s": d["output"] / m["duration"],
        }
    prompt = sum(p["prompt_tokens"] for p in per.values())
    cached = sum(p["cached_tokens"] for p in per.values())
    return {
        "hit_rate": cached / max(1, prompt),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_ms": m["median_ttft_ms"],
        "ttft_p99_ms": m["p99_ttft_ms"],
        "e2e_p50_ms": m["median_e2e_latency_ms"],
        "output_tok_s": m["output_throughput"],
        "completed": m["completed"],
        "failed": m["failed"],
        "duration_s": m["duration"],
        "replicas": per,
    }


def median_row(runs: list[dict]) -> dict:
    keys = ["hit_rate", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "output_tok_s", "duration_s"]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["replicas"] = {
        name: {
            k: statistics.median(r["replicas"][name][k] for r in runs)
            for k in runs[0]["replicas"][name]
        }
        for name in runs[0]["replicas"]
    }
    return out


def serve(tag: str, flags: list[str], timeout: float) -> tuple[Server, dict[str, str]]:
    """A Relay server (--dp N: its router in front of N replicas) and its replicas' URLs by name."""
    server = relay_server(tag, free_port(), flags, ready_timeout=timeout).__enter__()
    try:
        m = server.wait_for(r"Relay is ready: .*", timeout)
    except BaseException:
        server.stop()
        raise
    return server, dict(re.findall(r"(dp\d+) (http://127\.0\.0\.1:\d+)", m.group(0))) or {
        "all": server.base_url
    }


def round_robin_router(replicas: dict[str, str], timeout: float) -> Server:
    """sglang-router with --policy round_robin in front of the replicas, once it has registered them all."""
    port = free_port()
    router = Server(
        "round-robin router",
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *replicas.values(),
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
        ],
        port,
        f"{BENCH_DIR}/logs/dp-router-rr.log",
        timeout,
    ).__enter__()
    deadline = time.monotonic() + 120
    while _healthy(router.base_url) != len(replicas):
        if time.monotonic() > deadline:
            router.stop()
            raise TimeoutError("the round-robin router did not register the replicas")
        time.sleep(0.5)
    return router


def print_table(medians: dict[str, dict]) -> None:
    rows = [
        {
            "routing": name,
            **m,
            "per_replica": "; ".join(
                f"{n} {v['requests']:.0f}, {v['hit_rate']:.3f}, {v['output_tok_s']:.1f}"
                for n, v in m["replicas"].items()
            ),
        }
        for name, m in medians.items()
    ]
    print(
        "\n"
        + markdown(
            rows,
            [
                ("routing", "routing"),
                ("cache hit rate", "hit_rate", 3),
                ("TTFT p50 (ms)", "ttft_p50_ms", 0),
                ("TTFT p99 (ms)", "ttft_p99_ms", 0),
                ("E2E p50 (ms)", "e2e_p50_ms", 0),
                ("output tok/s", "output_tok_s"),
                ("per replica: requests, hit rate, output tok/s", "per_replica"),
            ],
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="runs per policy (medians reported)")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the workload on one server with every core (--dp 1)",
    )
    p.add_argument("--server-args", default="", help="more launch.serve flags for every server")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument(
        "--output-json",
        default=None,
        help="append one JSON line (results.py's format) with every run and the medians",
    )
    args = p.parse_args(argv)

    # No warm-up inside a run: the replicas' counters are read around it (warm() runs before).
    bench_args = serving.parse_args(
        [
            "--dataset-name",
            "generated-shared-prefix",
            "--ignore-eos",
            "--disable-tqdm",
            "--warmup-requests",
            "0",
            "--max-concurrency",
            str(args.max_concurrency),
            "--gsp-num-groups",
            str(args.gsp_num_groups),
            "--gsp-prompts-per-group",
            str(args.gsp_prompts_per_group),
            "--gsp-system-prompt-len",
            str(args.gsp_system_prompt_len),
            "--gsp-question-len",
            str(args.gsp_question_len),
            "--gsp-output-len",
            str(args.gsp_output_len),
        ]
    )
    tokenizer = load_tokenizer(None)
    rows = build_dataset(bench_args, tokenizer)
    extra = shlex.split(args.server_args)
    runs: dict[str, list[dict]] = {}

    if args.baseline:
        server, replicas = serve("dp-baseline", extra, args.startup_timeout)
        try:
            model = model_name(server.base_url)
            warm(server.base_url, model)
            runs["dp1"] = [
                one_run(server.base_url, replicas, bench_args, rows, tokenizer, model)
                for _ in range(args.runs)
            ]
        finally:
            server.stop()

    server, replicas = serve(
        "dp-server",
        ["--dp", str(args.dp), "--router-prometheus-port", str(free_port()), *extra],
        args.startup_timeout,
    )
    try:
        router = round_robin_router(replicas, args.startup_timeout)
    except BaseException:
        server.stop()
        raise
    try:
        model = model_name(server.base_url)
        urls = {"cache_aware": server.base_url, "round_robin": router.base_url}
        for url in urls.values():
            warm(url, model)
        for i in range(args.runs):
            order = ["cache_aware", "round_robin"] if i % 2 == 0 else ["round_robin", "cache_aware"]
            for policy in order:
                r = one_run(urls[policy], replicas, bench_args, rows, tokenizer, model)
                runs.setdefault(policy, []).append(r)
                print(
                    f"run {i + 1} {policy}: hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                    f"output {r['output_tok_s']:.1f} tok/s, per replica "
                    + ", ".join(
                        f"{n}: {v['requests']} req {v['hit_rate']:.2f} hit {v['output_tok_s']:.1f} tok/s"
                        for n, v in r["replicas"].items()
                    ),
                    flush=True,
                )
    finally:
        router.stop()
        server.stop()

    medians = {k: median_row(v) for k, v in runs.items()}
    ResultFile(args.output_json, "dp").add({"args": vars(args), "runs": runs, "medians": medians})
    print_table(medians)
    return 0


def warm(url: str, model: str | None, n: int = 4) -> None:
    """A few short requests (their own prompts) before anything is measured."""
    for i in range(n):
        complete(url, model, f"Warm-up {i}: count to ten.", 8)


def _healthy(url: str) -> int:
    try:
        return httpx.get(url + "/readiness", timeout=5).json().get("healthy_workers", 0)
    except (httpx.HTTPError, ValueError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
