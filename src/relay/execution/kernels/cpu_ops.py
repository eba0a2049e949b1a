"""Relay's C row kernels, each one pass over a step's rows (csrc/): RMSNorm (with the residual
add fused), the rotary embedding of q and k in place, SiLU-and-multiply, and a grammar's token
bitmask applied to logits.
"""

from __future__ import annotations

import torch

from relay.execution.kernels import cpu

# The calls read cpu._lib, not cpu.load(): the library use() swapped in (a test's held level)
# is the one.


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """logits [*, vocab] float32 (rows contiguous): -inf where masks [n, words] int32 (one row of
    bits per entry of rows, int64) disallow a token. Only where cpu.load() found the library."""
    cpu._lib.relay_apply_bitmask(
        logits.data_ptr(),
        logits.stride(0),
        rows.data_ptr(),
        masks.data_ptr(),
        rows.numel(),
        masks.shape[1],
        logits.shape[1],
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x) * weight, or with a residual: residual += x in place, then its rms_norm, written
    over x (which the caller no longer needs). x, residual [T, H] contiguous, float32 or bfloat16."""
    out = x if residual is not None else torch.empty_like(x)
    cpu._lib.relay_rms_norm(
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        cpu.bf16_flag(x),
    )
    return out


def rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_q: int,
    num_k: int,
    head_dim: int,
) -> None:
    """Rotate the q and k heads at the start of each qkv row in place (neox style); cos/sin are the
    float32 [positions, head_dim] tables of RotaryEmbedding, positions int64 [T]."""
    cpu._lib.relay_rope(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        qkv.shape[0],
        qkv.stride(0),
        num_q,
        num_k,
        head_dim,
        cpu.bf16_flag(qkv),
    )


def head_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_q: int,
    num_k: int,
    head_dim: int,
) -> None:
    """rms_norm of each q head (by q_weight [head_dim]) and each k head (by k_weight) at the start
    of each qkv row, in place (Qwen3's and Gemma 3's q/k norms)."""
    cpu._lib.relay_head_norm(
        qkv.data_ptr(),
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        qkv.shape[0],
        qkv.stride(0),
        num_q,
        num_k,
        head_dim,
        eps,
        cpu.bf16_flag(qkv),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [T, 2 * I] gate_up (gate first)."""
    return _gated(gate_up, cpu._lib.relay_silu_mul)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up of a [T, 2 * I] gate_up (gate first), gelu's tanh approximation (Gemma's
    GeGLU, transformers' gelu_pytorch_tanh)."""
    return _gated(gate_up, cpu._lib.relay_gelu_tanh_mul)


def _gated(gate_up: torch.Tensor, kernel) -> torch.Tensor:
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, cpu.bf16_flag(gate_up))
    return out
