#!/usr/bin/env python3
"""What a careless or hostile client costs the other users of a Relay server (issue 9's figures).

Starts `python -m launch.serve` from a checkout (this one, or another to compare, e.g. a
`git worktree` of an older commit) under a 1,024-descriptor limit, then measures:

  leak     in-flight requests the server still counts after N requests whose prompt holds a lone
           surrogate (each was a 500 that kept its slot), and whether a normal request then works
  big      latency of a short request sent 0.2 s after a 10 MB prompt, and the big one's answer
  long     latency of a short request sent 1 s after an 8,000-token prompt, and the long one's
  idle     descriptors of relay::http with 1,000 idle or half-open sockets, and a fresh request's fate

  python scripts/bench_hardening.py                        # this checkout, the default model
  python scripts/bench_hardening.py --checkout /tmp/old    # the same against another checkout
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


def start(checkout: str, port: int, flags: list[str]) -> subprocess.Popen:
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--port", str(port), *flags], cwd=checkout,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": f"{checkout}:{checkout}/src"})
    for line in proc.stdout:
        if "Relay is ready" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc
    raise RuntimeError("the server did not start")


def timed(client: httpx.Client, body: dict) -> tuple[int | str, float]:
    t0 = time.monotonic()
    try:
        r = client.post("/v1/completions", json=body)
        return r.status_code, time.monotonic() - t0
    except httpx.HTTPError as e:
        return type(e).__name__, time.monotonic() - t0


def behind(url: str, first: dict, delay: float) -> dict:
    """A short request sent `delay` s after `first`: both latencies."""
    out: dict = {}

    def send_first():
        with httpx.Client(base_url=url, timeout=600) as c:
            out["first_status"], out["first_s"] = timed(c, first)

    t = threading.Thread(target=send_first)
    t.start()
    time.sleep(delay)
    with httpx.Client(base_url=url, timeout=600) as c:
        out["short_status"], out["short_s"] = timed(c, SHORT)
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", default=ROOT)
    ap.add_argument("--port", type=int, default=30111)
    ap.add_argument("--bad-requests", type=int, default=4100)
    ap.add_argument("flags", nargs="*", default=["--dtype", "float32", "--kv-cache-gb", "1"])
    args = ap.parse_args()
    proc = start(args.checkout, args.port, args.flags)
    url = f"http://127.0.0.1:{args.port}"
    res: dict = {"checkout": args.checkout}
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            res["alone"] = dict(zip(("status", "s"), timed(c, SHORT)))
            codes: dict = {}
            for _ in range(args.bad_requests):
                try:
                    r = c.post("/v1/completions", content=b'{"prompt": "\\ud800", "max_tokens": 2}',
                               headers={"content-type": "application/json"})
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                except httpx.HTTPError as e:
                    codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
            try:
                in_flight = c.get("/get_server_info").json().get("num_http_requests")
            except (httpx.HTTPError, ValueError) as e:
                in_flight = f"unknown ({type(e).__name__})"
            res["leak"] = {"bad_request_statuses": codes, "in_flight_after": in_flight,
                           "normal_request_after": timed(c, SHORT)[0]}
        res["big"] = behind(url, {"prompt": "hello world " * 875_000, "max_tokens": 4}, 0.2)
        res["long"] = behind(url, {"prompt": "word " * 7990, "max_tokens": 4}, 1.0)
        socks = []
        for i in range(1000):
            try:
                s = socket.create_connection(("127.0.0.1", args.port), timeout=5)
                if i % 2:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                socks.append(s)
            except OSError:
                break
        with httpx.Client(base_url=url, timeout=10) as c:
            fresh = timed(c, SHORT)[0]
        res["idle"] = {"sockets_opened": len(socks), "http_fds": len(os.listdir(f"/proc/{proc.pid}/fd")),
                       "fresh_request": fresh}
        for s in socks:
            s.close()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
