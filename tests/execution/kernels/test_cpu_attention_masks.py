"""Relay's C attention kernels with sliding windows and soft-capped scores (Mistral, Mixtral, Phi-3,
Gemma 2/3) against a dense torch reference, at every instruction-set level this CPU reaches:
decode (each kind of kernel the dispatcher has), prompt chunks (float tiles, VDPBF16PS, AMX tiles),
and the shared-prefix cascade with windows that skip, cut into, or keep the shared pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay.execution.kernels import cpu, cpu_attention, isa
from tests.helpers.kernel_helpers import (  # noqa: F401 (bf16_level, kernel_level: fixtures)
    bf16_level,
    cpu_kernels_or_skip,
    decode_rounding,
    kernel_level,
)

PS = 16
CAP = 2.0  # q.k * d^-0.5 of random rows is ~N(0, 1): a cap of 2 bends most scores


def dense(q, k, v, table, positions, scale, window=None, softcap=None, ps=PS):
    """q [n, H, D]: one request's queries at `positions` over its keys and values (k/v [HKV, S, D],
    pages of ps tokens `table`): causal, within the window (p - window < j <= p), scores
    soft-capped after the scale as transformers' Gemma 2 caps them."""
    h, hkv = q.shape[1], k.shape[0]
    length = max(positions) + 1
    slots = torch.tensor([table[t // ps] * ps + t % ps for t in range(length)])
    keys = k[:, slots].float().repeat_interleave(h // hkv, dim=0)  # [H, L, D]
    vals = v[:, slots].float().repeat_interleave(h // hkv, dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    j, p = torch.arange(length)[None, :], torch.tensor(positions)[:, None]
    allowed = j <= p
    if window is not None:
        allowed &= j > p - window
    p = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hnl,hld->nhd", p, vals)


def pages(rng: np.random.Generator, count: int) -> list[int]:
    """A pool of `count` pages, shuffled (page 0 left out, as the runner keeps it)."""
    return rng.permutation(np.arange(1, count)).tolist()


# ---- decode ------------------------------------------------------------------------------------
# (window, soft-cap): the cap alone; only the query's own key; one page; mid-page; a window that
# starts mid-page past the first chunk (DECODE_CHUNK) of the longest request; longer than any request
DECODE_MASKS = [(None, CAP), (1, None), (16, CAP), (37, None), (530, CAP), (5000, None)]
# head_dim 64 and 128 (specialised kernels, VDPBF16PS on a bfloat16 cache), 80 and 16 with 9 heads
# per kv head (runtime-shaped), 20 (the plain C kernel everywhere), 24 (plain C with AVX-512)
DECODE_SHAPES = [(64, 1), (64, 3), (128, 4), (128, 8), (80, 3), (16, 9), (20, 2), (24, 3)]
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("d,group", DECODE_SHAPES)
@pytest.mark.parametrize("io,kv", DTYPES)
def test_decode_attention_applies_windows_and_caps(kernel_level, d, group, io, kv):
    lib = cpu.load()
    rng = np.random.default_rng(d * 7 + group)
    hkv, lens = 2, [1, 17, 600, 1300, 33]
    free = pages(rng, 400)
    tables = [[free.pop() for _ in range(-(-n // PS))] for n in lens]
    k, v = (torch.randn(hkv, 400 * PS, d).to(kv) for _ in range(2))
    q = torch.randn(len(lens), hkv * group, d).to(io)
    plan = cpu_attention.DecodePlan(tables, lens)
    # the VDPBF16PS kernel takes a bfloat16 cache's queries in bfloat16 (test_cpu_kernels)
    rounded, tol = decode_rounding(io, kv, d, group, kernel_level)
    qr = q.to(torch.bfloat16) if rounded else q
    for window, cap in DECODE_MASKS:
        out = cpu_attention.decode_attention(
            lib, plan, q, k, v, PS, d**-0.5, window=window, softcap=cap
        )
        for i, n in enumerate(lens):
            want = dense(qr[i : i + 1], k, v, tables[i], [n - 1], d**-0.5, window, cap)[0]
            torch.testing.assert_close(
                out[i].float(), want, atol=tol, rtol=tol, msg=f"window {window}, cap {cap}"
            )


@pytest.mark.parametrize("d,group", [(64, 3), (128, 1), (80, 2)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_decode_over_pages_smaller_than_a_tile(kernel_level, d, group, kv):
    """--page-size 4: a work item's runs of keys are 4 long, and the last one's scores of a full
    512-key chunk (or of one that starts mid-page) stored a whole vector past the chunk's end,
    into the next query head's first scores, until the heads' scores sat apart by more."""
    ps, hkv, lens = 4, 2, [1300, 600, 512]
    rng = np.random.default_rng(d + group)
    free = pages(rng, 800)
    tables = [[free.pop() for _ in range(-(-n // ps))] for n in lens]
    k, v = (torch.randn(hkv, 800 * ps, d).to(kv) for _ in range(2))
    q = torch.randn(len(lens), hkv * group, d)
    plan = cpu_attention.DecodePlan(tables, lens, ps)
    rounded = kv == torch.bfloat16 and isa.at_least("avx512bf16", kernel_level) and d != 80
    tol = 1e-5 if kv == torch.float32 else 5e-3 if rounded else 2e-3
    qr = q.to(torch.bfloat16) if rounded else q
    for window in (None, 530):
        out = cpu_attention.decode_attention(cpu.load(), plan, q, k, v, ps, d**-0.5, window=window)
        for i, n in enumerate(lens):
            want = dense(qr[i : i + 1], k, v, tables[i], [n - 1], d**-0.5, window, ps=ps)[0]
            torch.testing.assert_close(out[i], want, atol=tol, rtol=tol, msg=f"window {window}")


# ---- prompt chunks -----------------------------------------------------------------------------
# the cap alone; 5 and 16 (windows inside an item of new tokens); 37 (mid-page); 200 (past a 300-token
# prefix: whole 64-key tiles that every row of an item sees, the unmasked kernel's); longer than all
EXTEND_MASKS = [(None, CAP), (5, None), (16, CAP), (37, None), (200, CAP), (1000, None)]


def check_extend(lib, level, d, group, io, kv):
    rng = np.random.default_rng(d + group)
    hkv = 2
    prefix_lens, extend_lens = [0, 37, 16, 300], [40, 5, 33, 17]
    free = pages(rng, 300)
    tables = [
        [free.pop() for _ in range(-(-(p + e) // PS))] for p, e in zip(prefix_lens, extend_lens)
    ]
    k, v = (torch.randn(hkv, 300 * PS, d).to(kv) for _ in range(2))
    total = sum(extend_lens)
    q = torch.randn(total, hkv * group, d).to(io)
    starts = np.concatenate([[0], np.cumsum(extend_lens)[:-1]]).tolist()
    plan = cpu_attention.ExtendPlan(tables, prefix_lens, extend_lens, starts)
    if not cpu_attention.tiled_attention_available(io, kv, d):
        pytest.skip(f"head_dim {d} is not whole vectors at {level} (the backend keeps SDPA)")
    tol = 1e-4 if io == torch.float32 else 3e-2
    for window, cap in EXTEND_MASKS:
        out = torch.zeros(total, hkv * group, d, dtype=io)
        assert cpu_attention.extend_attention(lib, plan, q, k, v, out, PS, d**-0.5, window, cap)
        for table, p, e, s0 in zip(tables, prefix_lens, extend_lens, starts):
            want = dense(q[s0 : s0 + e], k, v, table, list(range(p, p + e)), d**-0.5, window, cap)
            torch.testing.assert_close(
                out[s0 : s0 + e].float(),
                want,
                atol=tol,
                rtol=tol,
                msg=f"window {window}, cap {cap}",
            )


@pytest.mark.parametrize("d,group", [(16, 3), (64, 1), (64, 3), (80, 2), (128, 4)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_float32_prompt_chunks_apply_windows_and_caps(kernel_level, d, group, kv):
    check_extend(cpu.load(), kernel_level, d, group, torch.float32, kv)


@pytest.mark.parametrize("d,group", [(64, 1), (64, 3), (80, 2), (128, 4)])
def test_bfloat16_prompt_chunks_apply_windows_and_caps(bf16_level, d, group):
    check_extend(bf16_level, "avx512bf16", d, group, torch.bfloat16, torch.bfloat16)


# ---- the shared-prefix cascade -----------------------------------------------------------------
# Requests 0-2 share 1,120 tokens (70 pages: three chunks), 3-4 share 80, 5-6 share nothing. The
# windows: the cap alone; 1 (every shared chunk skipped); 50 (A: the last chunk from mid-page, which
# request 1 does not see at all; B: from mid-page); 200 (A's first chunk skipped, the second cut);
# 700 (A's first chunk cut); 1000 with the cap.
CASCADE_MASKS = [(None, CAP), (1, None), (50, CAP), (200, None), (700, CAP), (1000, CAP)]


def check_cascade(lib, level, d, group, io, kv):
    rng = np.random.default_rng(d)
    hkv = 2
    free = pages(rng, 500)
    system_a, system_b = [free.pop() for _ in range(70)], [free.pop() for _ in range(5)]
    lens = [1130, 1200, 1125, 90, 95, 85, 300]
    prefixes = [system_a] * 3 + [system_b] * 2 + [[], []]
    tables = [
        pre + [free.pop() for _ in range(-(-n // PS) - len(pre))] for n, pre in zip(lens, prefixes)
    ]
    k, v = (torch.randn(hkv, 500 * PS, d).to(kv) for _ in range(2))
    q = torch.randn(len(lens), hkv * group, d).to(io)
    shared = cpu_attention.DecodePlan(tables, lens, PS, share=True)
    assert shared.num_groups == 2 and sorted(shared.groups[2].tolist()) == [80, 1120]
    alone = cpu_attention.DecodePlan(tables, lens, PS)
    rounded = io == torch.float32 and kv == torch.bfloat16 and isa.at_least("avx512bf16", level)
    tol = 2e-2 if io == torch.bfloat16 else 5e-3 if rounded else 1e-4
    qr = q.to(torch.bfloat16) if rounded else q
    for window, cap in CASCADE_MASKS:
        out = cpu_attention.decode_attention(
            lib, shared, q, k, v, PS, d**-0.5, window=window, softcap=cap
        ).float()
        for i, n in enumerate(lens):
            want = dense(qr[i : i + 1], k, v, tables[i], [n - 1], d**-0.5, window, cap)[0]
            torch.testing.assert_close(
                out[i], want, atol=tol, rtol=tol, msg=f"request {i}, window {window}, cap {cap}"
            )
        each = cpu_attention.decode_attention(
            lib, alone, q, k, v, PS, d**-0.5, window=window, softcap=cap
        )
        torch.testing.assert_close(out, each.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("d,group", [(64, 3), (128, 4)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_float32_cascade_applies_windows_and_caps(kernel_level, d, group, kv):
    check_cascade(cpu.load(), kernel_level, d, group, torch.float32, kv)


@pytest.mark.parametrize("d,group", [(64, 3), (128, 4)])
def test_bfloat16_cascade_applies_windows_and_caps(bf16_level, d, group):
    check_cascade(bf16_level, "avx512bf16", d, group, torch.bfloat16, torch.bfloat16)
