"""A request's embedding over its prefill steps (relay.scheduling.pooling says how a server
pools): which positions a step's chunk pools, the sums the runner returns added up, the
vector at the end, and how far the prefix cache may serve the prompt meanwhile."""

from __future__ import annotations

import logging

import numpy as np

from relay.scheduling.request import Req
from relay.step import EmbedChunk, EmbedSpan

logger = logging.getLogger(__name__)


def cache_limit(req: Req, limit: int) -> int:
    """How many leading tokens the prefix cache may serve, at most limit."""
    st = req.pooled
    return limit if st is None or st.next >= st.hi else min(limit, st.next)


def span(req: Req, row: int, n: int) -> EmbedSpan | None:
    """The positions the request's next n tokens (from kv_len on) pool, or None."""
    st = req.pooled
    if st is None:
        return None
    lo, hi = max(req.kv_len, st.next), min(req.kv_len + n, st.hi)
    return EmbedSpan(row, lo - req.kv_len, hi - lo) if lo < hi else None


def collect(req: Req, span: EmbedSpan, chunk: EmbedChunk, prefix: int) -> None:
    """Add a step's sum (of the row whose new tokens began at prefix) to the request's total.
    A sum that does not start where the total ends is dropped: the embedding then stays short
    and the request fails (finish), rather than answer a wrong vector."""
    st = req.pooled
    if prefix + span.first != st.next:
        logger.error(
            "request %s: hidden states pooled from position %d, expected %d; dropped",
            req.rid,
            prefix + span.first,
            st.next,
        )
        return
    part = np.frombuffer(chunk.hidden_sum, dtype="<f4").astype(np.float64)
    st.total = part if st.total is None else st.total + part
    st.next += span.count


def finish(req: Req) -> bytes | None:
    """The request's embedding, float32 little-endian bytes; None if some position is missing."""
    st = req.pooled
    if st.next < st.hi or st.total is None:
        return None
    vector = st.total / (st.hi - st.lo)
    if st.pooling.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize eps
    return vector.astype("<f4").tobytes()
