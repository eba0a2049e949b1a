"""The queue of requests not running: highest priority first, then first come."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from relay.scheduling.request import Req, Status


class WaitingQueue:
    """A heap of (-priority, seq, req). A request that finishes while it waits keeps its entry
    until it surfaces (discard() only uncounts it): removal from the middle of a heap is O(n)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Req]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, req: Req) -> None:
        heapq.heappush(self._heap, (-req.priority, req.seq, req))
        self._count += 1

    def pop(self) -> Req | None:
        req = self.peek()
        if req is not None:
            heapq.heappop(self._heap)
            self._count -= 1
        return req

    def peek(self) -> Req | None:
        heap = self._heap
        while heap and heap[0][2].status != Status.WAITING:
            heapq.heappop(heap)  # finished while it waited
        return heap[0][2] if heap else None

    def discard(self, req: Req) -> None:
        """req finished while waiting: its entry is dropped when it surfaces."""
        self._count -= 1

    def in_heap_order(self) -> Iterator[Req]:
        """Entries in heap order (the highest-ranked first; the rest only roughly ranked),
        finished ones included."""
        return (req for _, _, req in self._heap)
