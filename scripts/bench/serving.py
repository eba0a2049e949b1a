#!/usr/bin/env python3
"""serving: a streaming load run against one running server (Relay or any OpenAI-compatible one).

Metric-compatible with SGLang's `python -m sglang.bench_serving`: the same workloads (`random`,
`generated-shared-prefix`, plus `copy`, see workloads.py), the same metric names and definitions (metrics.py),
a report laid out the same way. On the copy workload the report adds the share of output tokens copied from
the prompt (inside a run of 4 output tokens that also occurs in the prompt). When the server is Relay
(GET /get_server_info answers with a "scheduler" object) it adds the prefix-cache hit rate over the run (the
delta of cached_prompt_tokens_total / the delta of prompt_tokens_total, warm-up excluded) and, with
speculative decoding, the acceptance rate.

  python -m scripts.bench serving --dataset-name random --num-prompts 128 --random-input-len 512 \\
      --random-output-len 256 --random-range-ratio 0.25 --max-concurrency 8 --ignore-eos
  python -m scripts.bench serving --backend openai --base-url http://127.0.0.1:8080 ...     # llama-server
  python -m scripts.bench serving --dataset-name generated-shared-prefix --gsp-num-groups 8 \\
      --gsp-prompts-per-group 16 --gsp-system-prompt-len 1024 --gsp-question-len 64 --gsp-output-len 128
  python -m scripts.bench serving --dataset-name copy --num-prompts 32 --copy-passage-len 200 \\
      --copy-output-len 256 --max-concurrency 4              # no --ignore-eos: copies end by themselves
  python -m scripts.bench serving --sweep-concurrency 1,8,32 --plot docs/img/sweep.png ...
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

from scripts.bench.client import BACKENDS, DEFAULT_BASE_URL, benchmark, resolve_model
from scripts.bench.plots import plot_sweep
from scripts.bench.results import ResultFile, args_record
from scripts.bench.workloads import DATASETS, build_dataset, load_tokenizer


def print_report(args, m: dict[str, Any]) -> None:
    def line(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        text = (
            fmt.format(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else str(value)
        )
        print(f"{label:<41}{text}")

    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Backend:", args.backend, "{}")
    line("Dataset:", args.dataset_name, "{}")
    line("Traffic request rate:", args.request_rate, "{}")
    line(
        "Max request concurrency:",
        args.max_concurrency if args.max_concurrency else "not set",
        "{}",
    )
    line("Successful requests:", m["completed"], "{:<10}")
    if m["failed"]:
        line("Failed requests:", m["failed"], "{:<10}")
    line("Benchmark duration (s):", m["duration"])
    line("Total input tokens:", m["total_input_tokens"], "{:<10}")
    line("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    line("Total generated tokens (retokenized):", m["total_output_tokens_retokenized"], "{:<10}")
    line("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        line(f"Request goodput (req/s, {args.goodput}):", m["request_goodput"])
    line("Input token throughput (tok/s):", m["input_throughput"])
    line("Output token throughput (tok/s):", m["output_throughput"])
    line("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    line("Peak concurrent requests:", m["max_concurrent_requests"], "{:<10}")
    line("Total token throughput (tok/s):", m["total_throughput"])
    line("Concurrency:", m["concurrency"])
    if m.get("copied_output_share") is not None:
        line("Output tokens copied from the prompt:", m["copied_output_share"], "{:<10.4f}")
    if m.get("cache_hit_rate") is not None:
        line("Prefix cache hit rate (server):", m["cache_hit_rate"], "{:<10.4f}")
    if m.get("spec_verify_rows"):
        line("Speculation acceptance rate:", m["spec_acceptance_rate"], "{:<10.4f}")
        line("Speculation accept length:", m["spec_accept_length"])
    if m.get("usage_cache_hit_rate") is not None:
        line(
            "Cached prompt tokens (usage):",
            f"{m['usage_cached_tokens']} of {m['usage_prompt_tokens']} "
            f"({m['usage_cache_hit_rate']:.2%})",
            "{}",
        )
    three = ("mean", "median", "p99")
    for title, label, key, stats in (
        ("End-to-End Latency", "E2E Latency", "e2e_latency", three),
        ("Time to First Token", "TTFT", "ttft", three),
        ("Time per Output Token (excl. 1st token)", "TPOT", "tpot", three),
        ("Inter-Token Latency", "ITL", "itl", ("mean", "median", "p95", "p99", "max")),
    ):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in stats:
            line(f"{stat.capitalize()} {label} (ms):", m[f"{stat}_{key}_ms"])
    print(
        "(ITL: a chunk carrying k tokens counts as k gaps of gap/k; k "
        + (
            "from the server's token counts)"
            if m.get("itl_k_source") == "server"
            else "estimated by re-tokenizing the streamed text)"
        )
    )
    print("=" * 50, flush=True)


def run(args, tokenizer=None) -> list[dict[str, Any]]:
    """Run one benchmark (or one per --sweep-concurrency level); print reports; return the result dicts."""
    if tokenizer is None:
        tokenizer = load_tokenizer(args.tokenizer)

    async def main() -> list[dict[str, Any]]:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            model = args.model or (
                None if args.backend == "relay-native" else await resolve_model(s, args.base_url)
            )
        levels = (
            [int(x) for x in args.sweep_concurrency.split(",") if x.strip()]
            if args.sweep_concurrency
            else [args.max_concurrency]
        )
        out = ResultFile(args.output_json, "serving")
        runs = []
        for i, c in enumerate(levels):
            # Each sweep level gets its own prompts (seed + i): repeating a level's prompts would hit the
            # prefix cache of the previous level.
            level_args = argparse.Namespace(
                **{
                    **vars(args),
                    "max_concurrency": c,
                    "seed": args.seed + (i if args.sweep_concurrency else 0),
                }
            )
            rows = build_dataset(level_args, tokenizer)
            m = await benchmark(level_args, rows, tokenizer, model, c)
            m.update(
                {
                    "backend": args.backend,
                    "dataset_name": args.dataset_name,
                    "base_url": args.base_url,
                    "model": model,
                    "max_concurrency": c,
                    "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                    "num_prompts": len(rows),
                    "label": args.label,
                    "args": args_record(level_args),
                }
            )
            print_report(level_args, m)
            if m.get("first_error"):
                print(f"first error: {m['first_error']}", flush=True)
            runs.append(out.add(m))
        return runs

    runs = asyncio.run(main())
    if args.sweep_concurrency and args.plot:
        plot_sweep(
            {args.label or args.backend: runs},
            args.plot,
            title=f"{args.dataset_name}: {runs[0]['num_prompts']} requests per level",
        )
        print(f"plot: {args.plot}")
    return runs


# ---------------------------------------------------------------------------------- CLI ---


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="relay-openai",
        help="relay-openai: POST /v1/completions (stream); relay-native: POST /generate (stream, "
        "cumulative text); openai: any OpenAI-compatible /v1/completions (llama-server too)",
    )
    p.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir for building prompts and counting tokens (default: Relay's converted "
        "default model dir)",
    )
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument(
        "--num-prompts", type=int, default=128, help="random and copy datasets: number of requests"
    )
    p.add_argument("--random-input-len", type=int, default=512)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * ratio, len] (SGLang's semantics)",
    )
    p.add_argument(
        "--random-input-range-ratio",
        type=float,
        default=None,
        help="override --random-range-ratio for input lengths",
    )
    p.add_argument(
        "--random-output-range-ratio",
        type=float,
        default=None,
        help="override --random-range-ratio for output lengths",
    )
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=128)
    p.add_argument(
        "--copy-passage-len",
        type=int,
        default=200,
        help="copy dataset: tokens (about) of the passage each prompt asks to have repeated",
    )
    p.add_argument(
        "--copy-output-len",
        type=int,
        default=256,
        help="copy dataset: max output tokens (the answer usually ends at EOS before)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no cap)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals; inf sends them all at once",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="short requests (own random prompts, 8 tokens out) sent before the timed run",
    )
    p.add_argument(
        "--goodput",
        default=None,
        help="SLOs for goodput, e.g. 'ttft:2000 itl:30' (ms; itl is each request's p99 gap)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: generate exactly the output length",
    )
    p.add_argument(
        "--flush-cache", action="store_true", help="POST /flush_cache before the run (Relay/SGLang)"
    )
    p.add_argument(
        "--extra-request-body", default=None, help="JSON object merged into every request body"
    )
    p.add_argument("--request-timeout", type=float, default=3 * 3600.0, help="seconds per request")
    p.add_argument(
        "--output-json",
        default=None,
        help="append one JSON line per run (results.py's format: every metric + the args)",
    )
    p.add_argument(
        "--label", default=None, help="a name for this run in the JSON and the plot legend"
    )
    p.add_argument(
        "--per-request",
        action="store_true",
        help="also keep each request's timeline in the result (sent, TTFT, latency, gaps)",
    )
    p.add_argument(
        "--sweep-concurrency",
        default=None,
        help="comma-separated max-concurrency levels to run in turn, e.g. 1,8,32",
    )
    p.add_argument("--plot", default=None, help="with --sweep-concurrency: write a PNG plot here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = run(args)
    return 0 if all(r["completed"] > 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
