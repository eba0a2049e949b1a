"""structured: grammar-constrained decoding's cost: constrained vs unconstrained serving in one run, and the
first-token latency of a first-seen schema vs a cached one.

Starts one Relay server (default model unless --model), then per round and per concurrency
level (alternating which mode goes first) runs the serving subcommand's random workload
(prompts of 128-256 tokens) twice on /v1/completions: unconstrained (ignore_eos, exactly
--output-len tokens, 192 by default, about what the schema's outputs run to) and with a moderately complex JSON schema as response_format (an array of
4 objects with bounded integers, enums, short strings and nested arrays, ~200 tokens with this
tokenizer's one-digit number tokens, ending where the schema does). Output tok/s and ITL are per token, so the lengths need not match.

Then, one request at a time: TTFT of a schema the server has never seen (compiled on the
scheduler's grammar thread before the request is admitted) and of the same schema again
(cached), with the compile time the server reports (/get_server_info grammar counters).

  python -m scripts.bench structured --rounds 2 --output .bench/structured.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid

import httpx

from scripts.bench import serving
from scripts.bench.client import stream_times
from scripts.bench.results import ResultFile, machine
from scripts.bench.servers import relay_server
from scripts.bench.table import markdown
from scripts.bench.workloads import load_tokenizer

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "tags": {
            "type": "array",
            "items": {"enum": ["new", "classic", "popular", "rare"]},
            "maxItems": 2,
        },
    },
    "required": ["id", "name", "kind", "rating", "tags"],
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 4, "maxItems": 4}


def response_format(schema: dict) -> dict:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "items", "schema": schema},
        }
    }


def serving_run(base_url: str, c: int, mode: str, args, tokenizer, seed: int) -> dict:
    n = max(16, min(128, 4 * c))
    argv = [
        "--base-url",
        base_url,
        "--backend",
        "relay-openai",
        "--dataset-name",
        "random",
        "--num-prompts",
        str(n),
        "--random-input-len",
        "256",
        "--random-input-range-ratio",
        "0.5",
        "--random-output-len",
        str(args.output_len),
        "--random-output-range-ratio",
        "1",
        "--max-concurrency",
        str(c),
        "--seed",
        str(seed),
        "--warmup-requests",
        "2",
        "--disable-tqdm",
        "--label",
        mode,
        "--flush-cache",
    ]  # both modes send the same prompts: neither may find the other's in the cache
    if mode == "unconstrained":
        argv.append("--ignore-eos")
    else:
        argv += [
            "--random-output-len",
            str(args.constrained_max_tokens),
            "--extra-request-body",
            json.dumps(response_format(SCHEMA)),
        ]
    (m,) = serving.run(serving.parse_args(argv), tokenizer)
    return {
        "mode": mode,
        "max_concurrency": c,
        "tokens_per_request": m["total_output_tokens"] / max(1, m["completed"]),
        **{
            k: m.get(k)
            for k in (
                "output_throughput",
                "completed",
                "total_output_tokens",
                "median_ttft_ms",
                "p99_ttft_ms",
                "median_itl_ms",
                "p99_itl_ms",
                "first_error",
            )
        },
    }


def grammar_counters(client: httpx.Client) -> dict:
    return client.get("/get_server_info").json()["scheduler"]["grammar"]


def ttft_ms(client: httpx.Client, schema: dict) -> float:
    body = {
        "prompt": "List eight items as JSON:",
        "max_tokens": 4,
        "temperature": 0,
        **response_format(schema),
    }
    sent, arrivals, _ = stream_times(client, body)
    if not arrivals:
        raise RuntimeError("no token streamed")
    return (arrivals[0] - sent) * 1e3


def first_seen_vs_cached(base_url: str, trials: int) -> dict:
    first, cached, compile_ms = [], [], []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for _ in range(trials):
            # A new property name makes a schema the server has never compiled.
            schema = {
                **SCHEMA,
                "items": {
                    **ITEM,
                    "properties": {
                        **ITEM["properties"],
                        f"k{uuid.uuid4().hex[:8]}": {"type": "boolean"},
                    },
                },
            }
            before = grammar_counters(client)["compile_seconds_sum"]
            first.append(ttft_ms(client, schema))
            compile_ms.append((grammar_counters(client)["compile_seconds_sum"] - before) * 1e3)
            cached.append(ttft_ms(client, schema))
    med = statistics.median
    return {
        "first_seen_ttft_ms": med(first),
        "cached_ttft_ms": med(cached),
        "compile_ms": med(compile_ms),
        "trials": trials,
        "first_seen_within_target": med(first) <= 2 * med(cached) + med(compile_ms),
    }


COLUMNS = (
    [("conc.", "max_concurrency")]
    + [
        (f"{mode} {title}", f"{mode}_{key}")
        for mode in ("unconstrained", "json_schema")
        for title, key in (
            ("tok/s", "output_throughput"),
            ("ITL p50 (ms)", "median_itl_ms"),
            ("ITL p99 (ms)", "p99_itl_ms"),
            ("TTFT p50 (ms)", "median_ttft_ms"),
        )
    ]
    + [("constrained / free", "ratio", 2)]
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--output-len",
        type=int,
        default=192,
        help="unconstrained requests' output tokens (the schema's outputs run ~195)",
    )
    p.add_argument(
        "--constrained-max-tokens", type=int, default=384, help="constrained requests' max_tokens"
    )
    p.add_argument("--ttft-trials", type=int, default=5)
    p.add_argument("--port", type=int, default=30131)
    p.add_argument("--server-args", default="", help="extra `python -m launch.serve` flags")
    p.add_argument("--output", default=None, help="results, JSON lines (results.py's format)")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = load_tokenizer(None)
    out = ResultFile(args.output, "structured")
    runs = []
    with relay_server(
        "structured", args.port, args.server_args.split(), ready_timeout=600
    ) as server:
        for r in range(args.rounds):
            for c in levels:
                modes = ["unconstrained", "json_schema"][:: 1 if r % 2 == 0 else -1]
                for mode in modes:
                    print(f"\n--- round {r + 1} c={c} {mode}", flush=True)
                    runs.append(
                        out.add(
                            {
                                "round": r + 1,
                                **serving_run(server.base_url, c, mode, args, tokenizer, 1 + r),
                            }
                        )
                    )
        ttft = first_seen_vs_cached(server.base_url, args.ttft_trials)
        with httpx.Client(base_url=server.base_url) as client:
            counters = grammar_counters(client)
    summary = summarise(runs, levels)
    out.add({"summary": summary, "ttft": ttft, "grammar": counters})
    print(f"\n{machine()}\n\n{markdown(summary, COLUMNS)}\n")
    print(json.dumps({"ttft": ttft, "mask_step_share": counters["mask_step_share"]}, indent=2))
    return 0


def summarise(runs: list[dict], levels: list[int]) -> list[dict]:
    """Per level: medians over rounds of each mode, and constrained / unconstrained throughput."""
    out = []
    for c in levels:
        row: dict = {"max_concurrency": c}
        for mode in ("unconstrained", "json_schema"):
            ms = [x for x in runs if x["max_concurrency"] == c and x["mode"] == mode]
            for key in ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_ttft_ms"):
                vals = [x[key] for x in ms if x.get(key) is not None]
                row[f"{mode}_{key}"] = statistics.median(vals) if vals else None
        u, j = row["unconstrained_output_throughput"], row["json_schema_output_throughput"]
        row["ratio"] = j / u if u and j else None
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
