"""Every live request and where it is: waiting, running, or (once removed) finished.

The one place a request changes state after it is queued: start (from the admission),
retract (back to waiting, its KV cached or freed, to be recomputed) and finish (from
anywhere, its KV and its sid given back).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from relay.outputs import FinishReason, RequestOutput
from relay.scheduling.kv_manager import KVManager
from relay.scheduling.request import Req, Status
from relay.scheduling.waiting_queue import WaitingQueue

logger = logging.getLogger(__name__)


class RequestTable:
    def __init__(self, kv: KVManager, on_finish: Callable[[Req], None] | None = None):
        self.kv = kv
        self.on_finish = on_finish  # e.g. the server's per-request log line
        self.reqs: dict[str, Req] = {}  # every request not yet finished
        self.running: list[Req] = []
        self.waiting = WaitingQueue()
        self._seq = itertools.count()
        self._free_sids: list[int] = []
        self._next_sid = 0
        self.released_sids: list[
            int
        ] = []  # finished requests' sids the runner has not been told of
        self.retractions_total = 0

    def add(self, req: Req) -> None:
        req.seq = next(self._seq)
        self.reqs[req.rid] = req
        self.waiting.push(req)

    def start(self, req: Req) -> None:
        """A request the admission took off the queue runs from this step."""
        if req.sid < 0:
            req.sid = self._free_sids.pop() if self._free_sids else self._new_sid()
        req.status = Status.RUNNING
        self.running.append(req)

    def _new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid - 1

    def take_released_sids(self) -> list[int]:
        released, self.released_sids = self.released_sids, []
        return released

    def lowest_ranked_running(self) -> Req:
        return min(self.running, key=lambda r: (r.priority, -r.seq))

    def decode_headroom(self) -> int:
        """Pages to keep free so every decoding request can grow by one page next step."""
        return sum(1 for r in self.running if not r.in_prefill)

    def retract(self, req: Req, why: str = "KV pool full") -> None:
        """Send a running request back to the queue, to be recomputed from what the cache keeps."""
        logger.info(
            "%s: retracting request %s (%d tokens) for recompute", why, req.rid, req.seq_len
        )
        self.kv.release(req)
        req.unwritten = req.pending = 0  # what steps still out produce for it is dropped
        # ... and the runner's penalty counts with it: a penalised request's spec goes again,
        # with the output it restarts from.
        req.spec_sent = not req.params.penalised
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_retractions += 1
        self.retractions_total += 1
        self.waiting.push(req)

    def finish(
        self, req: Req, reason: FinishReason, error: str | None = None, param: str | None = None
    ) -> RequestOutput:
        """End req wherever it is; its last record. An error with a param is the request's fault
        (a 400 naming that field), one without the server's (a 500)."""
        req.finish_reason, req.error = reason, error
        if req.constraint is not None:
            req.constraint.release()
            req.constraint = None
        if req.status == Status.RUNNING:
            self.kv.release(req)
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.discard(req)
        req.status = Status.FINISHED
        if req.sid >= 0:
            self.released_sids.append(req.sid)
            self._free_sids.append(req.sid)
        del self.reqs[req.rid]
        if self.on_finish is not None:
            self.on_finish(req)
        return RequestOutput(
            req.rid,
            finish_reason=reason,
            matched_stop=req.matched_stop,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            queue_time=req.queue_time,
            error=error,
            status=400 if param is not None else 500,
            param=param,
        )
