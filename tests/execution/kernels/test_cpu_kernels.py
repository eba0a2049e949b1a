"""Relay's C kernels for CPUs against plain torch references: every specialised shape (head
dims, query heads per kv head), dtype, and the cases that split or reorder work (requests
longer than a chunk, requests sharing their first pages)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay.execution.kernels import cpu, cpu_attention, cpu_gemm, cpu_ops, isa
from tests.helpers.kernel_helpers import (  # noqa: F401 (bf16_level, kernel_level: fixtures)
    bf16_level,
    cpu_kernels_or_skip,
    decode_rounding,
    kernel_level,
)

PS = 16


@pytest.fixture(scope="module")
def lib():
    return cpu_kernels_or_skip()


@pytest.fixture
def level_lib(kernel_level):
    """The library at each instruction-set level this CPU reaches (the kernels every level has)."""
    return cpu.load()


def reference(q, k, v, tables, lens, scale):
    """q [B, H, D]; k/v [HKV, S, D] paged; dense softmax attention over each request's tokens."""
    b, h, d = q.shape
    hkv = k.shape[0]
    out = torch.empty(b, h, d)
    for i in range(b):
        slots = torch.tensor([tables[i][t // PS] * PS + t % PS for t in range(lens[i])])
        keys = k[:, slots].float().repeat_interleave(h // hkv, dim=0)  # [H, L, D]
        vals = v[:, slots].float().repeat_interleave(h // hkv, dim=0)
        p = torch.softmax(torch.einsum("hd,hld->hl", q[i].float(), keys) * scale, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", p, vals)
    return out


# Every instance the dispatcher has: head_dim 64 and 128 with 1..8 query heads per kv head (each its
# own compiled kernel), the runtime-shaped one (16, 80: whole vectors at every level; 24: whole
# vectors of 8 below AVX-512 only; groups past 8), and the plain C kernel (20; 24 with AVX-512).
SHAPES = (
    [(64, g) for g in range(1, 9)]
    + [(128, g) for g in range(1, 9)]
    + [(d, g) for d in (16, 20, 24, 80) for g in (1, 3, 9)]
)


@pytest.mark.parametrize("d,group", SHAPES)
@pytest.mark.parametrize(
    "io,kv",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_decode_attention_matches_dense(level_lib, kernel_level, d, group, io, kv):
    rng = np.random.default_rng(d * 31 + group)
    hkv, b = 2, 5
    # ragged: one token, part pages, a page and one, and more than one chunk (DECODE_CHUNK)
    lens = [1, 17, 600, 1300, 33]
    shared = rng.permutation(np.arange(1, 400))[
        :20
    ].tolist()  # requests 3 and 4 share their first pages
    free = [p for p in rng.permutation(np.arange(1, 400)).tolist() if p not in shared]
    tables = []
    for i, n in enumerate(lens):
        pages = -(-n // PS)
        tables.append(
            (shared[:2] if i >= 3 else [])
            + [free.pop() for _ in range(pages - (2 if i >= 3 else 0))]
        )
    k = torch.randn(hkv, 400 * PS, d).to(kv)
    v = torch.randn(hkv, 400 * PS, d).to(kv)
    q = torch.randn(b, hkv * group, d).to(io)
    if group > cpu_attention.MAX_GROUP:
        pytest.skip("beyond the kernel's group limit (the backend uses torch there)")
    plan = cpu_attention.DecodePlan(tables, lens)
    out = cpu_attention.decode_attention(level_lib, plan, q, k, v, PS, d**-0.5)
    assert out.dtype == io and out.shape == q.shape
    rounded, tol = decode_rounding(io, kv, d, group, kernel_level)
    expect = reference(q.to(torch.bfloat16) if rounded else q, k, v, tables, lens, d**-0.5)
    torch.testing.assert_close(out.float(), expect, atol=tol, rtol=tol)


def test_decode_plan_puts_requests_that_share_a_prefix_side_by_side():
    plan = cpu_attention.DecodePlan([[7, 1], [3], [7, 2], [3, 9], [5]], [20, 5, 18, 30, 1])
    order = plan.order.tolist()
    assert sorted(order) == [0, 1, 2, 3, 4]
    firsts = [[7, 3, 7, 3, 5][i] for i in order]
    assert firsts == sorted(firsts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(level_lib, dtype):
    x, res, w = (
        torch.randn(7, 96).to(dtype),
        torch.randn(7, 96).to(dtype),
        torch.randn(96).to(dtype),
    )
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    ref = torch.nn.functional.rms_norm(x.float(), (96,), w.float(), 1e-6)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6).float(), ref, **tol)
    total = (x.float() + res.float()).to(dtype)
    ref = torch.nn.functional.rms_norm(total.float(), (96,), w.float(), 1e-6)
    r = res.clone()
    out = cpu_ops.rms_norm(x.clone(), w, 1e-6, r)
    torch.testing.assert_close(r, total)  # the residual stream, updated in place
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_in_place_like_the_torch_path(level_lib, dtype):
    from relay.execution.layers import RotaryEmbedding, apply_rotary

    rot = RotaryEmbedding(64, 512, 10000.0, None)
    nq, nk, d, t = 4, 2, 64, 5
    qkv = torch.randn(t, (nq + 2 * nk) * d).to(dtype)
    positions = torch.tensor([0, 3, 17, 200, 511])
    cos, sin = rot.cos_sin(positions, torch.float32)
    ref = apply_rotary(qkv[:, : (nq + nk) * d].float().view(t, nq + nk, d), cos, sin).view(t, -1)
    out = qkv.clone()
    cpu_ops.rope(out, rot.cos, rot.sin, positions, nq, nk, d)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[:, : (nq + nk) * d].float(), ref, **tol)
    assert torch.equal(out[:, (nq + nk) * d :], qkv[:, (nq + nk) * d :]), "v is left alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(level_lib, dtype):
    gate_up = torch.randn(6, 2 * 40).to(dtype)
    g, u = gate_up.float().split(40, dim=-1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        cpu_ops.silu_mul(gate_up).float(), torch.nn.functional.silu(g) * u, **tol
    )


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 50), (200, 576)])
def test_small_batch_bf16_gemm(lib, m, n, k):
    if not cpu_gemm.gemm_bf16_available():
        pytest.skip("this CPU has no AVX512-BF16")
    x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    ref = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(
        cpu_gemm.gemm_bf16(x, w, b, torch.float32), ref, atol=1e-3, rtol=1e-4
    )
    torch.testing.assert_close(
        cpu_gemm.gemm_bf16(x, w).float(), x.float() @ w.float().T, atol=0.5, rtol=1e-2
    )


# rows: one tile, an AMX tile of 16 and one row past it, 33 (three AMX tiles), past a 256-row pass
@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 33, 300])
@pytest.mark.parametrize(
    "n,k", [(96, 64), (37, 50), (200, 576)]
)  # panels of 48 features: whole, short, mixed
def test_bf16_gemm_on_panels(bf16_level, m, n, k):
    """relay_gemm_bf16_panels against float32 math on bfloat16-rounded inputs: bias or none,
    float32 or bfloat16 in and out, and rows of x that are not contiguous."""
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    panels = cpu_gemm.pack_panels(w)
    wide = torch.randn(m, k + 6)
    for x in (wide[:, 2 : k + 2], wide[:, :k].bfloat16()):
        ref = x.bfloat16().float() @ w.float().T
        torch.testing.assert_close(
            cpu_gemm.gemm_panels(x, panels, b, torch.float32), ref + b.float(), atol=1e-3, rtol=1e-4
        )
        torch.testing.assert_close(
            cpu_gemm.gemm_panels(x, panels, out_dtype=torch.bfloat16), ref.bfloat16()
        )


def test_a_weight_with_an_odd_input_count_keeps_onednn(lib):
    w = torch.randn(64, 51).bfloat16()
    assert cpu_gemm.pack_panels(w) is None
    x = torch.randn(5, 51).bfloat16()
    from relay.execution.layers import cpu_matmul, pack_for_cpu

    torch.testing.assert_close(
        cpu_matmul(x, w, pack_for_cpu(w)).float(), x.float() @ w.float().T, atol=0.1, rtol=2e-2
    )


def dense_causal(q, k, v, table, prefix, n, scale):
    """q [n, H, D] new tokens at positions prefix..prefix+n-1 over the cache's first prefix+n tokens."""
    h = q.shape[1]
    hkv = k.shape[0]
    slots = torch.tensor([table[t // PS] * PS + t % PS for t in range(prefix + n)])
    keys = k[:, slots].float().repeat_interleave(h // hkv, dim=0)
    vals = v[:, slots].float().repeat_interleave(h // hkv, dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), keys) * scale
    allowed = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]
    p = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hnl,hld->nhd", p, vals)


def check_extend_attention(lib, level, d, group, io, kv):
    """extend_attention against dense causal attention, or its refusal where the level at `level`
    does not take these dtypes and head_dim (the backend keeps torch's SDPA there)."""
    rng = np.random.default_rng(d + group)
    hkv = 2
    prefix_lens, extend_lens = [0, 37, 16, 300], [40, 5, 33, 17]
    free = rng.permutation(np.arange(1, 300)).tolist()
    tables = [
        [free.pop() for _ in range(-(-(p + e) // PS))] for p, e in zip(prefix_lens, extend_lens)
    ]
    k = torch.randn(hkv, 300 * PS, d).to(kv)
    v = torch.randn(hkv, 300 * PS, d).to(kv)
    total = sum(extend_lens)
    qkv = torch.randn(total, hkv * group * d + 7).to(io)  # q as a strided view into a wider row
    q = qkv[:, : hkv * group * d].view(total, hkv * group, d)
    starts = np.concatenate([[0], np.cumsum(extend_lens)[:-1]]).tolist()
    plan = cpu_attention.ExtendPlan(tables, prefix_lens, extend_lens, starts)
    out = torch.zeros(total, hkv * group, d, dtype=io)
    # float32 (a bfloat16 cache widened) at every level, head_dim whole vectors of 8 (16 with
    # AVX-512); bfloat16 x bfloat16 on VDPBF16PS with AVX512-BF16 where head_dim is pairs of 16
    # (an odd number of 16s takes the float tiles there), so every head_dim of whole vectors is taken
    supported = d % (16 if isa.at_least("avx512", level) else 8) == 0
    assert cpu_attention.tiled_attention_available(io, kv, d) == supported
    assert cpu_attention.extend_attention(lib, plan, q, k, v, out, PS, d**-0.5) == supported
    if not supported:
        return
    tol = (
        1e-4 if io == torch.float32 else 3e-2
    )  # (a bfloat16 cache's values are the reference's too)
    for table, p, e, s0 in zip(tables, prefix_lens, extend_lens, starts):
        ref = dense_causal(q[s0 : s0 + e], k, v, table, p, e, d**-0.5)
        torch.testing.assert_close(out[s0 : s0 + e].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("d", [16, 24, 64, 80, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_extend_attention_matches_dense(bf16_level, d, group):
    # (held at amx or avx512bf16: either reaches avx512bf16, all that the expectations ask)
    check_extend_attention(bf16_level, "avx512bf16", d, group, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("d", [16, 24, 64, 80, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_float32_extend_attention_matches_dense_at_every_level(
    level_lib, kernel_level, d, group, kv
):
    check_extend_attention(level_lib, kernel_level, d, group, torch.float32, kv)


def check_shared_prefixes(lib, level, d, group, io, kv):
    """Requests that share a cached prefix's pages attend it in one pass (cascade): the same result
    as dense attention, and as each request alone."""
    assert cpu_attention.tiled_attention_available(
        io, kv, d
    )  # (head_dim 64 and 128: at every level, in every dtype)
    rng = np.random.default_rng(d)
    hkv = 2
    free = rng.permutation(np.arange(1, 500)).tolist()
    system_a = [free.pop() for _ in range(70)]  # 1,120 tokens, more than two chunks
    system_b = [free.pop() for _ in range(5)]
    lens = [1130, 1200, 1125, 90, 95, 85, 300, 1121]
    prefixes = [system_a, system_a, system_a, system_b, system_b, [], [], system_a[:30]]
    tables = []
    for n, pre in zip(lens, prefixes):
        own = -(-n // PS) - len(pre)
        tables.append(pre + [free.pop() for _ in range(own)])
    k = torch.randn(hkv, 500 * PS, d).to(kv)
    v = torch.randn(hkv, 500 * PS, d).to(kv)
    q = torch.randn(len(lens), hkv * group, d).to(io)
    plan = cpu_attention.DecodePlan(tables, lens, PS, share=True)
    assert plan.num_groups == 2  # system_a's four (one only partly) and system_b's two
    out = cpu_attention.decode_attention(lib, plan, q, k, v, PS, d**-0.5)
    # float queries over a bfloat16 cache go to VDPBF16PS rounded to bfloat16 with AVX512-BF16
    rounded = io == torch.float32 and kv == torch.bfloat16 and isa.at_least("avx512bf16", level)
    tol = 2e-2 if io == torch.bfloat16 else 5e-3 if rounded else 1e-4
    expect = reference(q.to(torch.bfloat16) if rounded else q, k, v, tables, lens, d**-0.5)
    torch.testing.assert_close(out.float(), expect, atol=tol, rtol=tol)
    alone = cpu_attention.decode_attention(
        lib, cpu_attention.DecodePlan(tables, lens, PS), q, k, v, PS, d**-0.5
    )
    torch.testing.assert_close(out.float(), alone.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("d,group", [(64, 3), (128, 4), (64, 1)])
def test_decode_attention_over_shared_prefixes_matches_dense(bf16_level, d, group):
    check_shared_prefixes(bf16_level, "avx512bf16", d, group, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("d,group", [(64, 3), (128, 4), (64, 1)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_float32_decode_over_shared_prefixes_at_every_level(level_lib, kernel_level, d, group, kv):
    check_shared_prefixes(level_lib, kernel_level, d, group, torch.float32, kv)
