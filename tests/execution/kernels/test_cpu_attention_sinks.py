"""Relay's C attention kernels with attention sinks (gpt-oss: a learned logit per query head in each
softmax's denominator, attending no value) against a dense torch reference that concatenates them
as transformers' eager attention does, at every instruction-set level this CPU reaches: decode
(the specialised, runtime-shaped and plain C kernels, merged over chunks), the shared-prefix
cascade, and prompt chunks (float tiles, VDPBF16PS, AMX tiles), with and without a window. The
sinks include some far above every score (the row's output near 0) and far below (no effect)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay.execution.kernels import cpu, cpu_attention
from tests.helpers.kernel_helpers import (  # noqa: F401 (bf16_level, kernel_level: fixtures)
    bf16_level,
    cpu_kernels_or_skip,
    decode_rounding,
    kernel_level,
)

PS, HKV = 16, 2


def dense(q, k, v, table, positions, scale, sinks, window=None):
    """q [n, H, D]: one request's queries at `positions` over its paged keys and values (k/v
    [HKV, S, D]), causal within the window, each head's sink one more logit of its softmax."""
    h = q.shape[1]
    length = max(positions) + 1
    slots = torch.tensor([table[t // PS] * PS + t % PS for t in range(length)])
    keys = k[:, slots].float().repeat_interleave(h // k.shape[0], dim=0)  # [H, L, D]
    vals = v[:, slots].float().repeat_interleave(h // k.shape[0], dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), keys) * scale
    j, p = torch.arange(length)[None, :], torch.tensor(positions)[:, None]
    allowed = (j <= p) & (j > p - window) if window is not None else j <= p
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    column = sinks.view(h, 1, 1).expand(h, len(positions), 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hnl,hld->nhd", probs, vals)


def sinks_for(heads: int) -> torch.Tensor:
    """Mostly around the scores' size, one far above them and one far below."""
    s = torch.randn(heads) * 2.0
    s[0], s[-1] = 30.0, -30.0
    return s


def tables_of(rng, lens: list[int], pool: int) -> list[list[int]]:
    free = rng.permutation(np.arange(1, pool)).tolist()
    return [[free.pop() for _ in range(-(-n // PS))] for n in lens]


@pytest.mark.parametrize("d,group", [(64, 3), (80, 2), (16, 9), (20, 2)])
@pytest.mark.parametrize("io,kv", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_decode_adds_sinks(kernel_level, d, group, io, kv):
    """Lengths past one 512-key chunk: the sink joins where a row's chunks merge."""
    rng = np.random.default_rng(d + group)
    lens = [1, 17, 600, 1100]
    tables = tables_of(rng, lens, 200)
    k, v = (torch.randn(HKV, 200 * PS, d).to(kv) for _ in range(2))
    q, sinks = torch.randn(len(lens), HKV * group, d).to(io), sinks_for(HKV * group)
    plan = cpu_attention.DecodePlan(tables, lens)
    rounded, tol = decode_rounding(io, kv, d, group, kernel_level)
    qr = q.to(torch.bfloat16) if rounded else q
    for window in (None, 37):
        out = cpu_attention.decode_attention(
            cpu.load(), plan, q, k, v, PS, d**-0.5, window=window, sinks=sinks
        )
        for i, n in enumerate(lens):
            want = dense(qr[i : i + 1], k, v, tables[i], [n - 1], d**-0.5, sinks, window)[0]
            torch.testing.assert_close(out[i].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_cascade_adds_sinks_once(kernel_level, kv):
    """Requests sharing 80 tokens' pages attend them once for all (their partial sums merged
    with their own keys'): the sink counts once per row, as without the cascade."""
    d, group, rng = 64, 3, np.random.default_rng(3)
    free = rng.permutation(np.arange(1, 100)).tolist()
    shared = [free.pop() for _ in range(5)]
    lens = [90, 95, 100]
    tables = [shared + [free.pop() for _ in range(-(-n // PS) - 5)] for n in lens]
    k, v = (torch.randn(HKV, 100 * PS, d).to(kv) for _ in range(2))
    q, sinks = torch.randn(len(lens), HKV * group, d), sinks_for(HKV * group)
    lib, tol = cpu.load(), 5e-3 if kv == torch.bfloat16 else 1e-4
    plan = cpu_attention.DecodePlan(tables, lens, PS, share=True)
    if not plan.num_groups or not cpu_attention.tiled_attention_available(q.dtype, kv, d):
        pytest.skip(f"no cascade at {kernel_level}")
    alone = cpu_attention.DecodePlan(tables, lens, PS)
    for window in (None, 12):
        out = cpu_attention.decode_attention(
            lib, plan, q, k, v, PS, d**-0.5, window=window, sinks=sinks
        )
        each = cpu_attention.decode_attention(
            lib, alone, q, k, v, PS, d**-0.5, window=window, sinks=sinks
        )
        torch.testing.assert_close(out, each, atol=tol, rtol=tol)
        if kv == torch.float32:
            for i, n in enumerate(lens):
                want = dense(q[i : i + 1], k, v, tables[i], [n - 1], d**-0.5, sinks, window)[0]
                torch.testing.assert_close(out[i], want, atol=tol, rtol=tol)


def check_extend(lib, level, d, group, io, kv):
    rng = np.random.default_rng(d + group)
    prefix_lens, extend_lens = [0, 37, 300], [40, 5, 17]
    tables = tables_of(rng, [p + e for p, e in zip(prefix_lens, extend_lens)], 100)
    k, v = (torch.randn(HKV, 100 * PS, d).to(kv) for _ in range(2))
    total = sum(extend_lens)
    q, sinks = torch.randn(total, HKV * group, d).to(io), sinks_for(HKV * group)
    starts = np.concatenate([[0], np.cumsum(extend_lens)[:-1]]).tolist()
    plan = cpu_attention.ExtendPlan(tables, prefix_lens, extend_lens, starts)
    if not cpu_attention.tiled_attention_available(io, kv, d):
        pytest.skip(f"head_dim {d} is not whole vectors at {level} (the backend keeps torch's)")
    tol = 1e-4 if io == torch.float32 else 3e-2
    for window in (None, 16):
        out = torch.zeros(total, HKV * group, d, dtype=io)
        args = (PS, d**-0.5, window, None, sinks)
        assert cpu_attention.extend_attention(lib, plan, q, k, v, out, *args)
        for table, p, e, s0 in zip(tables, prefix_lens, extend_lens, starts):
            want = dense(q[s0 : s0 + e], k, v, table, list(range(p, p + e)), d**-0.5, sinks, window)
            torch.testing.assert_close(out[s0 : s0 + e].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("d,group", [(16, 3), (64, 3)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_float32_prompt_chunks_add_sinks(kernel_level, d, group, kv):
    check_extend(cpu.load(), kernel_level, d, group, torch.float32, kv)


@pytest.mark.parametrize("d,group", [(64, 3), (128, 2)])
def test_bfloat16_prompt_chunks_add_sinks(bf16_level, d, group):
    check_extend(bf16_level, "avx512bf16", d, group, torch.bfloat16, torch.bfloat16)


def test_no_sinks_is_no_change():
    """sinks=None is the kernel without sinks, bit for bit; sinks far below every score change
    nothing beyond rounding."""
    lib = cpu_kernels_or_skip()
    rng = np.random.default_rng(0)
    tables = tables_of(rng, [600], 50)
    k, v = (torch.randn(HKV, 50 * PS, 64) for _ in range(2))
    q = torch.randn(1, HKV * 3, 64)
    plan = cpu_attention.DecodePlan(tables, [600])
    far_below = torch.full((HKV * 3,), -1e4)
    plain = cpu_attention.decode_attention(lib, plan, q, k, v, PS, 0.125)
    assert torch.equal(
        plain, cpu_attention.decode_attention(lib, plan, q, k, v, PS, 0.125, sinks=None)
    )
    torch.testing.assert_close(
        cpu_attention.decode_attention(lib, plan, q, k, v, PS, 0.125, sinks=far_below), plain
    )
