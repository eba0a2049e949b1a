"""Compute threads that back off while other processes load the cores (CPU model runner).

A CPU step runs on OpenMP threads (torch's, which Relay's C kernels share) that meet at a barrier
after every parallel loop, hundreds of times a step. Where other processes keep the cores busy,
the kernel's scheduler hands each thread its core in turns; at every barrier the threads on a
core spin for the one that is off its core, holding the core it needs. On the 2-core box beside
two busy loops, a server decoded 4.4 tokens/s on two threads, and a 4-token completion took up
to 5 s; on one thread, 38 tokens/s (`python -m scripts.bench busy-host`). Shortening libgomp's spin for
everyone (GOMP_SPINCOUNT) cost the quiet machine half its speed, so the count of threads moves
instead, and only while the threads are starved:

- The step thread (the OpenMP master) reads how long it has waited on a run queue
  (/proc/thread-self/schedstat, its second field). Over a window of WINDOW_S seconds of steps, a
  wait above STARVED_SHARE of that time means the cores are oversubscribed (two threads beside
  two busy loops: 48-60%; none of the windows of a quiet server at 1, 8 or 32 requests at once
  went over), and the thread count halves (2 -> 1 on two cores).
- A lowered count is tried higher again after a hold: HOLD_S, doubled after every try that was
  starved again (up to MAX_HOLD_S: a try under a load that stays costs one window of slow steps
  a minute), HOLD_S again after one that was not. A try comes after HOLD_S whatever the hold
  where the cores had room for more threads while the steps ran (idle cores in /proc/stat, over
  the cores this process may use, while the step thread was busy at least half the time).

ThreadPolicy makes the decisions from readings alone (unit-testable); ThreadBackoff takes the
readings in the runner process and applies the count (torch.set_num_threads, which sets the
OpenMP threads of the calling thread, the one every step runs on). A fixed --num-threads, or
--disable-thread-backoff, leaves the count alone, and so does a rank of one thread (--dp replicas
and --tp ranks on a core each; multi-node ranks get a fixed count from their node's cores).
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

WINDOW_S = 0.25  # seconds of steps each verdict on a thread count looks at
# A run-queue wait above this share of the steps' time: starved. A model of it: the team moves
# only while every thread is on a core, so n threads each waiting w of the time move at about
# n (1 - n w), and two lose to one past w = 1/3.
STARVED_SHARE = 0.3
ROOM_CORES = 0.75  # idle cores beside busy steps that make room for more threads
HOLD_S = 2.0
MAX_HOLD_S = 64.0


class ThreadPolicy:
    """The thread count from readings: verdict() over each window of steps says how many threads
    the next steps should run on."""

    def __init__(
        self,
        max_threads: int,
        window_s: float = WINDOW_S,
        starved_share: float = STARVED_SHARE,
        room_cores: float = ROOM_CORES,
        hold_s: float = HOLD_S,
        max_hold_s: float = MAX_HOLD_S,
    ):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self.window_s, self.starved_share, self.room_cores = window_s, starved_share, room_cores
        self.base_hold, self.max_hold = hold_s, max_hold_s
        self.hold = hold_s  # how long a lowered count stays before it is tried higher
        self.lowered_at = 0.0
        self.trying = False  # the count was just raised: its first verdict decides the next hold
        self.drops = self.raises = 0
        self.last_share: float | None = None  # the run-queue wait share of the last verdict

    def verdict(
        self,
        now: float,
        busy_s: float,
        waited_s: float,
        wall_s: float,
        idle_cores: float | None = None,
    ) -> int:
        """One window: busy_s seconds of steps (at least window_s) within the last wall_s
        seconds, the step thread's run-queue wait, and the idle cores over those wall_s seconds
        (None: not known). Returns the count for the next steps."""
        share = self.last_share = waited_s / busy_s if busy_s > 0 else 0.0
        starved = share > self.starved_share
        if self.trying:
            self.trying = False
            self.hold = min(self.max_hold, 2 * self.hold) if starved else self.base_hold
        if starved and self.threads > 1:
            self.threads = max(1, self.threads // 2)
            self.lowered_at = now
            self.drops += 1
        elif self.threads < self.max_threads:
            room = (
                idle_cores is not None and busy_s >= 0.5 * wall_s and idle_cores >= self.room_cores
            )
            if now >= self.lowered_at + (self.base_hold if room else self.hold):
                self.threads = min(self.max_threads, 2 * self.threads)
                self.trying = True
                self.raises += 1
        return self.threads


class ThreadBackoff:
    """Takes ThreadPolicy's readings in the runner process and applies its count. after_step()
    must be called on the thread that runs the steps (its run-queue wait is the one read); it
    costs an addition a step, and two small /proc reads a window."""

    def __init__(self, max_threads: int, policy: ThreadPolicy | None = None):
        self.policy = policy or ThreadPolicy(max_threads)
        self.threads = self.policy.threads
        self._cores = sorted(os.sched_getaffinity(0))
        self._tid: int | None = None  # the step thread whose schedstat _fd reads
        self._fd: int | None = None
        self._busy = 0.0
        self._waited_ns = 0
        self._since = 0.0  # when the window began (monotonic)
        self._idle: tuple[int, int] = (0, 0)  # (idle, all) jiffies of our cores when it began

    def after_step(self, step_s: float) -> None:
        tid = threading.get_native_id()
        if tid != self._tid:  # the first step, or steps now run on another thread: a new baseline
            self._start(tid)
            return
        self._busy += step_s
        if self._busy < self.policy.window_s:
            return
        now, waited_ns, idle = (
            time.monotonic(),
            self._read_waited_ns(),
            read_idle_jiffies(self._cores),
        )
        idle_cores = None
        if idle[1] > self._idle[1]:
            idle_cores = len(self._cores) * (idle[0] - self._idle[0]) / (idle[1] - self._idle[1])
        threads = self.policy.verdict(
            now, self._busy, (waited_ns - self._waited_ns) / 1e9, now - self._since, idle_cores
        )
        logger.debug(
            "threads %d: waited %.0f%% of %.2f s of steps; idle cores %s",
            self.threads,
            100 * self.policy.last_share,
            self._busy,
            "-" if idle_cores is None else f"{idle_cores:.2f}",
        )
        self._busy, self._waited_ns, self._since, self._idle = 0.0, waited_ns, now, idle
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            logger.info(
                "%s: %d compute thread%s",
                "cores busy with other work" if threads < self.threads else "trying more threads",
                threads,
                "s" if threads > 1 else "",
            )
            self.threads = threads

    def _start(self, tid: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._tid, self._fd = tid, os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        self._busy, self._waited_ns = 0.0, self._read_waited_ns()
        self._since, self._idle = time.monotonic(), read_idle_jiffies(self._cores)

    def _read_waited_ns(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1])


def backoff_supported() -> bool:
    """Linux with per-thread scheduler statistics (CONFIG_SCHED_INFO) and /proc/stat."""
    return os.path.exists("/proc/thread-self/schedstat") and os.path.exists("/proc/stat")


def read_idle_jiffies(cores: list[int], path: str = "/proc/stat") -> tuple[int, int]:
    """(idle + iowait, all) jiffies of these cores so far, from /proc/stat's cpuN lines."""
    want = {f"cpu{c}" for c in cores}
    idle = total = 0
    with open(path) as f:
        for line in f:
            name, *fields = line.split()
            if name in want:
                values = [int(v) for v in fields[:8]]  # guest time is counted in user already
                idle += values[3] + values[4]
                total += sum(values)
    return idle, total
