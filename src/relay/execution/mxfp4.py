"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts, dequantized
at load: Relay computes with the float values they stand for.

A weight W [..., rows, cols] is stored as two tensors (transformers' integrations/mxfp4.py,
_convert_moe_packed_tensors, is the reference):
- `<name>_blocks`, uint8 [..., rows, cols / 32, 16]: 32 FP4 (E2M1) codes per block, two per
  byte, the low nibble the even column and the high nibble the odd one. A code's bit 3 is the
  sign; bits 0-2 pick 0, 0.5, 1, 1.5, 2, 3, 4 or 6;
- `<name>_scales`, uint8 [..., rows, cols / 32]: each block's E8M0 scale, the power of two
  2 ** (scale - 127) its 32 values are multiplied by.
gpt-oss's expert tensors are [experts, out_features, in_features] this way: per expert an
nn.Linear weight (transformers transposes them to its in-memory [experts, in, out]).

Every such value (one significant bit after the leading one, times a power of two) is exact in
float32 and in bfloat16 wherever the power stays in their range, so the dequantized weights are
the checkpoint's, in either dtype.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# The E2M1 codes 0-15 (bit 3 the sign), as transformers' FP4_VALUES.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127  # E8M0: the exponent is the byte minus 127


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight [..., rows, cols] that blocks [..., rows, cols / 32, 16] and scales
    [..., rows, cols / 32] hold, in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            f"(want blocks [..., groups, {BLOCK // 2}] and scales [..., groups])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], BLOCK, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)
