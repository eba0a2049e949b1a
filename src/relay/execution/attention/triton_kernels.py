"""The Triton kernels of the `triton` attention backend (relay.execution.attention.triton_backend
plans a step and launches them) over the paged KV cache.

KV layout (see relay.memory.kv_cache): per layer one K and one V buffer of shape
[num_pages * page_size, kv_heads, head_dim]; token t of a request lives in slot
page_table[t // page_size] * page_size + t % page_size. Page 0 is scratch.

Kernels:
- decode (one query token per request), split-KV ("flash decoding") in two stages. Stage 1:
  one program per (request, kv head, split) holds all query heads of that kv head (GQA
  group padded to 16 rows for tl.dot), walks its share of the request's tokens in blocks,
  looking each token's page up in the page table, with an fp32 online softmax; it writes a
  partial output and its log-sum-exp. Stage 2 merges the splits per (request, head). The
  split count depends only on the batch size (never on sequence lengths), so a captured
  CUDA graph stays valid whatever the lengths; splits past a request's length are empty.
- extend/prefill: one program per (request, query head, block of new tokens). Phase 1
  attends the request's cached prefix through the page table (no mask but its length);
  phase 2 attends the step's own new keys/values (contiguous rows of k/v) causally.
  Online softmax in fp32 over key blocks.

All kernels run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors too, which is
how the CPU test suite checks them against the torch backend.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_paged(
    q,
    m_i,
    l_i,
    acc,
    K,
    V,
    table,
    start,
    end,
    kvh,
    stride_kt,
    stride_kh,
    offs_n,
    offs_d,
    mask_d,
    sm_scale_log2,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Online-softmax attention of the q rows over tokens [start, end) of one request's paged KV
    (shared by the decode and extend kernels); returns the updated (max, sum, accumulator)."""
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        mask_n = tok < end
        page = tl.load(table + tok // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + tok % PAGE_SIZE
        kv_off = slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def decode_stage1(
    Q,
    K,
    V,
    PageTable,
    SeqLens,
    QRows,
    MidO,
    MidLse,
    sm_scale_log2,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pt,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    q_row = tl.load(QRows + b).to(tl.int64)
    # Whole blocks per split; split 0 always holds token 0, so no request is left empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = PageTable + b.to(tl.int64) * stride_pt
    m_i, l_i, acc = _attend_paged(
        q,
        m_i,
        l_i,
        acc,
        K,
        V,
        table,
        start,
        end,
        kvh,
        stride_kt,
        stride_kh,
        offs_n,
        offs_d,
        mask_d,
        sm_scale_log2,
        PAGE_SIZE,
        BLOCK_N,
        IEEE,
    )

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mo = (
        MidO
        + b.to(tl.int64) * stride_mo_b
        + heads[:, None] * stride_mo_h
        + split * stride_mo_s
        + offs_d[None, :]
    )
    tl.store(mo, out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_g)


@triton.jit
def decode_stage2(
    MidO,
    MidLse,
    QRows,
    Out,
    num_splits,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(QRows + b).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        MidLse + b.to(tl.int64) * stride_ml_b + h * stride_ml_h + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # empty splits (lse -inf) weigh 0; split 0 is never empty
    o = tl.load(
        MidO
        + b.to(tl.int64) * stride_mo_b
        + h * stride_mo_h
        + offs_s[:, None] * stride_mo_s
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        Out + q_row * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


@triton.jit
def extend_kernel(
    Q,
    KNew,
    VNew,
    K,
    V,
    Out,
    PageTable,
    PrefixLens,
    ExtendLens,
    QStarts,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_pt,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    ext = tl.load(ExtendLens + r)
    q_start = tl.load(QStarts + r).to(tl.int64)
    active = mb * BLOCK_M < ext  # programs past this request's new tokens do nothing
    prefix = tl.where(active, tl.load(PrefixLens + r), 0)
    new_end = tl.where(active, tl.minimum(ext, (mb + 1) * BLOCK_M), 0)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Phase 1: the cached prefix, through the page table.
    table = PageTable + r.to(tl.int64) * stride_pt
    m_i, l_i, acc = _attend_paged(
        q,
        m_i,
        l_i,
        acc,
        K,
        V,
        table,
        0,
        prefix,
        kvh,
        stride_kt,
        stride_kh,
        offs_n,
        offs_d,
        mask_d,
        sm_scale_log2,
        PAGE_SIZE,
        BLOCK_N,
        IEEE,
    )

    # Phase 2: the new tokens themselves, causally (key j <= query i); key 0 is always
    # visible, so no row is left without a key.
    for n0 in range(0, new_end, BLOCK_N):
        tok = n0 + offs_n
        mask_n = tok < ext
        rows = q_start + tok
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            KNew + rows[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = mask_n[None, :] & (tok[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            VNew + rows[:, None] * stride_vnt + kvh * stride_vnh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
