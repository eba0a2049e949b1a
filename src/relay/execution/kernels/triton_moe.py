"""A grouped-GEMM mixture-of-experts FFN in Triton, for CUDA (the shape of vLLM's fused_moe).

UNVERIFIED ON A GPU: written on a machine without one; the tests run these kernels under Triton's
interpreter (TRITON_INTERPRET=1) on CPU tensors against the torch grouped path
(tests/execution/models/test_models_moe.py), which checks the indexing and arithmetic, not CUDA compilation,
speed or tile sizes.

A step's (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
BLOCK_M rows (align_pairs, torch ops on the device: no host sync, so the launch sizes depend on the
batch shape only). One program multiplies BLOCK_M pairs of one expert by a BLOCK_N slice of that
expert's weight: the gate/up GEMM gathers its rows from the tokens, silu-and-mul runs in torch, the
down GEMM reads the pairs' rows and scales them by their routing weights; the k slots of each
token are then summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _expert_gemm(
    A,
    W,
    Out,
    pair_ids,
    block_expert,
    scales,
    num_pairs,
    N,
    K,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_BY_TOKEN: tl.constexpr,
    SCALE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Out[pair, n-block] = A[row of pair] @ W[expert].T (x the pair's routing weight if SCALE),
    for the BLOCK_M pairs of this program's block; A's row is the pair's token (A_BY_TOKEN) or the
    pair itself. Padding pairs (id >= num_pairs) and blocks past the last (expert -1) do nothing."""
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids + offs_m)
    valid = pairs < num_pairs
    if A_BY_TOKEN:
        rows = pairs // top_k
    else:
        rows = pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = W + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            A + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if IEEE:  # float32 weights: full-precision products, not TF32
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if SCALE:
        acc *= tl.load(scales + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(Out.dtype.element_ty),
        mask=valid[:, None] & mask_n[None, :],
    )


def align_pairs(
    experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert, each expert's run padded to block_m with the id T*k; the expert
    of each block of block_m, -1 past the last), sized for the worst case of this many pairs."""
    flat = experts.flatten()
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = (
        torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    )
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pair_ids = torch.full((capacity,), pairs, dtype=torch.int64, device=flat.device)
    pair_ids[padded_start[sorted_experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pair_ids, block_expert.to(torch.int32)


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    pairs: int,
    top_k: int,
    by_token: bool,
    scales: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(pairs, n, dtype=out_dtype, device=a.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _expert_gemm[grid](
        a,
        w,
        out,
        pair_ids,
        block_expert,
        scales if scales is not None else out,
        pairs,
        n,
        k,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_BY_TOKEN=by_token,
        SCALE=scales is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate(x)) * up(x)): x [T, H], w_gate_up
    [E, 2I, H] (gate rows first), w_down [E, H, I], weights/experts [T, k]. float32 accumulation,
    output in x's dtype."""
    t, top_k = experts.shape
    pairs = t * top_k
    pair_ids, block_expert = align_pairs(experts, w_gate_up.shape[0])
    x = x.contiguous()
    gate_up = _gemm(x, w_gate_up, pair_ids, block_expert, pairs, top_k, True, None, x.dtype)
    inter = w_gate_up.shape[1] // 2
    h = (torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(
        x.dtype
    )
    scales = weights.flatten().float().contiguous()
    down = _gemm(h, w_down, pair_ids, block_expert, pairs, top_k, False, scales, torch.float32)
    return down.view(t, top_k, -1).sum(1).to(x.dtype)
