"""scheduler: the scheduler process's own cost per step, and the bytes it sends, under load.

Starts a server (flags after `--`), runs C concurrent streaming requests (random prompts of
128-256 tokens, --output-len tokens each, ignore_eos) and reads the scheduler's counters from
/get_server_info before and after: steps, seconds spent building, encoding and applying steps
(not waiting for the runner), bytes sent to the runners and to the detokenizer, and the step
interval (the load's wall time over its steps): the share an overlapped scheduler could hide.

  python -m scripts.bench scheduler -- --load-format dummy-null        # the pipeline alone
  python -m scripts.bench scheduler -- --dtype float32                 # the real model
  python -m scripts.bench scheduler --offline                          # no processes: exact per-part times
  python -m scripts.bench scheduler --overlap-ab 3 -- --load-format dummy-null
      # overlap scheduling always (--overlap-min-share 0) vs never, alternating, 3 rounds each

--offline drives the Scheduler alone, in this process, with C running requests (prompts of
128-256 tokens) and a runner that answers at once, and times each part of a decode step:
schedule(), encoding the BatchInput, process_output(), encoding the OutputBatch. On a busy
2-core machine the server's own counters include time the scheduler waited for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from scripts.bench import serving
from scripts.bench.client import benchmark, server_info
from scripts.bench.results import ResultFile
from scripts.bench.servers import relay_server
from scripts.bench.table import markdown
from scripts.bench.workloads import DatasetRow, load_tokenizer

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case "
    "point government company number group problem fact"
).split()


def word_rows(requests: int, output_len: int, seed: int) -> list[DatasetRow]:
    """Prompts of 128-256 common English words (what the tokenizer makes of them is the prompt length)."""
    rng = random.Random(seed)
    return [
        DatasetRow(" ".join(rng.choice(WORDS) for _ in range(rng.randint(128, 256))), 0, output_len)
        for _ in range(requests)
    ]


def load(url: str, concurrency: int, rows: list[DatasetRow], tokenizer) -> dict:
    """The rows streamed with at most `concurrency` in flight, through the one client (no warm-up: the
    server's counters are read around the load)."""
    args = serving.parse_args(
        ["--base-url", url, "--ignore-eos", "--warmup-requests", "0", "--disable-tqdm"]
    )
    return asyncio.run(benchmark(args, rows, tokenizer, None, concurrency))


def offline(concurrency: int, steps: int = 400, warmup: int = 100) -> dict:
    from ipc.codec import encode
    from ipc.messages import OutputBatch
    from relay.config import EngineConfig
    from relay.sampling_params import SamplingParams
    from relay.scheduling.request import Req
    from relay.scheduling.scheduler import Scheduler
    from relay.step import BatchOutput

    s = Scheduler(
        EngineConfig(page_size=16, chunked_prefill_size=256, max_running_requests=256),
        20000,
        8192,
        [2],
        attention_break_even=3072,
    )
    rng = random.Random(0)
    for i in range(concurrency):
        s.add_request(
            Req(
                f"cmpl-{i:032x}",
                [rng.randrange(3, 40000) for _ in range(rng.randint(128, 256))],
                SamplingParams(max_new_tokens=100_000, ignore_eos=True),
            )
        )
    parts = {"schedule": 0.0, "encode_batch": 0.0, "process_output": 0.0, "encode_outputs": 0.0}
    sizes = {"batch": 0, "outputs": 0}
    measured = 0
    for step in range(steps):
        t0 = time.perf_counter()
        batch = s.schedule()
        t1 = time.perf_counter()
        data = encode(batch)
        t2 = time.perf_counter()
        records = s.process_output(
            batch, BatchOutput(batch.step, [1000 + i % 7 for i, x in enumerate(batch.sample) if x])
        )
        t3 = time.perf_counter()
        out = encode(OutputBatch(records))
        t4 = time.perf_counter()
        if step >= warmup and batch.is_decode:
            measured += 1
            for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[k] += dt
            sizes["batch"] += len(data)
            sizes["outputs"] += len(out)
    return {
        "concurrency": concurrency,
        "decode_steps": measured,
        **{f"{k}_ms": round(1000 * v / measured, 3) for k, v in parts.items()},
        "total_ms": round(1000 * sum(parts.values()) / measured, 3),
        **{f"{k}_bytes": v // measured for k, v in sizes.items()},
    }


COLUMNS = [
    ("mode", "mode"),
    ("flags", lambda r: " ".join(r["flags"])),
    ("conc.", "concurrency"),
    ("steps", "steps"),
    ("out tok/s", "out_tok_s"),
    ("busy ms/step", "busy_ms_per_step", 3),
    ("step interval (ms)", "step_interval_ms", 3),
    ("runner B/step", "runner_bytes_per_step"),
    ("detok B/step", "detok_bytes_per_step"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=30112)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument(
        "--overlap-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="run the server with and without --disable-overlap-schedule, alternating, ROUNDS each",
    )
    ap.add_argument("--output", default=None, help="results, JSON lines (results.py's format)")
    ap.add_argument("flags", nargs="*")
    args = ap.parse_args(argv)
    out = ResultFile(args.output, "scheduler")
    if args.offline:
        r = out.add({"mode": "offline", **offline(args.concurrency)})
        print(
            markdown(
                [r], [(k, k, 3) for k in r if k.endswith(("_ms", "_bytes", "steps", "concurrency"))]
            )
        )
        return 0
    modes = {
        "overlap": [*args.flags, "--overlap-min-share", "0"],
        "no-overlap": [*args.flags, "--disable-overlap-schedule"],
    }
    if not args.overlap_ab:
        modes = {"as given": args.flags}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    tokenizer = load_tokenizer(None)
    for r in range(max(1, args.overlap_ab)):
        for mode in modes if r % 2 == 0 else reversed(list(modes)):
            runs[mode].append(
                out.add({"mode": mode, **serve_and_measure(args, modes[mode], tokenizer)})
            )
    print(markdown([x for rs in runs.values() for x in rs], COLUMNS))
    if args.overlap_ab:
        keys = ("out_tok_s", "step_interval_ms", "busy_ms_per_step")
        medians = [
            {"mode": m, **{k: statistics.median(x[k] for x in rs) for k in keys}}
            for m, rs in runs.items()
        ]
        print("\nmedians:\n" + markdown(medians, [("mode", "mode")] + [(k, k, 3) for k in keys]))
    return 0


def serve_and_measure(args, flags: list[str], tokenizer) -> dict:
    with relay_server("scheduler", args.port, flags) as server:
        work = lambda: server_info(server.base_url)["scheduler"]["step_work"]  # noqa: E731
        before = work()
        wall = load(
            server.base_url,
            args.concurrency,
            word_rows(args.requests, args.output_len, seed=0),
            tokenizer,
        )["duration"]
        after = work()
    steps = after["steps"] - before["steps"]
    return {
        "flags": flags,
        "concurrency": args.concurrency,
        "steps": steps,
        "out_tok_s": round(args.requests * args.output_len / wall, 1),
        "busy_ms_per_step": round(
            1000 * (after["busy_seconds"] - before["busy_seconds"]) / steps, 3
        ),
        "step_interval_ms": round(1000 * wall / steps, 3),  # what overlap could hide busy_ms of
        "runner_bytes_per_step": round((after["runner_bytes"] - before["runner_bytes"]) / steps),
        "detok_bytes_per_step": round((after["detok_bytes"] - before["detok_bytes"]) / steps),
    }


if __name__ == "__main__":
    sys.exit(main())
