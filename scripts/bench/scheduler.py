#!/usr/bin/env python3
"""The scheduler process's own cost per step, and the bytes it sends, under load.

Starts a server (flags after `--`), runs C concurrent streaming requests (random prompts of
128-256 tokens, --output-len tokens each, ignore_eos) and reads the scheduler's counters from
/get_server_info before and after: steps, seconds spent building, encoding and applying steps
(not waiting for the runner), bytes sent to the runners and to the detokenizer, and the step
interval (the load's wall time over its steps): the share an overlapped scheduler could hide.

  python scripts/bench_scheduler.py -- --load-format dummy-null        # the pipeline alone
  python scripts/bench_scheduler.py -- --dtype float32                 # the real model
  python scripts/bench_scheduler.py --offline                          # no processes: exact per-part times
  python scripts/bench_scheduler.py --overlap-ab 3 -- --load-format dummy-null
      # overlap scheduling always (--overlap-min-share 0) vs never, alternating, 3 rounds each

--offline drives the Scheduler alone, in this process, with C running requests (prompts of
128-256 tokens) and a runner that answers at once, and times each part of a decode step:
schedule(), encoding the BatchInput, process_output(), encoding the OutputBatch. On a busy
2-core machine the server's own counters include time the scheduler waited for a core.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact").split()


def start(port: int, flags: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--port", str(port), *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:
        if "Relay is ready" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc
    raise RuntimeError("the server did not start")


async def load(url: str, concurrency: int, requests: int, output_len: int, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(128, 256))) for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one(prompt: str) -> None:
            async with gate:
                body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        await asyncio.gather(*(one(p) for p in prompts))


def offline(concurrency: int, steps: int = 400, warmup: int = 100) -> dict:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]
    import time

    from ipc.codec import encode
    from ipc.messages import OutputBatch
    from relay.scheduling.batch import BatchOutput
    from relay.config import EngineConfig
    from relay.scheduling.request import Req
    from relay.sampling_params import SamplingParams
    from relay.scheduling.scheduler import Scheduler

    s = Scheduler(EngineConfig(page_size=16, chunked_prefill_size=256, max_running_requests=256), 20000, 8192, [2],
                  attention_break_even=3072)
    rng = random.Random(0)
    for i in range(concurrency):
        s.add_request(Req(f"cmpl-{i:032x}", [rng.randrange(3, 40000) for _ in range(rng.randint(128, 256))],
                          SamplingParams(max_new_tokens=100_000, ignore_eos=True)))
    parts = {"schedule": 0.0, "encode_batch": 0.0, "process_output": 0.0, "encode_outputs": 0.0}
    sizes = {"batch": 0, "outputs": 0}
    measured = 0
    for step in range(steps):
        t0 = time.perf_counter()
        batch = s.schedule()
        t1 = time.perf_counter()
        data = encode(batch)
        t2 = time.perf_counter()
        records = s.process_output(batch, BatchOutput(batch.step, [1000 + i % 7 for i, x in enumerate(batch.sample) if x]))
        t3 = time.perf_counter()
        out = encode(OutputBatch(records))
        t4 = time.perf_counter()
        if step >= warmup and batch.is_decode:
            measured += 1
            for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[k] += dt
            sizes["batch"] += len(data)
            sizes["outputs"] += len(out)
    return {"concurrency": concurrency, "decode_steps": measured,
            **{f"{k}_ms": round(1000 * v / measured, 3) for k, v in parts.items()},
            "total_ms": round(1000 * sum(parts.values()) / measured, 3),
            **{f"{k}_bytes": v // measured for k, v in sizes.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=30112)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--overlap-ab", type=int, default=0, metavar="ROUNDS",
                    help="run the server with and without --disable-overlap-schedule, alternating, ROUNDS each")
    ap.add_argument("flags", nargs="*")
    args = ap.parse_args()
    if args.offline:
        print(json.dumps(offline(args.concurrency)))
        return
    if not args.overlap_ab:
        print(json.dumps(serve_and_measure(args, args.flags)))
        return
    modes = {"overlap": [*args.flags, "--overlap-min-share", "0"], "no-overlap": [*args.flags, "--disable-overlap-schedule"]}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.overlap_ab):
        for mode in (modes if r % 2 == 0 else reversed(list(modes))):
            runs[mode].append(serve_and_measure(args, modes[mode]))
            print(json.dumps({"mode": mode, **runs[mode][-1]}), flush=True)
    keys = ("out_tok_s", "step_interval_ms", "busy_ms_per_step")
    print(json.dumps({m: {k: statistics.median(x[k] for x in rs) for k in keys} for m, rs in runs.items()}))


def serve_and_measure(args, flags: list[str]) -> dict:
    proc = start(args.port, flags)
    url = f"http://127.0.0.1:{args.port}"
    try:
        work = lambda: httpx.get(url + "/get_server_info", timeout=60).json()["scheduler"]["step_work"]  # noqa: E731
        before = work()
        started = time.perf_counter()
        asyncio.run(load(url, args.concurrency, args.requests, args.output_len, seed=0))
        wall = time.perf_counter() - started
        after = work()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
    steps = after["steps"] - before["steps"]
    return {
        "flags": flags, "concurrency": args.concurrency, "steps": steps,
        "out_tok_s": round(args.requests * args.output_len / wall, 1),
        "busy_ms_per_step": round(1000 * (after["busy_seconds"] - before["busy_seconds"]) / steps, 3),
        "step_interval_ms": round(1000 * wall / steps, 3),  # what overlap could hide busy_ms of
        "runner_bytes_per_step": round((after["runner_bytes"] - before["runner_bytes"]) / steps),
        "detok_bytes_per_step": round((after["detok_bytes"] - before["detok_bytes"]) / steps),
    }


if __name__ == "__main__":
    main()
