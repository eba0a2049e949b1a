"""Relay's C attention kernels over the paged KV cache (csrc/decode_attention.c,
csrc/extend_attention.c): a step's decode attention, with requests that share their first pages
attending that prefix once for all of them (cascade), and its prompt chunks' attention. A plan
holds what every layer's call of one step shares; a layer's own call says its sliding window (a
query at position p attends keys p - window < j <= p; the kernels never read the pages wholly
before it), its scores' soft-cap (score -> cap * tanh(score / cap) after the scale: Gemma 2) and
its attention sinks (gpt-oss: a learned logit per query head in each row's softmax denominator,
attending no value).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from relay.execution.kernels import cpu
from relay.memory.kv_allocator import FREED_PAGE

# Tokens per decode-attention work item: long requests split so every thread gets work; short
# ones stay whole (a split costs a merge).
DECODE_CHUNK = 512
MAX_GROUP = 16  # query heads per kv head the kernel takes (csrc/decode_attention.c)


def tiled_attention_available(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels that take many query rows per tile of keys run with these query and
    cache dtypes here: extend_attention (prompt chunks) and decode_attention's cascade (a group's
    shared prefix attended once for all of it). float32, or bfloat16 widened, at every level (head_dim
    a multiple of 16 with AVX-512, of 8 below); bfloat16 queries over a bfloat16 cache on VDPBF16PS
    with AVX512-BF16 (head_dim a multiple of 32)."""
    lib = cpu.load()
    return lib is not None and bool(
        lib.relay_tiled_attention_available(
            int(q_dtype == torch.bfloat16), int(kv_dtype == torch.bfloat16), head_dim
        )
    )


# Requests that share at least this many leading tokens' pages attend them together (cascade).
MIN_SHARED_TOKENS = 64


def padded_tables(page_tables: list[list[int]]) -> np.ndarray:
    """The requests' page tables as one int32 [requests, longest] array, zero-padded (the kernels
    read a table only up to its request's length)."""
    tables = np.zeros((len(page_tables), max(len(t) for t in page_tables)), dtype=np.int32)
    for i, t in enumerate(page_tables):
        tables[i, : len(t)] = t
    return tables


class DecodePlan:
    """What every layer's decode attention call of one step shares (built once per step).

    share: find requests whose first pages are the same (a cached shared prefix), for the
    kernel to attend those keys once for all of them (where tiled_attention_available)."""

    def __init__(
        self,
        page_tables: list[list[int]],
        lens: list[int],
        page_size: int = 16,
        share: bool = False,
    ):
        tables = padded_tables(page_tables)
        self.tables = torch.from_numpy(tables)
        self.lens = torch.tensor(lens, dtype=torch.int64)
        # Requests that share their first page (a prefix) side by side: one thread then finds
        # that prefix's KV in its cache for the next one, and a group is a run of this order.
        order = np.argsort(tables[:, 0], kind="stable")
        self.order = torch.from_numpy(order.astype(np.int64))
        groups = _shared_groups(tables[order], np.asarray(lens)[order], page_size) if share else []
        self.num_groups = len(groups)
        self.groups = (
            torch.tensor(groups, dtype=torch.int64).T.contiguous()
            if groups
            else torch.zeros(3, 1, dtype=torch.int64)
        )


def _shared_groups(
    tables: np.ndarray, lens: np.ndarray, page_size: int
) -> list[tuple[int, int, int]]:
    """(first rank, size, shared tokens) of each run of requests (in this order) that share at
    least MIN_SHARED_TOKENS leading tokens' pages; each keeps at least its newest token its own.
    Leading FREED_PAGE entries (pages a sliding window left behind) are no shared prefix."""
    groups = []
    start = 0
    for end in range(1, len(tables) + 1):
        if end < len(tables) and tables[end, 0] == tables[start, 0]:
            continue
        if end - start >= 2 and tables[start, 0] != FREED_PAGE:
            run = tables[start:end]
            differs = (run != run[0]).any(axis=0)
            common = int(np.argmax(differs)) if differs.any() else run.shape[1]
            keys = min(
                common * page_size, (int(lens[start:end].min()) - 1) // page_size * page_size
            )
            if keys >= MIN_SHARED_TOKENS:
                groups.append((start, end - start, keys))
        start = end
    return groups


