"""Small pieces of a request's life across processes."""

from __future__ import annotations

import time


class Tombstones:
    """Ids of requests that ended before news of them arrived (an abort that overtook its
    request, the late tokens of a stopped one). Each is stamped with when it was laid and
    forgotten after `ttl` seconds, by which time nothing more of it can arrive."""

    def __init__(self, ttl: float, clock=time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._at: dict[str, float] = {}

    def add(self, rid: str, at: float | None = None) -> None:
        now = self.clock()
        self._at = (
            {r: t for r, t in self._at.items() if now - t < self.ttl}
            if len(self._at) > 64
            else self._at
        )
        self._at[rid] = now if at is None else at

    def discard(self, rid: str) -> None:
        self._at.pop(rid, None)

    def laid_since(self, rid: str, since: float) -> bool:
        """Whether rid has a tombstone laid at or after `since` (consumes it)."""
        at = self._at.pop(rid, None)
        return at is not None and at >= since and self.clock() - at < self.ttl

    def __contains__(self, rid: str) -> bool:
        at = self._at.get(rid)
        return at is not None and self.clock() - at < self.ttl
