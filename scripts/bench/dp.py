#!/usr/bin/env python3
"""Data-parallel replicas behind sglang-router: cache-aware against round-robin routing.

Starts `python -m launch.serve --dp N` (its router routes cache_aware) and, by hand, a second
sglang-router with --policy round_robin in front of the same replicas (as on a multi-host
setup). Then runs bench_serving.py's generated-shared-prefix workload through each router in
turn, --runs times, alternating which goes first, each run on flushed replica caches; and
reports per policy (medians over the runs):

  cache hit rate   cached prompt tokens / prompt tokens over the run, summed over the replicas'
                   own counters (GET /get_server_info of each replica, before and after)
  TTFT p50 / p99, output tok/s, E2E p50   as bench_serving.py measures them at the client
  per replica      requests, prompt and cached tokens, output tok/s (the replica's /metrics)

With --baseline it first runs the same workload on one server with all the cores (--dp 1).

  python scripts/bench_dp.py                                   # dp 2, 3 runs per policy, baseline
  python scripts/bench_dp.py --runs 1 --gsp-num-groups 4 --no-baseline     # a quick look
  python scripts/bench_dp.py --server-args '--dtype float32' --output-json .bench/dp.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "scripts", "bench")]
import serving as bs  # noqa: E402
from procs.common import terminate  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server or router in a session of its own; its output goes to a log file."""

    def __init__(self, cmd: list[str], log_path: str):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode}; see {self.log_path}")
            time.sleep(0.5)
        raise TimeoutError(f"no {pattern!r} within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        terminate([self.proc], 40, whole_group=True)  # its session: it and all it started
        self.log.close()


def replica_counters(url: str) -> dict[str, float]:
    """The replica's own counters: its scheduler's prompt/cached totals, its http process's requests and
    output tokens."""
    sched = httpx.get(url + "/get_server_info", timeout=30).json()["scheduler"]
    out = {"prompt": sched["prompt_tokens_total"], "cached": sched["cached_prompt_tokens_total"],
           "requests": 0.0, "output": 0.0}
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
    m = asyncio.run(bs.benchmark(args, rows, tokenizer, model, args.max_concurrency))
    after = {name: replica_counters(url) for name, url in replicas.items()}
    per = {}
    for name in replicas:
        d = {k: after[name][k] - before[name][k] for k in before[name]}
        per[name] = {"requests": int(d["requests"]), "prompt_tokens": int(d["prompt"]),
                     "cached_tokens": int(d["cached"]), "hit_rate": d["cached"] / max(1.0, d["prompt"]),
                     "output_tok_s": d["output"] / m["duration"]}
    prompt = sum(p["prompt_tokens"] for p in per.values())
    cached = sum(p["cached_tokens"] for p in per.values())
    return {"hit_rate": cached / max(1, prompt), "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_p50_ms": m["median_ttft_ms"], "ttft_p99_ms": m["p99_ttft_ms"],
            "e2e_p50_ms": m["median_e2e_latency_ms"],
            "output_tok_s": m["output_throughput"], "completed": m["completed"], "failed": m["failed"],
            "duration_s": m["duration"], "replicas": per}


def median_row(runs: list[dict]) -> dict:
    keys = ["hit_rate", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "output_tok_s", "duration_s"]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["replicas"] = {name: {k: statistics.median(r["replicas"][name][k] for r in runs)
                              for k in runs[0]["replicas"][name]} for name in runs[0]["replicas"]}
    return out


def serve(flags: list[str], port: int, log: str, timeout: float) -> tuple[Proc, dict[str, str]]:
    p = Proc([sys.executable, "-m", "launch.serve", "--port", str(port), *flags], log)
    m = p.wait_for(r"Relay is ready: .*", timeout)
    return p, dict(re.findall(r"(dp\d+) (http://127\.0\.0\.1:\d+)", m.group(0))) or {"all": f"http://127.0.0.1:{port}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="runs per policy (medians reported)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="first run the workload on one server with every core (--dp 1)")
    p.add_argument("--server-args", default="", help="more launch.serve flags for every server")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--output-json", default=None, help="append one JSON line with every run and the medians")
    args = p.parse_args()

    # No warm-up inside a run: the replicas' counters are read around it (warm() runs before).
    bench_args = bs.parse_args(["--dataset-name", "generated-shared-prefix", "--ignore-eos", "--disable-tqdm",
                                "--warmup-requests", "0",
                                "--max-concurrency", str(args.max_concurrency),
                                "--gsp-num-groups", str(args.gsp_num_groups),
                                "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
                                "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
                                "--gsp-question-len", str(args.gsp_question_len),
                                "--gsp-output-len", str(args.gsp_output_len)])
    tokenizer = bs.load_tokenizer(None)
    rows = bs.build_dataset(bench_args, tokenizer)
    os.makedirs(os.path.join(ROOT, ".bench"), exist_ok=True)
    extra = shlex.split(args.server_args)
    record: dict = {"timestamp": datetime.now().isoformat(timespec="seconds"), "args": vars(args), "runs": {}}

    if args.baseline:
        port = free_port()
        server, replicas = serve(extra, port, ".bench/dp-baseline.log", args.startup_timeout)
        try:
            model = asyncio.run(_model(f"http://127.0.0.1:{port}"))
            warm(f"http://127.0.0.1:{port}", model)
            record["runs"]["dp1"] = [one_run(f"http://127.0.0.1:{port}", replicas, bench_args, rows, tokenizer, model)
                                     for _ in range(args.runs)]
        finally:
            server.stop()

    port = free_port()
    server, replicas = serve(["--dp", str(args.dp), "--router-prometheus-port", str(free_port()), *extra], port,
                             ".bench/dp-server.log", args.startup_timeout)
    rr_port = free_port()
    router = Proc([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(rr_port),
                   "--worker-urls", *replicas.values(), "--policy", "round_robin", "--prometheus-port",
                   str(free_port()), "--log-level", "warn"], ".bench/dp-router-rr.log")
    try:
        deadline = time.monotonic() + 120
        while _healthy(f"http://127.0.0.1:{rr_port}") != len(replicas):
            if time.monotonic() > deadline:
                raise TimeoutError("the round-robin router did not register the replicas")
            time.sleep(0.5)
        model = asyncio.run(_model(f"http://127.0.0.1:{port}"))
        urls = {"cache_aware": f"http://127.0.0.1:{port}", "round_robin": f"http://127.0.0.1:{rr_port}"}
        for url in urls.values():
            warm(url, model)
        for i in range(args.runs):
            order = ["cache_aware", "round_robin"] if i % 2 == 0 else ["round_robin", "cache_aware"]
            for policy in order:
                r = one_run(urls[policy], replicas, bench_args, rows, tokenizer, model)
                record["runs"].setdefault(policy, []).append(r)
                print(f"run {i + 1} {policy}: hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                      f"output {r['output_tok_s']:.1f} tok/s, per replica "
                      + ", ".join(f"{n}: {v['requests']} req {v['hit_rate']:.2f} hit {v['output_tok_s']:.1f} tok/s"
                                  for n, v in r["replicas"].items()), flush=True)
    finally:
        router.stop()
        server.stop()

    record["medians"] = {k: median_row(v) for k, v in record["runs"].items()}
    if args.output_json:
        with open(args.output_json, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(f"\n| routing | cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | E2E p50 (ms) | output tok/s | per replica: "
          f"requests, hit rate, output tok/s |\n|---|---|---|---|---|---|---|")
    for name, m in record["medians"].items():
        reps = "; ".join(f"{n} {v['requests']:.0f}, {v['hit_rate']:.3f}, {v['output_tok_s']:.1f}"
                         for n, v in m["replicas"].items())
        print(f"| {name} | {m['hit_rate']:.3f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
              f"{m['e2e_p50_ms']:.0f} | {m['output_tok_s']:.1f} | {reps} |")
    return 0


def warm(url: str, model: str | None, n: int = 4) -> None:
    """A few short requests (their own prompts) before anything is measured."""
    for i in range(n):
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": f"Warm-up {i}: count to ten.",
                                                  "max_tokens": 8}, timeout=300).raise_for_status()


def _healthy(url: str) -> int:
    try:
        return httpx.get(url + "/readiness", timeout=5).json().get("healthy_workers", 0)
    except (httpx.HTTPError, ValueError):
        return 0


async def _model(url: str) -> str | None:
    import aiohttp
    async with aiohttp.ClientSession() as s:
        return await bs.resolve_model(s, url)


if __name__ == "__main__":
    sys.exit(main())
