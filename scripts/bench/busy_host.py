#!/usr/bin/env python3
"""A short request's latency on a host whose cores other processes keep busy (issue 39, item 8).

Starts `python -m launch.serve` (default flags unless given after --) from one checkout, or from
each of several to compare them (a `git worktree` of an older commit), then measures each server
in turn, round after round (so load from outside the benchmark falls on all of them alike):

  quiet   a 4-token completion's latency (median over the rounds) and one request's decode speed
          (a 128-token completion: tokens after the first / the time after the first)
  busy    the same with --busy processes spinning (`while True: pass`, one per core by default)
  after   the quiet figures again once the busy processes have gone (the threads come back)

  python scripts/bench_busy_host.py                               # this checkout, default flags
  python scripts/bench_busy_host.py -- --num-threads 1            # with launch.serve flags
  python scripts/bench_busy_host.py --checkout /tmp/old --checkout .   # two checkouts, A/B
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
LONG = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 128, "temperature": 0,
        "ignore_eos": True, "stream": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(checkout: str, port: int, flags: list[str]) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--port", str(port), *flags], cwd=checkout,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": f"{checkout}:{checkout}/src"})
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "Relay is ready" in line:
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, lines
    raise RuntimeError("the server did not start:\n" + "".join(lines[-40:]))


def short_latencies(client: httpx.Client, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.monotonic()
        r = client.post("/v1/completions", json=SHORT)
        r.raise_for_status()
        out.append(time.monotonic() - t0)
    return out


def decode_speed(client: httpx.Client) -> float:
    """Tokens per second after the first, one 128-token request alone."""
    first = None
    tokens = 0
    with client.stream("POST", "/v1/completions", json=LONG) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    tokens += 1
                    first = first or time.monotonic()
    return (tokens - 1) / (time.monotonic() - first)


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
    return [{"short_p50_s": round(statistics.median(l), 3), "short_max_s": round(max(l), 3),
             "decode_tok_s": round(statistics.median(s), 1)} for l, s in zip(lat, speed)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", action="append", help="a checkout to serve from (repeat to compare; default: this)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per phase")
    p.add_argument("--reps", type=int, default=2, help="4-token requests per server and round")
    p.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)), help="busy processes")
    p.add_argument("--settle", type=float, default=3.0, help="seconds between a load change and measuring")
    p.add_argument("flags", nargs="*", help="launch.serve flags (after --)")
    args = p.parse_args()
    checkouts = [os.path.abspath(c) for c in args.checkout or [ROOT]]
    ports = [free_port() for _ in checkouts]
    servers = []
    try:
        for checkout, port in zip(checkouts, ports):
            servers.append(start(checkout, port, args.flags))
        clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) for port in ports]
        for c in clients:
            short_latencies(c, 2)  # warm
        results = {"quiet": phase(clients, args.rounds, args.reps)}
        print("quiet", results["quiet"], flush=True)
        busy = spin(args.busy)
        try:
            time.sleep(args.settle)
            results["busy"] = phase(clients, args.rounds, args.reps)
            print(f"busy x{args.busy}", results["busy"], flush=True)
        finally:
            for b in busy:
                b.kill()
                b.wait()
        time.sleep(args.settle)
        results["after"] = phase(clients, args.rounds, args.reps)
        print("after", results["after"], flush=True)
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(60)
    for i, (checkout, (_, lines)) in enumerate(zip(checkouts, servers)):
        changes = [l.strip() for l in lines if "compute thread" in l]
        print(json.dumps({"checkout": checkout, "flags": args.flags, "busy_processes": args.busy,
                          **{k: v[i] for k, v in results.items()}, "thread_changes": len(changes)}))
        for line in changes[-4:]:
            print("  ", line)
    print("load average at the end:", " ".join(open("/proc/loadavg").read().split()[:3]))


if __name__ == "__main__":
    main()
