"""Liveness of the whole pipeline, as /health reports it.

The http process sends a heartbeat every HEARTBEAT_INTERVAL seconds down the same path a
request takes (tokenizer -> scheduler -> detokenizer -> http). One that does not come back
within the timeout means some process's loop has stopped turning, even though every
process may still be alive; the scheduler also stamps how long its current model step has
been running, so a runner stuck inside a step shows too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEARTBEAT_INTERVAL = 1.0
MAX_OUTSTANDING = 1024  # beyond this the oldest unanswered heartbeats are the evidence enough


@dataclass
class Heartbeats:
    timeout: float
    outstanding: dict[int, float] = field(default_factory=dict)  # seq -> sent at
    next_seq: int = 0
    step_age: float = 0.0
    undelivered_since: float | None = None  # heartbeats found no process to take them

    def ping(self, now: float) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if len(self.outstanding) >= MAX_OUTSTANDING:
            self.outstanding.pop(max(self.outstanding))  # keep the oldest: it dates the stall
        self.outstanding[seq] = now
        return seq

    def undelivered(self, seq: int, now: float) -> None:
        """The ping could not be handed to the pipeline (no tokenizer connected): it will
        never come back, so it is not waited for; the outage is dated instead."""
        self.outstanding.pop(seq, None)
        if self.undelivered_since is None:
            self.undelivered_since = now

    def delivered(self) -> None:
        self.undelivered_since = None

    def pong(self, seq: int, step_age: float) -> None:
        self.outstanding.pop(seq, None)
        self.step_age = step_age

    def problem(self, now: float) -> str | None:
        """Why the pipeline cannot serve now, or None if it can."""
        if self.undelivered_since is not None and now - self.undelivered_since > self.timeout:
            return f"no tokenizer process has taken a heartbeat for {now - self.undelivered_since:.1f} s"
        if self.outstanding:
            waited = now - min(self.outstanding.values())
            if waited > self.timeout:
                return f"no heartbeat back through the pipeline for {waited:.1f} s"
        if self.step_age > self.timeout:
            return f"a model step has been running for {self.step_age:.1f} s"
        return None
