"""The step loop the scheduler process and the offline Engine both run: build a step, hand it
to the runner, apply its output once it is back, with up to OverlapPolicy.depth steps out.

With two out, step N+1 is built before step N's output is applied, so the runner goes from one
step straight to the next and the scheduler's own work hides behind it (relay.scheduling.overlap
decides when that pays). Where the steps go and how their outputs come back is the caller's:
the process sends them to the runner ranks over ZeroMQ, the Engine runs its ModelRunner in its
own thread (InProcessRunner); the records it makes go to `publish`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from relay.outputs import RequestOutput
from relay.scheduling.overlap import OverlapPolicy
from relay.scheduling.scheduler import Scheduler
from relay.scheduling.scheduler_stats import step_log_line
from relay.step import BatchInput, BatchOutput

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    def submit(self, batch: BatchInput) -> None:
        """Start (or queue) a step."""

    def collect(self) -> BatchOutput:
        """The oldest submitted step's output, waiting for it if need be."""


class InProcessRunner:
    """A runner in the caller's thread (anything with forward(BatchInput) -> BatchOutput). A step
    runs when its output is collected, so with overlap the step after it is built first, as the
    server builds it while its runner works; the runner sees the steps in the same order."""

    def __init__(self, runner):
        self.runner = runner
        self._queued: deque[BatchInput] = deque()

    def submit(self, batch: BatchInput) -> None:
        self._queued.append(batch)

    def collect(self) -> BatchOutput:
        return self.runner.forward(self._queued.popleft())


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        policy: OverlapPolicy,
        publish: Callable[[list[RequestOutput]], None],
    ):
        self.sched = scheduler
        self.runner = runner
        self.policy = policy
        self.publish = publish
        self.inflight: deque[BatchInput] = deque()  # submitted, output not applied yet
        self.outputs: list[RequestOutput] = []  # records not published yet (callers add theirs)
        # The scheduler's own work per step (building, submitting, applying, publishing; not
        # waiting for the runner), for the overlap policy and /get_server_info.
        self.work = {"steps": 0, "busy_seconds": 0.0}
        self._busy_mark = 0.0  # busy_seconds when the last step was applied

    @property
    def busy(self) -> bool:
        """Requests wait or run, or a step is out."""
        return self.sched.has_work or bool(self.inflight)

    def step(self) -> bool:
        """One turn: submit the next step while fewer than the policy's depth are out, else apply
        the oldest one's output and publish the records; False when there was nothing to do."""
        self.outputs.extend(self.sched.poll_constraints())
        if len(self.inflight) < self.policy.depth and self.sched.has_work and self._submit_next():
            return True  # with a step out, build the next one while it runs
        if self.inflight:
            self._apply_oldest()
            return True
        return False

    def flush(self) -> None:
        """Publish the records made so far."""
        if self.outputs:
            records, self.outputs = self.outputs, []
            self.publish(records)

    def _submit_next(self) -> bool:
        start = time.perf_counter()
        batch = self.sched.schedule()
        if batch is None:
            return False
        self.runner.submit(batch)
        self.inflight.append(batch)
        self.work["steps"] += 1
        self.work["busy_seconds"] += time.perf_counter() - start
        return True

    def _apply_oldest(self) -> None:
        out = self.runner.collect()  # one output per step, in order
        start = time.perf_counter()
        done = self.inflight.popleft()
        self.outputs.extend(self.sched.process_output(done, out))
        if self.sched.cfg.log_steps:
            logger.info(
                step_log_line(done, self.sched.outputs.last_step_seconds, self.sched.stats())
            )
        self.flush()
        self.work["busy_seconds"] += time.perf_counter() - start
        self.policy.record(
            self.work["busy_seconds"] - self._busy_mark, self.sched.outputs.last_step_seconds
        )
        self._busy_mark = self.work["busy_seconds"]
