"""Building blocks of the decoder models: norms, rotary embedding, parallel linear layers.

Linear layers hold one shard of the full weight; the loader copies each checkpoint tensor's
slice in through `weight_loader`-style helpers on the model. Column-parallel layers split
the output features (no communication); row-parallel ones split the input features and
all-reduce the partial sums.
"""

from __future__ import annotations

import glob
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from relay.execution.distributed import TPGroup, split_evenly
from relay.execution.kernels import cpu_gemm, cpu_ops
from relay.execution.weight_blocks import BlockWeight
from relay.rope import long_rope_rows, rotary_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused = False  # Relay's CPU kernel (set by the model where it runs); else torch

    @property
    def kernel_weight(self) -> torch.Tensor:
        """The weight Relay's CPU norm kernels multiply by (Gemma's norms: 1 + w)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        # One fused op (float32 accumulation inside); in float32 it is bit-identical to the
        # reference formula w * x * rsqrt(mean(x^2) + eps).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's next value and its norm. The
        CPU kernel adds in place (residual and x are the caller's to give up)."""
        if self.fused:
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self.forward(residual), residual


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * w + b (StarCoder 2's norms), with RMSNorm's interface."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.forward(residual), residual


# float32 CPU GEMMs of at least this many rows go to oneDNN with a weight prepacked in its
# blocked layout: 1.2-1.6x MKL's speed at 8-96 rows; below, MKL's GEMV path is faster. bfloat16
# ones always do: 1.3-1.8x F.linear's speed at every row count on a Zen 4 (AVX512-BF16). (Where
# pack_for_cpu gave a weight Relay's bfloat16 panels instead, those take every row count.)
PACKED_MIN_ROWS = {torch.float32: 8, torch.bfloat16: 1}


# With --quantization int8, GEMMs of fewer rows than this read int8 weights (torch's weight-only
# kernel, bfloat16 activations): at 1-4 rows 2x float32's speed, at 16+ rows slower
# (scripts/bench_weight_formats.py). Larger GEMMs use the float32 copy of the same quantized values.
INT8_MAX_ROWS = 8

Int8Weight = tuple[torch.Tensor, torch.Tensor]  # int8 [out, in], bfloat16 scale per output row

# With --quantization int4, GEMMs of at most this many rows read 4-bit weights (torch's CPU kernel,
# bfloat16 activations): all of a batch-1 step's GEMMs 5.1 ms against 8.6-11 for bfloat16 and 14.3
# for oneDNN on a Zen 4; from 8 rows on bfloat16 (oneDNN) is faster. Larger GEMMs use the
# float copy of the same quantized values.
INT4_MAX_ROWS = 4
INT4_GROUP = 32  # weights per scale and zero point along the input features (as GGUF's Q4_1 blocks)


# GEMMs of at most BlockWeight.max_rows rows read weights kept in their checkpoint's GGUF blocks
# (weight_blocks.py, csrc/gemm_blocks.c) where those are exact. The server measures that crossover
# at start-up (blocks_crossover_rows): it depends on the CPU and on what the float path is (oneDNN
# float32 here; bfloat16, with AMX or AVX512-BF16, elsewhere). Measured once on a 2-core Xeon (AVX-512,
# no BF16), float32, blocks vs the best float path: 1.9x at 1 row, 2.1x at 8, 1.5x at 32, 1.2x at
# 96, 1.1-1.17x at 128; from 160 rows on it flips either way with the host's drift
# (scripts/bench_gemm_blocks.py), and oneDNN wins from 384. 128 is BlockWeight.max_rows's default,
# where nothing was measured.
BLOCKS_ROW_CANDIDATES = (1, 2, 4, 6, 8, 12, 16, 32, 48, 64, 96, 128, 160, 192, 256)
# The blocks must beat the float path by this margin: where the two are level (~128-256 rows
# here) a timing of one layer's GEMMs is not the whole step.
BLOCKS_MIN_GAIN = 0.95

# With --quantization w8a8, GEMMs of at least this many rows quantize their activations to int8
# per row and multiply int8 by int8 (csrc/w8a8.c around torch._int_mm). A decoder layer's four
# GEMMs on a Zen 4 (AVX512-VNNI), bf16 (oneDNN) against w8a8 with its quantizing: 0.89-0.98x at
# 4-16 rows, 1.05x at 24, 1.09x at 32, ~1.7x for a 256-token prompt chunk.
W8A8_MIN_ROWS = 24


@dataclass
class W8A8Weight:
    qt: torch.Tensor  # int8 [in, out]: the transposed int8 weight, _int_mm's layout
    scale: torch.Tensor  # float32 [out]


@dataclass
class Int4Weight:
    packed: torch.Tensor  # torch's CPU int4 layout ([out, in / 2] uint8)
    scales_and_zeros: torch.Tensor  # bfloat16 [in / group, out, 2]
    group: int


def cpu_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | cpu_gemm.Bf16Panels | None,
    bias: torch.Tensor | None = None,
    int8: Int8Weight | None = None,
    gemv: bool = False,
    out_dtype: torch.dtype | None = None,
    int4: Int4Weight | None = None,
    w8a8: W8A8Weight | None = None,
    blocks: BlockWeight | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) by the fastest path for this many rows; out_dtype float32 lets the
    LM head write its logits in float32 directly."""
    if blocks is not None and x.shape[0] <= blocks.max_rows:
        y = cpu_gemm.gemm_blocks(x, blocks).to(out_dtype or x.dtype)
        return y if bias is None else y + bias
    if w8a8 is not None and x.shape[0] >= W8A8_MIN_ROWS:
        return cpu_gemm.int8_matmul(x, w8a8.qt, w8a8.scale, bias, out_dtype or x.dtype)
    if int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), int4.packed, int4.group, int4.scales_and_zeros
        ).to(x.dtype)
        return y if bias is None else y + bias
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        # a float32 model's bfloat16 weight (LlamaForCausalLM.keep_bf16_weights): widened in registers
        y = cpu_gemm.gemm_widen(x, weight, bias)
        return y if out_dtype in (None, torch.float32) else y.to(out_dtype)
    if gemv and x.shape[0] <= cpu_gemm.GEMM_BF16_MAX_ROWS and x.dtype == torch.bfloat16:
        return cpu_gemm.gemm_bf16(x, weight, bias, out_dtype or torch.bfloat16)
    if int8 is not None and x.shape[0] < INT8_MAX_ROWS:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), *int8).to(x.dtype)
        return y if bias is None else y + bias
    if isinstance(packed, cpu_gemm.Bf16Panels):
        return cpu_gemm.gemm_panels(x, packed, bias, out_dtype or x.dtype)
    if packed is not None and x.shape[0] >= PACKED_MIN_ROWS.get(x.dtype, 8):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def blocks_crossover_rows(modules: list[Linear], reps: int = 3) -> int:
    """The most rows (of BLOCKS_ROW_CANDIDATES) up to which GEMMs over these weights run faster
    from their blocks than by cpu_matmul's float path (by BLOCKS_MIN_GAIN), timed here on
    activations in the weights' dtype, with the weights out of the caches as a step finds them
    (cache_flusher); 0 if the blocks never win (see crossover)."""
    flush = cache_flusher()

    def paths(rows: int) -> PathTiming:
        dtype = modules[0].weight.dtype
        xs = [torch.randn(rows, m.weight.shape[1]).to(dtype) for m in modules]

        def from_blocks() -> None:
            for x, m in zip(xs, modules):
                cpu_gemm.gemm_blocks(x, m.blocks).to(dtype)

        def from_floats() -> None:
            for x, m in zip(xs, modules):
                cpu_matmul(x, m.weight, m.packed, gemv=m.gemv)

        return PathTiming(from_blocks, from_floats, before=flush)

    return crossover(BLOCKS_ROW_CANDIDATES, paths, BLOCKS_MIN_GAIN, reps)


def cache_flusher():
    """A function that pushes what the CPU caches hold out of them, by reading twice the last-level
    cache. A step's GEMMs find their layer's weights in memory, evicted by the other layers' and
    the KV: timed hot in cache instead, bfloat16 panels (16 bits a weight) beat 4.5-bit blocks
    from 4 rows on where a step ran 1.6x faster on the blocks at 4 rows (Zen 5)."""
    size = min(
        max(2 * last_level_cache_bytes(), 64 << 20), 512 << 20
    )  # a bound for CPUs with huge L3s
    buf = torch.ones(size // 4)
    return lambda: buf.sum()


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs reports (0 where it reports none)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def crossover(sizes: tuple[int, ...], paths, min_gain: float, reps: int = 3) -> int:
    """The largest of sizes at which paths(size)'s first path beats its second by min_gain,
    timed here: per size both paths in turn, `reps` times, the fastest run of each, and a loss
    timed again before it counts (another process's burst must not cost the server its fast
    path for good). Stops once the second path has won at two sizes in a row; 0 if the first
    never wins."""
    best = losses = 0
    for size in sizes:
        timing = paths(size)
        if timing is None:
            break
        if timing.first_wins(reps, min_gain) or timing.first_wins(2 * reps, min_gain):
            best, losses = size, 0
        else:
            losses += 1
            if losses == 2:
                break
    return best


class PathTiming:
    """Two ways to do the same work, timed against each other; `before` (untimed) runs ahead of
    every timed call."""

    def __init__(self, first, second, before=None):
        self.paths = (first, second)
        self.before = before
        self.fastest = [math.inf, math.inf]
        for path in self.paths:
            path()  # first calls allocate and fault pages in

    def first_wins(self, reps: int, min_gain: float) -> bool:
        """Time both paths in turn `reps` more times; whether the first's fastest run beats the
        second's by min_gain."""
        for _ in range(reps):
            for i, path in enumerate(self.paths):
                if self.before is not None:
                    self.before()
                start = time.perf_counter()
                path()
                self.fastest[i] = min(self.fastest[i], time.perf_counter() - start)
        return self.fastest[0] < min_gain * self.fastest[1]


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | cpu_gemm.Bf16Panels | None:
    """A copy of a [out, in] weight laid out for batched GEMMs: Relay's bfloat16 panels where
    those are the faster kernel (cpu_gemm.panels_preferred), else oneDNN's blocked layout;
    None where neither is available."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16 and cpu_gemm.panels_preferred():
        panels = cpu_gemm.pack_panels(weight)
        if panels is not None:
            return panels
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    except (RuntimeError, AttributeError):
        return None


def int4_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[Int4Weight, torch.Tensor]:
    """Asymmetric 4-bit weights per group of `group` input features (a scale and a zero point
    each), in torch's CPU int4 layout, and the float weight they stand for. The groups line up
    with a GGUF Q4_1 file's blocks (the default model's), so those weights lose little more."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 needs input features divisible by {group}, got {k}")
    w = weight.float().view(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zeros = lo + 8 * scale  # torch's convention: w = (q - 8) * scale + zero
    sz = torch.stack([scale, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
    # What the kernel computes with: the bfloat16 scale and zero's grid, not the float32 one.
    scale_b, zero_b = sz[..., 0].float().transpose(0, 1), sz[..., 1].float().transpose(0, 1)
    dequant = ((q - 8) * scale_b[..., None] + zero_b[..., None]).view(n, k)
    return Int4Weight(packed, sz, group), dequant.to(weight.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[Int8Weight, torch.Tensor]:
    """Symmetric per-row int8 weight and scales, and the float weight they stand for."""
    w = weight.float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return (q, scale), (q.float() * scale.float()[:, None]).to(weight.dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule csrc/w8a8.c quantizes activations by, in torch (for references and simulations):
    per row s = max|x| / 127 (1 for an all-zero row) and q = round(x * (1 / s)), as float32
    values on the int8 grid [rows, cols] and s [rows, 1]."""
    s = x.float().abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x.float() * (1 / s)).clamp(-127, 127), s


def w8a8_weight(int8: Int8Weight) -> W8A8Weight:
    """The int8 x int8 GEMM's copy of an int8 weight (the same values and scales)."""
    q, scale = int8
    return W8A8Weight(q.t().contiguous(), scale.float())


def stand_in(shape: torch.Size, dtype: torch.dtype) -> nn.Parameter:
    """A weight with a shape and a dtype but no storage of its own, for a module whose weight is
    read only from its blocks (a GGUF file's, loaded without a float copy: gguf_weights)."""
    return nn.Parameter(torch.zeros((), dtype=dtype).expand(shape), requires_grad=False)


def has_float_weight(module: nn.Module) -> bool:
    """Whether the module's weight holds values (not a stand_in)."""
    return 0 not in module.weight.stride()


class Linear(nn.Module):
    """y = x W^T (+ b) with W a [out, in] shard; `reduce` all-reduces the result (row-parallel)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.tp = tp  # set for row-parallel layers only
        self.packed: torch.Tensor | cpu_gemm.Bf16Panels | None = None  # pack_for_cpu's, once loaded
        self.int8: Int8Weight | None = None  # see quantize_int8; --quantization int8 only
        self.int4: Int4Weight | None = None  # see quantize_int4; --quantization int4 only
        self.w8a8: W8A8Weight | None = None  # see w8a8_weight; --quantization w8a8 only
        self.gemv = False  # bfloat16 weights and Relay's small-batch kernel here (pack_for_cpu)
        self.blocks: BlockWeight | None = None  # the weight's exact GGUF blocks (see weight_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a row-parallel layer adds its bias once, after the sum: every rank holds all of it
        reduce = self.tp is not None and self.tp.size > 1
        y = cpu_matmul(
            x,
            self.weight,
            self.packed,
            None if reduce else self.bias,
            self.int8,
            self.gemv,
            int4=self.int4,
            w8a8=self.w8a8,
            blocks=self.blocks,
        )
        if not reduce:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding (and, tied or not, LM head) whose vocabulary rows are split over ranks."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.shard_sizes = [split_evenly(vocab_size, tp.size, r)[1] for r in range(tp.size)]
        self.start, n = split_evenly(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(n, dim, dtype=dtype), requires_grad=False)
        # the rows it returns: the model's dtype, where the table is kept in bfloat16 beside a
        # float32 model (LlamaForCausalLM.keep_bf16_weights: only the rows looked up are widened)
        self.dtype = dtype
        self.packed: torch.Tensor | cpu_gemm.Bf16Panels | None = (
            None  # for the LM head, like Linear.packed
        )
        self.int8: Int8Weight | None = None  # for the LM head, like Linear.int8
        self.int4: Int4Weight | None = None  # for the LM head, like Linear.int4
        self.gemv = False  # for the LM head, like Linear.gemv
        self.blocks: BlockWeight | None = None  # for the LM head, like Linear.blocks
        # ids -> rows of the whole vocabulary (every rank's), where the table is not a float
        # weight (gguf_weights.EmbeddingRows)
        self.lookup = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is not None:
            return self.lookup(ids)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight).to(self.dtype)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).to(self.dtype)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits on every rank."""
        local = cpu_matmul(
            h,
            self.weight,
            self.packed,
            int8=self.int8,
            gemv=self.gemv,
            out_dtype=torch.float32,
            int4=self.int4,
            blocks=self.blocks,
        ).float()
        return self.tp.all_gather_last_dim(local, self.shard_sizes)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half) over the first rotary_dim = head_dim x
    partial_rotary_factor features of each head, with every HF rope scaling relay.rope implements.
    Tables for every position up to max_positions; max_position_embeddings is the config's (what
    YaRN, LongRoPE and dynamic NTK scale against)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        partial_rotary_factor: float = 1.0,
        max_position_embeddings: int | None = None,
    ):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.covers_head = (
            self.rotary_dim == head_dim
        )  # Relay's C rope kernels rotate whole heads only
        cos, sin = rotary_tables(
            theta, self.rotary_dim, scaling, max_positions, max_position_embeddings or max_positions
        )
        # LongRoPE: row position + long_rows rotates with the long factors (relay.rope); a step's
        # "positions" are table rows, which the model runner offsets for such requests.
        self.long_rows = long_rope_rows(scaling, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables, gathered once per step and shared by every layer."""
        return (
            self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
            self.sin.index_select(0, positions).to(dtype).unsqueeze(1),
        )

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> StepRope:
        if fused:  # Relay's CPU kernel reads the tables at each token's position itself
            return StepRope(positions)
        return StepRope(positions, *self.cos_sin(positions, dtype))


@dataclass
class StepRope:
    """One step's rotary inputs: the positions, and (torch path) each token's gathered tables."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation, bit-identical to x * cos + rotate_half(x) * sin (transformers'), of the
    first cos.shape[-1] features of each head; the rest pass through (partial rotary).
    x: [tokens, heads, head_dim]; cos/signed_sin: [tokens, 1, rotary_dim] from cos_sin()."""
    t, h, d = x.shape
    r = cos.shape[-1]
    if r < d:
        return torch.cat([apply_rotary(x[..., :r], cos, signed_sin), x[..., r:]], dim=-1)
    swapped = x.reshape(t, h, 2, d // 2).flip(2).view(t, h, d)
    return x * cos + swapped * signed_sin
