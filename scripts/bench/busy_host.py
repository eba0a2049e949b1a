"""busy-host: a short request's latency on a host whose cores other processes keep busy (issue 39, item 8).

Starts `python -m launch.serve` (default flags unless given after --) from one checkout, or from
each of several to compare them (a `git worktree` of an older commit), then measures each server
in turn, round after round (so load from outside the benchmark falls on all of them alike):

  quiet   a 4-token completion's latency (median over the rounds) and one request's decode speed
          (a 128-token completion: tokens after the first / the time after the first)
  busy    the same with --busy processes spinning (`while True: pass`, one per core by default)
  after   the quiet figures again once the busy processes have gone (the threads come back)

  python -m scripts.bench busy-host                               # this checkout, default flags
  python -m scripts.bench busy-host -- --num-threads 1            # with launch.serve flags
  python -m scripts.bench busy-host --checkout /tmp/old --checkout .   # two checkouts, A/B
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import httpx

from scripts.bench.client import stream_times, timed_post
from scripts.bench.results import ROOT, ResultFile
from scripts.bench.servers import Server, free_port, relay_server
from scripts.bench.table import markdown

SHORT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
LONG = {
    "prompt": "Write a long story about a lighthouse keeper.",
    "max_tokens": 128,
    "temperature": 0,
    "ignore_eos": True,
}


def short_latencies(client: httpx.Client, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        status, seconds = timed_post(client, SHORT)
        if status != 200:
            raise RuntimeError(f"a short request failed: {status}")
        out.append(seconds)
    return out


def decode_speed(client: httpx.Client) -> float:
    """Tokens per second after the first, one 128-token request alone."""
    _, arrivals, ended = stream_times(client, LONG)
    return (len(arrivals) - 1) / (ended - arrivals[0])


def spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def phase(clients: list[httpx.Client], rounds: int, reps: int) -> list[dict]:
    """Each server in turn, `rounds` times: reps 4-token requests and one 128-token request."""
    lat: list[list[float]] = [[] for _ in clients]
    speed: list[list[float]] = [[] for _ in clients]
    for _ in range(rounds):
        for i, c in enumerate(clients):
            lat[i] += short_latencies(c, reps)
            speed[i].append(decode_speed(c))
    return [
        {
            "short_p50_s": round(statistics.median(lat_s), 3),
            "short_max_s": round(max(lat_s), 3),
            "decode_tok_s": round(statistics.median(s), 1),
        }
        for lat_s, s in zip(lat, speed)
    ]


def measure(servers: list[Server], args) -> dict[str, list[dict]]:
    """Each phase: quiet, busy (spinning processes), after (they have gone)."""
    clients = [httpx.Client(base_url=s.base_url, timeout=600) for s in servers]
    try:
        for c in clients:
            short_latencies(c, 2)  # warm
        results = {"quiet": phase(clients, args.rounds, args.reps)}
        busy = spin(args.busy)
        try:
            time.sleep(args.settle)
            results[f"busy x{args.busy}"] = phase(clients, args.rounds, args.reps)
        finally:
            for b in busy:
                b.kill()
                b.wait()
        time.sleep(args.settle)
        results["after"] = phase(clients, args.rounds, args.reps)
        return results
    finally:
        for c in clients:
            c.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--checkout",
        action="append",
        help="a checkout to serve from (repeat to compare; default: this)",
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds per phase")
    p.add_argument("--reps", type=int, default=2, help="4-token requests per server and round")
    p.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)), help="busy processes")
    p.add_argument(
        "--settle", type=float, default=3.0, help="seconds between a load change and measuring"
    )
    p.add_argument("--output", default=None, help="results, JSON lines (results.py's format)")
    p.add_argument("flags", nargs="*", help="launch.serve flags (after --)")
    args = p.parse_args(argv)
    checkouts = [os.path.abspath(c) for c in args.checkout or [ROOT]]
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(relay_server(f"busy-host-{i}", free_port(), args.flags, checkout=c))
            for i, c in enumerate(checkouts)
        ]
        results = measure(servers, args)
        logs = [s.log_text() for s in servers]
    out = ResultFile(args.output, "busy-host", flags=args.flags, busy_processes=args.busy)
    rows = []
    for i, (checkout, log) in enumerate(zip(checkouts, logs)):
        changes = [line.strip() for line in log.splitlines() if "compute thread" in line]
        out.add(
            {
                "checkout": checkout,
                **{k: v[i] for k, v in results.items()},
                "thread_changes": len(changes),
            }
        )
        rows += [{"checkout": checkout, "phase": k, **v[i]} for k, v in results.items()]
        for line in changes[-4:]:
            print("  ", line)
    print(
        markdown(
            rows,
            [
                ("checkout", "checkout"),
                ("phase", "phase"),
                ("short p50 (s)", "short_p50_s", 3),
                ("short max (s)", "short_max_s", 3),
                ("decode tok/s", "decode_tok_s"),
            ],
        )
    )
    print("load average at the end:", " ".join(open("/proc/loadavg").read().split()[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
