"""hardening: what a careless or hostile client costs the other users of a Relay server (issue 9's figures).

Starts `python -m launch.serve` from a checkout (this one, or another to compare, e.g. a
`git worktree` of an older commit) under a 1,024-descriptor limit, then measures:

  leak     in-flight requests the server still counts after N requests whose prompt holds a lone
           surrogate (each was a 500 that kept its slot), and whether a normal request then works
  big      latency of a short request sent 0.2 s after a 10 MB prompt, and the big one's answer
  long     latency of a short request sent 1 s after an 8,000-token prompt, and the long one's
  idle     descriptors of relay::http with 1,000 idle or half-open sockets, and a fresh request's fate

  python -m scripts.bench hardening                        # this checkout, the default model
  python -m scripts.bench hardening --checkout /tmp/old    # the same against another checkout
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

import httpx

from scripts.bench.client import server_info, timed_post
from scripts.bench.results import ROOT, ResultFile
from scripts.bench.servers import relay_server
from scripts.bench.table import markdown

SHORT = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


def behind(url: str, first: dict, delay: float) -> dict:
    """A short request sent `delay` s after `first`: both latencies."""
    out: dict = {}

    def send_first():
        with httpx.Client(base_url=url, timeout=600) as c:
            out["first_status"], out["first_s"] = timed_post(c, first)

    t = threading.Thread(target=send_first)
    t.start()
    time.sleep(delay)
    with httpx.Client(base_url=url, timeout=600) as c:
        out["short_status"], out["short_s"] = timed_post(c, SHORT)
    t.join()
    return out


def leak(url: str, bad_requests: int) -> dict:
    """N requests whose prompt holds a lone surrogate, then what the server still counts in flight."""
    codes: dict = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        for _ in range(bad_requests):
            try:
                r = c.post(
                    "/v1/completions",
                    content=b'{"prompt": "\\ud800", "max_tokens": 2}',
                    headers={"content-type": "application/json"},
                )
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            except httpx.HTTPError as e:
                codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
        try:
            in_flight = server_info(url).get("num_http_requests")
        except (httpx.HTTPError, ValueError) as e:
            in_flight = f"unknown ({type(e).__name__})"
        return {
            "bad_request_statuses": codes,
            "in_flight_after": in_flight,
            "normal_request_after": timed_post(c, SHORT)[0],
        }


def idle(url: str, port: int, pid: int) -> dict:
    """1,000 idle or half-open sockets: the http process's descriptors, and a fresh request's fate."""
    socks = []
    try:
        for i in range(1000):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if i % 2:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                socks.append(s)
            except OSError:
                break
        with httpx.Client(base_url=url, timeout=10) as c:
            fresh = timed_post(c, SHORT)[0]
        return {
            "sockets_opened": len(socks),
            "http_fds": len(os.listdir(f"/proc/{pid}/fd")),
            "fresh_request": fresh,
        }
    finally:
        for s in socks:
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkout", default=ROOT)
    ap.add_argument("--port", type=int, default=30111)
    ap.add_argument("--bad-requests", type=int, default=4100)
    ap.add_argument("--output", default=None, help="results, JSON lines (results.py's format)")
    ap.add_argument("flags", nargs="*", default=["--dtype", "float32", "--kv-cache-gb", "1"])
    args = ap.parse_args(argv)
    checkout = os.path.abspath(args.checkout)
    res: dict = {"checkout": checkout}
    with relay_server(
        "hardening", args.port, args.flags, checkout=checkout, fd_limit=1024
    ) as server:
        url = server.base_url
        with httpx.Client(base_url=url, timeout=600) as c:
            res["alone"] = dict(zip(("status", "s"), timed_post(c, SHORT)))
        res["leak"] = leak(url, args.bad_requests)
        res["big"] = behind(url, {"prompt": "hello world " * 875_000, "max_tokens": 4}, 0.2)
        res["long"] = behind(url, {"prompt": "word " * 7990, "max_tokens": 4}, 1.0)
        res["idle"] = idle(url, args.port, server.proc.pid)
    ResultFile(args.output, "hardening").add(res)
    rows = [
        {
            "case": case,
            "result": ", ".join(f"{k} {v}" for k, v in value.items())
            if isinstance(value, dict)
            else value,
        }
        for case, value in res.items()
    ]
    print(markdown(rows, [("case", "case"), ("result", "result")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
