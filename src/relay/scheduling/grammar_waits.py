"""Constrained requests whose grammar is compiling: they wait in the queue, not admitted,
until poll() finds the grammar ready, or end with a 400 when it fails or times out."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relay.outputs import FinishReason, RequestOutput
from relay.sampling_params import InvalidParam
from relay.scheduling.request import Req, Status
from relay.scheduling.request_table import RequestTable

if TYPE_CHECKING:
    from relay.text.grammar import GrammarBackend


class GrammarWaits:
    def __init__(
        self,
        grammars: GrammarBackend | None,
        table: RequestTable,
        compile_timeout: float,
        clock: Callable[[], float],
    ):
        self.grammars = grammars
        self.table = table
        self.compile_timeout = compile_timeout
        self.clock = clock
        self._compiling: list[Req] = []

    def start(self, req: Req) -> None:
        """Start compiling req's output grammar; InvalidParam naming the field without xgrammar."""
        kind = req.params.constraint[0]
        if self.grammars is None:
            raise InvalidParam(kind, f"{kind} needs xgrammar, which this server lacks")
        req.constraint = self.grammars.start(
            *req.params.constraint, self.clock(), self.compile_timeout, req.params.reasoning_tags
        )
        self._compiling.append(req)

    def poll(self) -> list[RequestOutput]:
        """Stop waiting for grammars that compiled; end with a 400 naming the field those whose
        grammar failed (it does not parse, or matches nothing) or has not compiled by its
        deadline, returning their records."""
        failed, still = [], []
        now = self.clock()
        for req in self._compiling:
            if req.status != Status.WAITING:
                continue  # it ended (an abort) while compiling
            error = req.constraint.failure(now)
            if error is not None:
                failed.append(
                    self.table.finish(req, FinishReason.ABORT, error, param=req.constraint.kind)
                )
            elif not req.constraint.ready():
                still.append(req)
        self._compiling = still
        return failed

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def wait(self) -> None:
        """Block until a compiling grammar is compiled or the first compile deadline passes."""
        pending = [
            r.constraint for r in self._compiling if r.constraint is not None
        ]  # None: aborted
        if pending:
            self.grammars.wait_for_any(
                pending, max(0.0, min(c.deadline for c in pending) - self.clock())
            )

    def stats(self, mask_seconds: float, step_seconds: float) -> dict[str, Any] | None:
        """Constrained decoding's counters, with the share of step time spent building masks."""
        if self.grammars is None:
            return None
        return {
            **self.grammars.stats(),
            "mask_seconds": mask_seconds,
            "step_seconds": step_seconds,
            "mask_step_share": mask_seconds / step_seconds if step_seconds else 0.0,
        }

    def check(self) -> None:
        """No grammar matcher outlives its request. Raises AssertionError otherwise."""
        if self.grammars is not None and not self.table.reqs:
            assert self.grammars.live == 0, (
                f"{self.grammars.live} grammar matchers outlive their requests"
            )
