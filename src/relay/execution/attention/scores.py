"""Attention scores beyond a causal softmax, in torch: soft-capped scores (Gemma 2) and attention
sinks (gpt-oss), where the torch backend computes attention itself (no C kernel here, a shape the
kernels refuse, GPUs). SDPA can do neither, so a prompt chunk with either goes through
scored_prefill's explicit matrices.

A sink is a learned logit per query head that joins each query row's softmax as one more column
and attends no value: the row's probabilities over its keys sum to less than 1. transformers'
eager attention concatenates it to the scores, softmaxes and drops it; so does this, in float32.
"""

from __future__ import annotations

import torch


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Soft-capped scores, as transformers' Gemma 2 computes them (a no-op without a cap)."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dimension of float32 scores, with each row's sink as one more logit
    (dropped from the result) where sinks is given: a tensor that broadcasts to scores with its
    last dimension 1 (the row's head's sink)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def scored_prefill(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A prompt chunk's attention with soft-capped scores and/or sinks, the query heads that share
    a kv head as the rows of one matrix (keys never repeated for GQA). q: [n, heads, d]; keys,
    values: [kv_heads, seq_len, d]; mask: [n, seq_len] bool of the keys each query sees (None:
    plain causal from position 0); sinks: float32 [heads]. Returns [n, heads, d]."""
    n, heads, d = q.shape
    hkv, seq_len = keys.shape[0], keys.shape[1]
    group = heads // hkv
    if mask is None:  # plain causal from position 0: seq_len == n
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    qg = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    scores = capped(torch.bmm(qg, keys.transpose(1, 2)).float() * scale, softcap)
    scores = scores.view(hkv, group, n, seq_len).masked_fill(~mask, float("-inf"))
    row_sinks = None if sinks is None else sinks.view(hkv, group, 1, 1)
    probs = softmax(scores, row_sinks).to(q.dtype).view(hkv, group * n, seq_len)
    out = torch.bmm(probs, values).view(hkv, group, n, d)
    return out.permute(2, 0, 1, 3).reshape(n, heads, d)
