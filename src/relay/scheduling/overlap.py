"""When to build the next step while one runs (overlap scheduling).

Building step N+1 before step N's output is back hides the scheduler's own work (building,
encoding, applying outputs: ~1-2 ms) behind the runner's step. It also costs: a request that
arrives while step N runs misses step N+1, built already, and waits one more step for its first
token. Where a step is a few milliseconds (a GPU) the hidden work is a large share of it and the
extra wait is short; where a step is 20-300 ms (a CPU) the work is 1-5 % of it and the wait is a
whole long step (TTFT p50 +20-30 % measured, throughput unchanged: docs/benchmarks.md). So the
loop overlaps only while the scheduler's work is at least `min_share` of a step, from moving
averages of both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OverlapPolicy:
    enabled: bool = True
    min_share: float = 0.1  # 0: always overlap
    smoothing: float = 0.2  # weight of the newest step in the moving averages
    busy_s: float | None = None  # the scheduler's own work per step
    step_s: float | None = None  # a step on the runner

    def record(self, busy_s: float, step_s: float) -> None:
        """One processed step: the scheduler's work for it and how long the runner took."""
        a = self.smoothing
        self.busy_s = busy_s if self.busy_s is None else (1 - a) * self.busy_s + a * busy_s
        self.step_s = step_s if self.step_s is None else (1 - a) * self.step_s + a * step_s

    @property
    def depth(self) -> int:
        """Steps to keep out at once: 2 overlaps, 1 is lockstep."""
        if not self.enabled:
            return 1
        if self.min_share <= 0:
            return 2
        if self.busy_s is None or self.step_s is None:
            return 1  # nothing measured yet
        return 2 if self.busy_s >= self.min_share * self.step_s else 1

    def to_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "min_share": self.min_share,
            "depth": self.depth,
            "busy_ms": None if self.busy_s is None else round(1e3 * self.busy_s, 3),
            "step_ms": None if self.step_s is None else round(1e3 * self.step_s, 3),
        }
