"""Relay's C GEMM kernels: small-batch bfloat16 GEMMs (csrc/gemm_bf16.c), bfloat16 GEMMs on
prepacked panels (VDPBF16PS, or AMX tiles: csrc/gemm_amx.c), GEMMs on GGUF blocks
(csrc/gemm_blocks.c), float32 GEMMs on bfloat16 weights widened in registers (csrc/gemm_widen.c)
and int8 x int8 GEMMs around torch._int_mm (w8a8); and which of them run on this CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from relay.execution.kernels import cpu, isa

if TYPE_CHECKING:
    from relay.execution.weight_blocks import BlockWeight

# The calls read cpu._lib, not cpu.load(): the library use() swapped in (a test's held level)
# is the one.

# csrc/gemm_bf16.c takes up to 8 rows; above 3 oneDNN's blocked GEMM is faster on a Zen 4 (the
# kernel turns compute-bound), below it streams the weights at 1.6-2x oneDNN's speed.
GEMM_BF16_MAX_ROWS = 3


def gemm_bf16_available() -> bool:
    lib = cpu.load()
    return lib is not None and bool(lib.relay_gemm_bf16_available())


@dataclass
class Bf16Panels:
    """A bfloat16 [N, K] weight repacked for csrc/gemm_bf16.c's relay_gemm_bf16_panels: panels of
    `panel` output features (N padded with zero rows), each [K / 2, panel] pairs of weights."""

    data: torch.Tensor  # int32 [panels, K / 2, panel]: feature n's weights 2p (low half), 2p + 1
    out_features: int
    in_features: int


def amx_available() -> bool:
    """Whether the panels' GEMMs run on AMX tiles here (csrc/gemm_amx.c): the library was built
    for the amx level and Linux granted the tile state."""
    lib = cpu.load()
    return lib is not None and bool(lib.relay_gemm_amx_available())


def panels_preferred() -> bool:
    """Whether a bfloat16 model's batched GEMMs run on Bf16Panels here rather than on oneDNN's
    prepacked weights (and then a step's layers run in one C call): where the CPU has AVX512-BF16,
    the panels on VDPBF16PS, unless it has AMX too, where they run on tiles (the panels are AMX's
    B operand as they stand: csrc/gemm_amx.c) if Linux granted the tile state. With AVX512-BF16
    alone oneDNN reaches ~60 % of the VDPBF16PS peak at 32 rows and the panels ~85 % (Zen 4,
    docs/benchmarks.md); with AMX and the tiles refused, oneDNN's tile GEMMs (560 GFLOP/s at 32
    rows on a 2-core Xeon, ../shared/FACTS.md) beat any VDPBF16PS kernel."""
    if not gemm_bf16_available():
        return False
    return amx_available() or not isa.at_least("amx")


def pack_panels(w: torch.Tensor) -> Bf16Panels | None:
    """w [N, K] bfloat16 as Bf16Panels, or None where K is odd or the kernel is not built here."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or k % 2 or not gemm_bf16_available():
        return None
    panel = cpu._lib.relay_gemm_bf16_panel_features()
    padded = torch.zeros(-(-n // panel) * panel, k, dtype=torch.bfloat16)
    padded[:n] = w
    pairs = padded.view(-1, panel, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Bf16Panels(pairs.view(torch.int32).view(-1, k // 2, panel), n, k)


def gemm_panels(
    x: torch.Tensor,
    w: Bf16Panels,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] bfloat16 or float32 (rounded to bfloat16) times w (+ bias, bfloat16) -> [M, N] in
    out_dtype (bfloat16 or float32)."""
    if x.stride(-1) != 1 or (x.dtype == torch.bfloat16 and x.stride(0) % 2):
        x = x.contiguous()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=out_dtype)
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
    if not cpu._lib.relay_gemm_bf16_panels(
        x.data_ptr(),
        x.stride(0),
        int(x.dtype == torch.float32),
        w.data.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        int(out_dtype == torch.float32),
        m,
        w.out_features,
        w.in_features,
    ):
        raise RuntimeError(f"relay_gemm_bf16_panels refused x {tuple(x.shape)} {x.dtype}")
    return y


def gemm_bf16(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] bf16 (M <= GEMM_BF16_MAX_ROWS), w [N, K] bf16 contiguous -> [M, N] in out_dtype
    (bfloat16 or float32). Only where gemm_bf16_available()."""
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    cpu._lib.relay_gemm_bf16(
        x.data_ptr(),
        w.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        int(out_dtype == torch.float32),
    )
    return y


def gemm_blocks_available() -> bool:
    lib = cpu.load()
    return lib is not None and bool(lib.relay_gemm_blocks_available())


def gemm_blocks(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """x [M, K] float32 times a weight kept in GGUF blocks (relay.execution.weight_blocks) -> [M, N] float32.
    Only where gemm_blocks_available()."""
    if w.in_perm is not None:  # (a contiguous copy, x's columns in the blocks' order)
        x = x.index_select(1, w.in_perm)
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    cpu._lib.relay_gemm_blocks(
        w.kernel_bits,
        w.q.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        m,
        w.out_features,
        w.in_features,
        int(w.round_bf16),
    )
    return y


def gemm_widen_available() -> bool:
    lib = cpu.load()
    return lib is not None and bool(lib.relay_gemm_widen_available())


def gemm_widen(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32; another dtype is widened first) times w [N, K] bfloat16 (+ bias) -> [M, N]
    float32, each weight widened to float32 in registers (csrc/gemm_widen.c). Where the kernel is
    not built, torch on a float32 copy of w (the same products)."""
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    w = w.contiguous()  # (a view of the weight as it is: the checkpoint's rows are contiguous)
    m = x.shape[0]
    y = torch.empty(m, w.shape[0], dtype=torch.float32)
    lib = cpu._lib
    done = m == 0 or (
        lib is not None
        and lib.relay_gemm_widen(
            x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), y.stride(0), m, *w.shape
        )
    )
    if not done:
        y = x @ w.float().T
    return y if bias is None else y.add_(bias)


def int8_matmul(
    x: torch.Tensor,
    qt: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times an int8 weight qt [K, N] with float32 scales w_scale [N]
    per output: x quantized to int8 per row, multiplied in int8 (torch._int_mm, int32 sums), scaled
    back (+ bias) into out_dtype."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    x_scale = torch.empty(m, dtype=torch.float32)
    cpu._lib.relay_quantize_rows(
        x.data_ptr(), m, k, cpu.bf16_flag(x), q.data_ptr(), x_scale.data_ptr()
    )
    acc = torch._int_mm(q, qt)
    y = torch.empty(m, qt.shape[1], dtype=out_dtype)
    cpu._lib.relay_dequantize_rows(
        acc.data_ptr(),
        m,
        qt.shape[1],
        x_scale.data_ptr(),
        w_scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        0 if bias is None else cpu.bf16_flag(bias),
        y.data_ptr(),
        cpu.bf16_flag(y),
    )
    return y