def decode_attention(
    lib: ctypes.CDLL,
    plan: DecodePlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_size: int,
    scale: float,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] (rows may be strided: a view into qkv), float32 or bfloat16; k/v caches
    [HKV, S, D] float32 or bfloat16. new_k/new_v [B, HKV, D] (views into qkv, in q's dtype): the new
    token's keys and values, written into the cache at each request's last position first.
    window: the layer's sliding window (None: the whole context); softcap: its scores' cap (None:
    none); sinks: its float32 [H] sink logits (None: none). Returns [B, H, D] in q's dtype."""
    b, h, d = q.shape
    hkv, s, _ = k.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype)
    write = new_k is not None
    if write:
        new_k, new_v = (
            t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (new_k, new_v)
        )
    lib.decode_attention(
        q.data_ptr(),
        q.stride(0),
        new_k.data_ptr() if write else 0,
        new_k.stride(0) if write else 0,
        new_v.data_ptr() if write else 0,
        new_v.stride(0) if write else 0,
        k.data_ptr(),
        v.data_ptr(),
        plan.tables.data_ptr(),
        plan.lens.data_ptr(),
        plan.order.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        s,
        plan.tables.shape[1],
        page_size,
        DECODE_CHUNK,
        scale,
        int(q.dtype == torch.bfloat16),
        int(k.dtype == torch.bfloat16),
        window or 0,
        softcap or 0.0,
        plan.num_groups
        if plan.num_groups and tiled_attention_available(q.dtype, k.dtype, d)
        else 0,
        plan.groups[0].data_ptr(),
        plan.groups[1].data_ptr(),
        plan.groups[2].data_ptr(),
        _sinks_pointer(sinks, h),
    )
    return out


def _sinks_pointer(sinks: torch.Tensor | None, heads: int) -> int:
    """The kernels' sinks argument: a contiguous float32 [heads] tensor's address, 0 for none."""
    if sinks is None:
        return 0
    assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == heads
    return sinks.data_ptr()


class ExtendPlan:
    """What every layer's prompt-chunk attention call of one step shares: the requests with more
    than one new token, their page tables, and where their tokens sit among the step's rows."""

    def __init__(
        self,
        page_tables: list[list[int]],
        prefix_lens: list[int],
        extend_lens: list[int],
        q_starts: list[int],
    ):
        self.tables = torch.from_numpy(padded_tables(page_tables))
        self.prefix_lens = torch.tensor(prefix_lens, dtype=torch.int64)
        self.extend_lens = torch.tensor(extend_lens, dtype=torch.int64)
        self.q_starts = torch.tensor(q_starts, dtype=torch.int64)


def extend_attention(
    lib: ctypes.CDLL,
    plan: ExtendPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Attention of each planned request's new tokens (rows of q [T, H, D], strided rows allowed)
    over its cached prefix and themselves, written into out [T, H, D] (contiguous, q's dtype);
    their keys and values must be in the cache already. window, softcap, sinks: as
    decode_attention's.
    False if this shape is not supported."""
    t, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    hkv, s, _ = k.shape
    return bool(
        lib.extend_attention(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            v.data_ptr(),
            plan.tables.data_ptr(),
            plan.tables.shape[1],
            plan.q_starts.data_ptr(),
            plan.prefix_lens.data_ptr(),
            plan.extend_lens.data_ptr(),
            len(plan.q_starts),
            out.data_ptr(),
            h,
            hkv,
            d,
            s,
            page_size,
            scale,
            int(q.dtype == torch.bfloat16),
            int(k.dtype == torch.bfloat16),
            window or 0,
            softcap or 0.0,
            _sinks_pointer(sinks, h),
        )
    )
