"""goodput: goodput under a latency target: Relay's adaptive batching against fixed step limits, in one run.

Poisson arrivals at each --rates value (random prompts of 64-2,048 tokens, 64-192 output tokens, ignore_eos)
against one server per configuration, started one at a time:

  default     Relay as it starts with no flags (fixed limits)
  adaptive    --target-itl-ms T --target-ttft-ms F (the scheduler steers its limits)
  cps-N       --chunked-prefill-size N for each N in --grid (the fixed settings an operator could pick)

Goodput is completed requests per second whose own p99 inter-token gap is <= T and whose TTFT is <= F
(serving --goodput). Writes one JSON line per run to --output, prints a table and the summary the issue
asks for (the highest rate where the default still meets T; adaptive vs default and vs the best fixed setting
there), and with --plot a PNG of goodput and p99 ITL against request rate.

  python -m scripts.bench goodput --rates 0.25,0.5,1,1.5 --target-itl-ms 30 --target-ttft-ms 5000 \\
      --grid 32,64,128 --duration 60 --plot docs/img/goodput.png
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import datetime
from typing import Any

from scripts.bench import serving
from scripts.bench.results import BENCH_DIR, ResultFile, machine
from scripts.bench.servers import relay_server
from scripts.bench.table import markdown
from scripts.bench.workloads import load_tokenizer


def configs(args) -> list[tuple[str, list[str]]]:
    out = [
        ("default", []),
        (
            "adaptive",
            [
                "--target-itl-ms",
                str(args.target_itl_ms),
                "--target-ttft-ms",
                str(args.target_ttft_ms),
            ],
        ),
    ]
    out += [(f"cps-{n}", ["--chunked-prefill-size", str(n)]) for n in args.grid]
    return [c for c in out if not args.only or c[0] in args.only]


def bench_args(args, url: str, rate: float, i: int, label: str) -> argparse.Namespace:
    n = max(args.min_prompts, math.ceil(rate * args.duration))
    return serving.parse_args(
        [
            "--base-url",
            url,
            "--dataset-name",
            "random",
            "--num-prompts",
            str(n),
            "--random-input-len",
            "1056",
            "--random-input-range-ratio",
            str(992 / 1056),  # 64..2048
            "--random-output-len",
            "128",
            "--random-output-range-ratio",
            "0.5",
            "--ignore-eos",
            "--request-rate",
            str(rate),
            "--seed",
            str(100 + i),  # the same prompts for every configuration
            "--goodput",
            f"ttft:{args.target_ttft_ms} itl:{args.target_itl_ms}",
            "--flush-cache",
            "--label",
            label,
            "--disable-tqdm",
        ]
    )


def run_config(
    args, name: str, flags: list[str], tokenizer, out: ResultFile
) -> list[dict[str, Any]]:
    runs = []
    with relay_server(
        name, args.port, [*flags, *args.relay_args.split()], ready_timeout=600.0
    ) as server:
        for i, rate in enumerate(args.rates):
            m = serving.run(bench_args(args, server.base_url, rate, i, name), tokenizer)[0]
            runs.append(
                out.add({**m, "bench": "goodput", "config": name, "flags": flags, "rate": rate})
            )
    return runs


def summary(runs: list[dict[str, Any]], target_itl_ms: float) -> list[str]:
    by = {(r["config"], r["rate"]): r for r in runs}
    rates = sorted({r["rate"] for r in runs})
    met = [
        rate
        for rate in rates
        if ("default", rate) in by and by[("default", rate)]["p99_itl_ms"] <= target_itl_ms
    ]
    rate = max(met) if met else rates[0]
    why = (
        "the highest rate where the default meets the target"
        if met
        else "the default meets the target at no rate: the lowest rate"
    )
    lines = [f"At {rate:g} req/s ({why}):"]
    good = {c: r["request_goodput"] for (c, x), r in by.items() if x == rate}
    fixed = {c: g for c, g in good.items() if c != "adaptive"}
    if "adaptive" in good and "default" in good:
        lines.append(
            f"  adaptive goodput {good['adaptive']:.3f} vs default {good['default']:.3f} req/s "
            f"({good['adaptive'] / max(good['default'], 1e-9):.2f}x)"
        )
    if "adaptive" in good and fixed:
        best = max(fixed, key=fixed.get)
        lines.append(
            f"  best fixed setting {best}: {fixed[best]:.3f} req/s; adaptive/best "
            f"{good['adaptive'] / max(fixed[best], 1e-9):.2f}"
        )
    adaptive_ok = [
        r["rate"] for r in runs if r["config"] == "adaptive" and r["p99_itl_ms"] <= target_itl_ms
    ]
    lines.append(f"  adaptive p99 ITL <= {target_itl_ms:g} ms at rates {adaptive_ok}")
    return lines


COLUMNS = [
    ("config", "config"),
    ("rate (req/s)", lambda r: f"{r['rate']:g}"),
    ("goodput (req/s)", "request_goodput", 3),
    ("good / done", lambda r: f"{r['good_requests']} / {r['completed']}"),
    ("out tok/s", "output_throughput"),
    ("TTFT p50 / p99 (ms)", lambda r: f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}"),
    ("ITL p50 / p99 (ms)", lambda r: f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f}"),
]


def plot(runs: list[dict[str, Any]], path: str, target_itl_ms: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["config"] for r in runs):
        mine = sorted((r for r in runs if r["config"] == name), key=lambda r: r["rate"])
        xs = [r["rate"] for r in mine]
        a.plot(xs, [r["request_goodput"] for r in mine], marker="o", label=name)
        b.plot(xs, [r["p99_itl_ms"] for r in mine], marker="o", label=name)
    b.axhline(target_itl_ms, color="k", ls="--", lw=1, label="target")
    a.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput")
    b.set(
        xlabel="request rate (req/s)",
        ylabel="p99 ITL (ms)",
        title="p99 inter-token latency",
        yscale="log",
    )
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rates", default="0.25,0.5,1,1.5", help="request rates (req/s), Poisson arrivals"
    )
    p.add_argument("--target-itl-ms", type=float, default=30.0)
    p.add_argument("--target-ttft-ms", type=float, default=5000.0)
    p.add_argument(
        "--grid", default="32,64,128", help="fixed --chunked-prefill-size values to compare"
    )
    p.add_argument(
        "--only", default="", help="comma-separated configurations to run (default: all)"
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--relay-args", default="", help="extra flags for every Relay server")
    p.add_argument(
        "--output",
        default=os.path.join(BENCH_DIR, f"goodput-{datetime.now():%Y%m%d-%H%M}.jsonl"),
        help="results, JSON lines (results.py's format)",
    )
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    args.grid = [int(x) for x in args.grid.split(",") if x.strip()]
    args.only = [x for x in args.only.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(None)
    out = ResultFile(args.output, "goodput")
    runs: list[dict[str, Any]] = []
    for name, flags in configs(args):
        runs += run_config(args, name, flags, tokenizer, out)
    print("\n" + markdown(runs, COLUMNS) + "\n")
    print("\n".join(summary(runs, args.target_itl_ms)))
    print(f"machine: {machine()}")
    if args.plot:
        plot(
            runs,
            args.plot,
            args.target_itl_ms,
            f"SmolLM2-135M, random 64-2,048 in / 64-192 out, target p99 ITL {args.target_itl_ms:g} ms, "
            f"TTFT {args.target_ttft_ms:g} ms; {machine()}",
        )
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
