"""The packed tensors of AWQ and GPTQ checkpoints, unpacked into one form: 4-bit quants q per
weight and, per group of inputs, a float scale s and an integer zero point z, the weight being
w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)] with g(i) the group of input i.

The layouts, as the formats' own code packs and reads them:

AWQ (AutoAWQ's GEMM version: awq/modules/linear/gemm.py packs, awq/utils/packing_utils.py
unpack_awq + reverse_awq_order + dequantize_gemm read; vLLM's awq_triton.py the same):
    qweight int32 [in, out / 8]: word j of row i holds outputs 8j .. 8j + 7 of input i, output
            8j + AWQ_ORDER[n] in bits 4n .. 4n + 3 (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7)
    qzeros  int32 [in / g, out / 8], packed as qweight; z as stored
    scales  fp16 [in / g, out]; group of input i: i // g

GPTQ (AutoGPTQ's qlinear_cuda(_old).py pack() and its torch forward; vLLM's gptq.py):
    qweight int32 [in / 8, out]: word r of column o holds inputs 8r .. 8r + 7, input 8r + n in
            bits 4n .. 4n + 3
    qzeros  int32 [groups, out / 8]: word c of row g holds outputs 8c .. 8c + 7 in nibble order;
            checkpoint_format gptq (v1) stores z - 1 (read back as nibble + 1, so a zero point of
            0 comes back as 16: AutoGPTQ's own quirk, kept: it is what the checkpoint computes),
            gptq_v2 stores z
    scales  fp16 [groups, out]
    g_idx   int32 [in]: the group of each input; with desc_act (act-order) not i // g: the inputs
            were quantized in another order and each group is a set of inputs scattered over
            the row (without g_idx: i // (in / groups))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output (within 8) nibble n of an AWQ word holds
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble holding output n (the inverse)
NIBBLES = 8  # 4-bit values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class Int4Linear:
    """A linear layer's weight [out, in] as w = (q - zeros[:, group]) * scales[:, group]."""

    q: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # float32 [out, groups] (the checkpoint's fp16 values, exactly)
    zeros: torch.Tensor  # float32 [out, groups], integers 0..16
    group: torch.Tensor  # int64 [in]: the group of each input

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """These rows of the float32 weight: (q - z) * s, one rounding of an exact difference
        (for fp16 scales the product is exact too: 11 significant bits times at most 5)."""
        s, z = self.scales[rows][:, self.group], self.zeros[rows][:, self.group]
        return (self.q[rows].float() - z) * s


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 8]: bits 4k .. 4k + 3 of each word at k."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [rows, out / 8] -> uint8 [rows, out] in output order."""
    n = _nibbles(words)[..., list(AWQ_REVERSE_ORDER)]
    return n.reshape(words.shape[0], -1)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Linear:
    """An AWQ GEMM checkpoint's qweight, qzeros and scales (see the module's docstring)."""
    k = qweight.shape[0]
    groups = scales.shape[0]
    if k % groups:
        raise ValueError(f"awq scales of {groups} groups for {k} inputs")
    q = _awq_columns(qweight).t().contiguous()
    zeros = _awq_columns(qzeros).t().float()
    group = torch.arange(k) // (k // groups)
    return Int4Linear(q, scales.t().float().contiguous(), zeros.contiguous(), group)


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    zero_offset: int,
) -> Int4Linear:
    """A GPTQ checkpoint's qweight, qzeros, scales and g_idx (see the module's docstring);
    zero_offset: 1 for checkpoint_format gptq (v1), 0 for gptq_v2."""
    k = qweight.shape[0] * NIBBLES
    groups = scales.shape[0]
    # [in / 8, out] -> [in / 8, out, 8] -> [in / 8, 8, out] -> [in, out]
    q = _nibbles(qweight).permute(0, 2, 1).reshape(k, -1).t().contiguous()
    zeros = _nibbles(qzeros).reshape(groups, -1).float() + zero_offset
    if g_idx is None:
        if k % groups:
            raise ValueError(f"gptq scales of {groups} groups for {k} inputs and no g_idx")
        group = torch.arange(k) // (k // groups)
    else:
        group = g_idx.to(torch.int64)
        if group.shape != (k,) or int(group.min()) < 0 or int(group.max()) >= groups:
            raise ValueError(f"gptq g_idx of shape {list(g_idx.shape)} for {k} inputs")
    return Int4Linear(q, scales.t().float().contiguous(), zeros.t().contiguous(), group)
