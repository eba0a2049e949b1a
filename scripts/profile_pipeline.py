"""Where the serving pipeline's time goes: CPU use and py-spy hot spots of every relay:: process under load.

Start a server first (the null model isolates the pipeline; the real one works too), then:

    python -m launch.serve --load-format dummy-null --port 30000 &
    python scripts/profile_pipeline.py --base-url http://127.0.0.1:30000 --seconds 8

It drives `python -m scripts.bench serving` (64 concurrent streams of 512 tokens, repeated until the
profile is done), samples each process with `py-spy record --format raw`, and prints, per process,
its CPU use (from /proc, all threads) and the functions where its samples land (self time).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICKS = os.sysconf("SC_CLK_TCK")


def relay_processes() -> dict[str, int]:
    """Process title -> pid for every running relay:: process."""
    out = subprocess.run(["pgrep", "-af", "^relay::"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid, title = line.split(maxsplit=1)
        found[title.strip()] = int(pid)
    return found


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime of all threads


def self_time(raw_path: str, top: int) -> tuple[int, list[tuple[str, int]]]:
    """Total samples and the leaf frames with the most samples, from py-spy's raw (collapsed) output."""
    leaves: collections.Counter[str] = collections.Counter()
    for line in open(raw_path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        leaves[re.sub(r":\d+\)$", ")", leaf)] += int(count)
    return sum(leaves.values()), leaves.most_common(top)


def start_load(args) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "scripts.bench",
        "serving",
        "--base-url",
        args.base_url,
        "--backend",
        args.backend,
        "--dataset-name",
        "random",
        "--num-prompts",
        str(args.num_prompts),
        "--random-input-len",
        "128",
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "1",
        "--ignore-eos",
        "--max-concurrency",
        str(args.concurrency),
        "--disable-tqdm",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument(
        "--backend",
        default="relay-openai",
        help="the serving subcommand's backend (relay-openai or relay-native)",
    )
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=2048, help="enough to outlast the profile")
    p.add_argument("--top", type=int, default=6)
    args = p.parse_args()

    procs = relay_processes()
    if not procs:
        print("no relay:: process is running; start a server first", file=sys.stderr)
        return 1
    load = start_load(args)
    try:
        time.sleep(
            3.0
        )  # let the load ramp up before sampling; this is a measurement window, not a sync
        tmp = tempfile.mkdtemp(prefix="relay-profile-")
        cpu0 = {t: cpu_seconds(pid) for t, pid in procs.items()}
        t0 = time.monotonic()
        spies = {
            t: subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(int(args.seconds)),
                    "--rate",
                    str(args.rate),
                    "--format",
                    "raw",
                    "--nonblocking",
                    "--output",
                    os.path.join(tmp, f"{t.replace('::', '-')}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for t, pid in procs.items()
        }
        for spy in spies.values():
            spy.wait()
        elapsed = time.monotonic() - t0
        cpu = {t: (cpu_seconds(pid) - cpu0[t]) / elapsed for t, pid in procs.items()}
    finally:
        load.terminate()
        load.wait()

    print(
        f"\n{len(procs)} processes, {elapsed:.1f} s under load ({args.concurrency} streams of "
        f"{args.output_len} tokens, {args.backend}); CPU = cores used, all threads\n"
    )
    print("| process | CPU | where its Python samples land (self time, share of its samples) |")
    print("|---|---|---|")
    for title in sorted(procs, key=lambda t: -cpu[t]):
        raw = os.path.join(tmp, f"{title.replace('::', '-')}.txt")
        total, top = self_time(raw, args.top) if os.path.exists(raw) else (0, [])
        spots = "; ".join(f"{name} {n / total:.0%}" for name, n in top) if total else "no samples"
        print(f"| {title} | {cpu[title]:.2f} | {spots} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
