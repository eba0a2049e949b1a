"""The scheduler's per-step limits: fixed, or steered towards a latency target.

`StepLimits` are the configured numbers (`--chunked-prefill-size`, `--max-running-requests`).
`AdaptiveLimits` starts from them and moves two knobs from what it measures, each step:

- the prompt tokens a step may compute on top of its decodes (`prefill_budget`): a step that
  carries a long prompt chunk delays every decoding request by that chunk's cost, so this is
  the first knob to turn down when the windowed p99 inter-token latency (ITL) exceeds the target;
- how many requests may run (`max_running`): turned down once the prefill budget is at its floor
  and the decodes themselves, measured, make a step too slow.

When ITL is comfortably under the target and requests wait (or TTFT is over its target), the
knobs grow back, admission first, additively. A step-time model (`StepCostModel`, a least squares
fit of step time on decode and prefill tokens) bounds growth near what it predicts keeps a step
under the target and sets how far a cut goes, so a steady load settles instead of see-sawing; a
p99 over the target that the model and the bulk of the gaps say the limits do not cause (stalls
from other processes) cuts nothing. Pure Python: the scheduler feeds it, tests drive it with a
simulated clock.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.config import EngineConfig

logger = logging.getLogger(__name__)

MIN_PREFILL_BUDGET = 8  # tokens; prompts always advance, so waiting requests are never starved
MIN_ITL_SAMPLES = 32  # gaps measured since the last change before deciding again
GROW_BELOW = 0.8  # grow only while p99 ITL is under this share of the target (hysteresis)
SHRINK_FACTOR = 0.5
PLAN_SHARE = 0.9  # the step-time model plans steps to this share of the ITL target
SLOW_STEP = 4.0  # a decode step this many times the target is logged
STALL_MARGIN = (
    1.5  # a p99 up to this multiple of the target, with limits the model says fit, is stalls
)
DECIDE_EVERY = (
    0.25  # seconds between decisions: a percentile per step would cost more than it tells
)


class StepLimits:
    """Fixed limits: the step budget and the running cap as configured."""

    def __init__(self, chunked_prefill_size: int, max_running_requests: int):
        self.budget_cap = chunked_prefill_size
        self.running_cap = max_running_requests

    @property
    def max_running(self) -> int:
        return self.running_cap

    def step_budget(self, decode_cost: int) -> int:
        """Budget units for one step (decodes are taken from it first)."""
        return self.budget_cap

    def on_admit(self, now: float, request_tokens: int) -> None:
        pass

    def on_step(
        self,
        now: float,
        duration: float,
        decode_tokens: int,
        prefill_cost: int,
        gaps: list[tuple[float, int]],
        ttfts: list[float],
        num_waiting: int,
        num_running: int,
    ) -> None:
        pass

    def to_dict(self) -> dict | None:
        return None


class StepCostModel:
    """step seconds ~= base + per_decode * decode tokens + per_prefill * prefill cost units,
    fitted by least squares with exponential forgetting (recent steps weigh most)."""

    FORGET = 0.995
    MIN_STEPS = 16

    def __init__(self) -> None:
        self.xtx = [[0.0] * 3 for _ in range(3)]
        self.xty = [0.0] * 3
        self.steps = 0
        self.coef: tuple[float, float, float] | None = None

    def observe(self, decode_tokens: int, prefill_cost: int, seconds: float) -> None:
        x = (1.0, float(decode_tokens), float(prefill_cost))
        for i in range(3):
            self.xty[i] = self.FORGET * self.xty[i] + x[i] * seconds
            for j in range(3):
                self.xtx[i][j] = self.FORGET * self.xtx[i][j] + x[i] * x[j]
        self.steps += 1
        if self.steps >= self.MIN_STEPS:
            self.coef = self._solve() or self.coef

    def _solve(self) -> tuple[float, float, float] | None:
        """The normal equations, with a tiny ridge so a load that never varies one feature
        (e.g. no prompts yet) gives that feature ~0 instead of a singular system."""
        a = [
            [
                self.xtx[i][j] + (1e-9 * max(1.0, self.xtx[i][i]) if i == j else 0.0)
                for j in range(3)
            ]
            for i in range(3)
        ]
        det = _det3(a)
        if abs(det) < 1e-30:
            return None
        coef = []
        for k in range(3):
            m = [[self.xty[i] if j == k else a[i][j] for j in range(3)] for i in range(3)]
            coef.append(_det3(m) / det)
        base, per_decode, per_prefill = coef
        if per_prefill <= 0:
            return None  # not identified yet (no prompts seen, or noise)
        return max(0.0, base), max(0.0, per_decode), per_prefill

    def predict(self, decode_tokens: int, prefill_cost: int) -> float | None:
        if self.coef is None:
            return None
        base, per_decode, per_prefill = self.coef
        return base + per_decode * decode_tokens + per_prefill * prefill_cost

    def prefill_for(self, step_seconds: float, decode_tokens: int) -> int | None:
        """The most prefill cost units a step with these decodes can carry within step_seconds."""
        if self.coef is None:
            return None
        base, per_decode, per_prefill = self.coef
        return max(0, int((step_seconds - base - per_decode * decode_tokens) / per_prefill))

    def to_dict(self) -> dict | None:
        if self.coef is None:
            return None
        base, per_decode, per_prefill = self.coef
        return {
            "base_ms": base * 1e3,
            "per_decode_token_ms": per_decode * 1e3,
            "per_prefill_token_ms": per_prefill * 1e3,
            "steps": self.steps,
        }


def _det3(m: list[list[float]]) -> float:
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )


class LatencyWindow:
    """Weighted samples of the last `seconds`; percentiles over them."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.samples: deque[tuple[float, float, int]] = deque()  # (time, value, weight)
        self.weight = 0
        self.total = 0.0  # sum of value x weight

    def add(self, now: float, value: float, weight: int = 1) -> None:
        self.samples.append((now, value, weight))
        self.weight += weight
        self.total += value * weight

    def expire(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.seconds:
            _, value, weight = self.samples.popleft()
            self.weight -= weight
            self.total -= value * weight

    def clear(self) -> None:
        self.samples.clear()
        self.weight = 0
        self.total = 0.0

    def mean(self) -> float | None:
        return self.total / self.weight if self.weight else None

    def percentile(self, p: float) -> float | None:
        if not self.samples:
            return None
        ordered = sorted((v, w) for _, v, w in self.samples)
        cumulative, totals = 0, []
        for _, w in ordered:
            cumulative += w
            totals.append(cumulative)
        rank = math.ceil(p / 100 * cumulative)
        return ordered[min(len(ordered) - 1, bisect.bisect_left(totals, rank))][0]


@dataclass
class Decision:
    prefill_budget: int
    max_running: int
    reason: str


class AdaptiveLimits(StepLimits):
    """Limits steered so the windowed p99 ITL stays under target_itl (seconds)."""

    def __init__(
        self,
        chunked_prefill_size: int,
        max_running_requests: int,
        kv_total_tokens: int,
        target_itl: float,
        target_ttft: float | None = None,
        window: float = 5.0,
    ):
        super().__init__(chunked_prefill_size, max_running_requests)
        self.target_itl, self.target_ttft, self.window = target_itl, target_ttft, window
        self.kv_total_tokens = kv_total_tokens
        self.prefill_budget = chunked_prefill_size
        self._max_running = max_running_requests
        self.itl = LatencyWindow(window)
        self.ttft = LatencyWindow(window)
        self.request_tokens = LatencyWindow(window)  # what admitted requests may grow to
        self.model = StepCostModel()
        self.decodes = LatencyWindow(window)  # decode tokens per step
        self.decode_time = LatencyWindow(window)  # seconds of each step that its decodes took
        self.changes = 0
        self.last_reason = ""
        self.decided_at = float("-inf")
        self.slow_noted_at = float("-inf")

    # ---- what the scheduler asks ----------------------------------------------------
    @property
    def max_running(self) -> int:
        return min(self._max_running, self.kv_fit())

    def kv_fit(self) -> int:
        """How many requests of the current mix of lengths the KV pool holds at once."""
        mean = self.request_tokens.mean()
        if mean is None:
            return self.running_cap
        return max(1, min(self.running_cap, int(self.kv_total_tokens // max(1.0, mean))))

    def step_budget(self, decode_cost: int) -> int:
        # With nobody decoding there is no inter-token gap to protect: prompts get the whole budget.
        return decode_cost + self.prefill_budget if decode_cost else self.budget_cap

    # ---- what it is fed -------------------------------------------------------------
    def on_admit(self, now: float, request_tokens: int) -> None:
        self.request_tokens.add(now, float(request_tokens))

    def on_step(
        self,
        now: float,
        duration: float,
        decode_tokens: int,
        prefill_cost: int,
        gaps: list[tuple[float, int]],
        ttfts: list[float],
        num_waiting: int,
        num_running: int,
    ) -> None:
        # Only steps that delay a decoding request are modelled: prompt-only steps sit at
        # another point of a CPU's roofline (compute-bound, not weight-read-bound).
        if decode_tokens:
            self._note_if_slow(now, duration, decode_tokens, prefill_cost)
            self.model.observe(decode_tokens, prefill_cost, duration)
            # What the step's decodes took, measured, minus its prompt tokens' modelled share
            # (all of it while the model is unfitted): a linear model's intercept misjudges
            # small steps on a CPU's roofline, so the decodes are judged on this instead.
            prefill_share = self.model.coef[2] * prefill_cost if self.model.coef else 0.0
            self.decode_time.add(now, duration - prefill_share)
        self.decodes.add(now, float(decode_tokens))
        for gap, weight in gaps:
            self.itl.add(now, gap, weight)
        for t in ttfts:
            self.ttft.add(now, t)
        if now - self.decided_at < DECIDE_EVERY:
            return
        self.decided_at = now
        for w in (self.itl, self.ttft, self.request_tokens, self.decodes, self.decode_time):
            w.expire(now)
        decision = self.decide(num_waiting, num_running)
        if decision is not None:
            self._apply(decision)

    def _note_if_slow(
        self, now: float, duration: float, decode_tokens: int, prefill_cost: int
    ) -> None:
        """Log a step far slower than the target (at most one a second): the limits cannot
        cure it, so an operator should see what it was."""
        if duration < SLOW_STEP * self.target_itl or now - self.slow_noted_at < 1.0:
            return
        self.slow_noted_at = now
        predicted = self.model.predict(decode_tokens, prefill_cost)
        logger.info(
            "adaptive batching: a step of %d decode tokens and %d prefill units took %.0f ms "
            "(step model: %s; target %.0f ms)",
            decode_tokens,
            prefill_cost,
            duration * 1e3,
            "unfitted" if predicted is None else f"{predicted * 1e3:.0f} ms",
            self.target_itl * 1e3,
        )

    # ---- the policy -----------------------------------------------------------------
    def decide(self, num_waiting: int, num_running: int) -> Decision | None:
        if self.itl.weight < MIN_ITL_SAMPLES:
            return None
        p99 = self.itl.percentile(99)
        if p99 > self.target_itl:
            return self._shrink(p99, num_running)
        ttft = self.ttft.percentile(99)
        starved = self.target_ttft is not None and ttft is not None and ttft > self.target_ttft
        if p99 < GROW_BELOW * self.target_itl and (num_waiting > 0 or starved):
            return self._grow(p99, num_waiting, starved)
        return None

    def _shrink(self, p99: float, num_running: int) -> Decision | None:
        why = f"p99 ITL {p99 * 1e3:.1f} ms > target {self.target_itl * 1e3:.1f} ms"
        planned = self._planned_budget()
        bulk = self.itl.percentile(95)
        if (
            planned is not None
            and planned >= self.prefill_budget
            and p99 < STALL_MARGIN * self.target_itl
            and bulk <= self.target_itl
        ):
            # The model, fitted on these very steps, says they fit, and all but the slowest few
            # gaps agree: those are stalls from outside the limits (another process on the
            # cores), which no cut would cure.
            return None
        if self.prefill_budget > MIN_PREFILL_BUDGET:
            half = int(self.prefill_budget * SHRINK_FACTOR)
            if planned is None:
                cut = half
            elif p99 > 2 * self.target_itl:  # far off: straight to what the model says fits
                cut = min(half, planned)
            else:  # near: one step back towards the model's plan (growth may have explored past it)
                cut = max(half, min(planned, self.prefill_budget - MIN_PREFILL_BUDGET))
            return Decision(
                max(MIN_PREFILL_BUDGET, cut), self._max_running, why + ": less prefill per step"
            )
        current = min(self._max_running, max(1, num_running))
        decoding = self.decode_time.percentile(50)
        if decoding is None or decoding <= PLAN_SHARE * self.target_itl:
            return None  # the decodes alone fit: the prefill floor or stalls are what remain
        # Too many decodes: fewer in proportion (at most half at once; the base cost of a
        # step does not shrink with them, so this cuts less than needed, never more).
        fewer = max(current // 2, int(current * PLAN_SHARE * self.target_itl / decoding))
        if fewer < 1 or fewer >= current:
            return None
        return Decision(self.prefill_budget, fewer, why + ": fewer running requests")

    def _grow(self, p99: float, num_waiting: int, starved: bool) -> Decision | None:
        why = f"p99 ITL {p99 * 1e3:.1f} ms < {GROW_BELOW:.0%} of target" + (
            ", TTFT over target" if starved else f", {num_waiting} waiting"
        )
        if num_waiting > 0 and self._max_running < self.running_cap:
            step = max(1, self.running_cap // 16)
            return Decision(
                self.prefill_budget,
                min(self.running_cap, self._max_running + step),
                why + ": more running requests",
            )
        grown = min(
            self.budget_cap, self.prefill_budget + max(MIN_PREFILL_BUDGET, self.budget_cap // 16)
        )
        planned = self._planned_budget()
        if planned is not None:  # no further than the model's plan, or one step past it to explore
            grown = min(grown, max(planned, self.prefill_budget + MIN_PREFILL_BUDGET))
        if grown > self.prefill_budget:
            return Decision(grown, self._max_running, why + ": more prefill per step")
        return None

    def _planned_budget(self) -> int | None:
        """The prefill the step-time model says fits a step under the target, with the
        window's usual decode count."""
        if not self.decodes.samples:
            return None
        decodes = max(v for _, v, _ in self.decodes.samples)
        return self.model.prefill_for(PLAN_SHARE * self.target_itl, int(decodes))

    def _apply(self, d: Decision) -> None:
        if (d.prefill_budget, d.max_running) == (self.prefill_budget, self._max_running):
            return
        logger.info(
            "adaptive batching: prefill budget %d -> %d, max running %d -> %d (%s)",
            self.prefill_budget,
            d.prefill_budget,
            self._max_running,
            d.max_running,
            d.reason,
        )
        self.prefill_budget, self._max_running = d.prefill_budget, d.max_running
        self.changes += 1
        self.last_reason = d.reason
        self.itl.clear()  # judge the new limits on their own gaps

    def to_dict(self) -> dict:
        p99 = self.itl.percentile(99)
        ttft = self.ttft.percentile(99)
        return {
            "target_itl_ms": self.target_itl * 1e3,
            "target_ttft_ms": None if self.target_ttft is None else self.target_ttft * 1e3,
            "prefill_budget": self.prefill_budget,
            "max_running": self.max_running,
            "max_running_by_kv": self.kv_fit(),
            "p99_itl_ms": None if p99 is None else p99 * 1e3,
            "p99_ttft_ms": None if ttft is None else ttft * 1e3,
            "step_model": self.model.to_dict(),
            "changes": self.changes,
            "last_reason": self.last_reason,
        }


def make_limits(cfg: EngineConfig, kv_total_tokens: int) -> StepLimits:
    """Fixed limits, or adaptive ones when a latency target is set."""
    if cfg.target_itl_ms is None:
        return StepLimits(cfg.chunked_prefill_size, cfg.max_running_requests)
    ttft = None if cfg.target_ttft_ms is None else cfg.target_ttft_ms / 1e3
    return AdaptiveLimits(
        cfg.chunked_prefill_size,
        cfg.max_running_requests,
        kv_total_tokens,
        cfg.target_itl_ms / 1e3,
        ttft,
        cfg.adaptive_window_s,
    )
