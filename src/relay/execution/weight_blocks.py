"""Weights that came from GGUF blocks, found again in their float32 values and kept in blocks.

A GGUF checkpoint of Q4_1 (each block of 32 weights w = d * q + m, q in 0..15, d and m float16)
or Q8_0 (w = d * q, q in -127..127) is dequantized into float32 when Relay converts it. Those
floats hold nothing the blocks did not: recovering d, m and q from them and checking that every
weight comes back bit for bit gives the same model in 4.5 or 8.5 bits per weight, which a
decode step's GEMMs, bound by reading weights, run on (csrc/gemm_blocks.c). A weight that is not
exactly such blocks (a dense checkpoint, a tensor-parallel shard that cuts a block) stays float.

The kernels read two quant widths, each with scales per 32 or 16 inputs (`group`) and a per-group
minimum or none (csrc/blocks.h):

    bits 4   w = d * q + m, q 0..15 (nibbles)      Q4_1, Q4_K                         group 32
    bits 8   w = d * q,     q int8                  Q8_0, Q4_0, Q5_0 (32); Q6_K (16)
    bits 8   w = d * q + m, q int8                  Q5_K, Q5_1 (32); fused weights of mixed types

each product d * q and the sum + m rounded to float32 separately, as gguf's dequantizer does; and
an 8-bit form whose quants all lie in -32..31 (Q6_K's, Q5_K's, a fused Q4_K/Q6_K q/k/v's) narrowed
to 6 bits (to_six_bits: u = q + 32 in a 4-bit and a 2-bit plane, csrc/blocks.h), 6.5 bits a weight
instead of 8.5, the same weights and the same GEMM outputs bit for bit. The
types read from the file (gguf_blocks) are decoded into these forms there; a fused weight whose
parts come in different types is lifted to one form (gguf_blocks.common_form) before pack().

Weights whose every part is a k-quant (Q4_K, Q5_K, Q6_K; K whole super-blocks of 256) keep their
scales as the file has them instead of float32 d and m per group (pack_kquant, KSCALES_FLAG): per
strip and super-block a record of the float16 scale D and -Dmin (float16 as in the file) and the
sub-blocks' integer scales and mins (csrc/blocks.h), from which the kernels compute d = D * sc and
m = -Dmin * mn per sub-block (D widened to float32 exactly), the dequantizer's own float32 products:
the same weights and the same outputs bit for bit, from 0.5625-1.125 bits a weight of scales
instead of 2-4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

BLOCK = 32
STRIP = 32  # output features the kernel takes together (csrc/gemm_blocks.c); rows padded with zeros
PROBE_BLOCKS = 64  # blocks tried first: a dense weight fails here, before a full pass
# relay_gemm_blocks's `bits` (BlockWeight.kernel_bits) is 4 or 8 with these flags (csrc/blocks.h)
DOT_FLAG = 0x100  # q in the dot layout (csrc/gemm_dot.c): x rounded to int8, integer sums
MIN_FLAG = 0x200  # bits 8 with a minimum m (bits 4 always has one); without it m is not read
GROUP16_FLAG = 0x400  # d (and m) per 16 inputs, not per 32 (bits 8 only)
UNSIGNED_FLAG = 0x800  # bits 8 quants all in 0..31 (dot: multiplied as unsigned bytes)
KSCALES_FLAG = 0x1000  # d holds k-quant super-block records (csrc/blocks.h KS_FLAG); m is not read
QK_K = 256  # inputs per k-quant super-block: one record per strip and super-block
CHUNK_BLOCKS = 1 << 20  # blocks fitted at a time (each needs ~0.5 KB of float32 scratch)


@dataclass
class BlockWeight:
    """A [N, K] weight as blocks along K (scales per `group` inputs), in the kernel's strips of
    STRIP output features (feature-minor: see csrc/gemm_blocks.c). Built by pack()."""

    bits: int  # 4: d * q + m, q 0..15; 8: d * q (+ m where has_m), q int8; 6: as 8, q = u - 32
    # uint8 [strips, K / 2, STRIP] (inputs 2p, 2p + 1 in the low, high nibble), int8 [strips, K, STRIP],
    # or (bits 6) uint8 [strips, K / 32 * 24, STRIP] (csrc/blocks.h: per block 16 rows of nibble
    # pairs, 8 of high 2 bits); in the dot layout [strips, bytes] (csrc/gemm_dot.c)
    q: torch.Tensor
    # float32 [strips, K / group, STRIP]; with kscales uint8 [strips, K / 256, record bytes], the
    # records of csrc/blocks.h (ks_record_bytes: 640 for Q4_K/Q5_K, 576 for Q6_K)
    d: torch.Tensor
    m: (
        torch.Tensor
    )  # float32 [strips, K / group, STRIP]; [strips, 0, STRIP] where not has_m or kscales
    out_features: int
    in_features: int
    # GEMMs of at most this many rows read the blocks, larger ones the float weight: the
    # crossover the server measures where it runs (layers.blocks_crossover_rows); the default is
    # one measured on a 2-core Xeon in float32 (see layers.py).
    max_rows: int = 128
    # They stand for a bfloat16 model's weights: their GEMMs (Q8_0's of two rows or more) may then
    # round the activations to bfloat16 and use the CPU's bfloat16 dot products
    # (csrc/gemm_blocks.c), as the model's own GEMMs would; the weights stay exact.
    round_bf16: bool = False
    # q is in the integer dot products' layout (csrc/gemm_dot.c): the GEMMs round x to 8 bits per
    # block and sum quant products in integers (--block-activations int8); otherwise q is in strips as above
    # and the GEMMs are float32 (bit for bit the dequantized weights' products).
    dot: bool = False
    group: int = 32  # inputs per d (and m): 32, or 16 (Q6_K's scales; bits 8 only)
    has_m: bool = True  # w = d * q + m (always for bits 4); else w = d * q and m is empty
    q_unsigned: bool = False  # bits 8 quants all in 0..31 (Q5_K, Q5_1): UNSIGNED_FLAG
    kscales: bool = False  # d is k-quant super-block records, not float32 scales: KSCALES_FLAG
    # The blocks' inputs are x's in this order (int64 [K]): a GPTQ act-order weight's, whose
    # groups are scattered over the inputs, gathered so that each block is one group's
    # (quantized_checkpoint); cpu_gemm.gemm_blocks takes x's columns so, and the one-call decode
    # step, which reads x as it is, does not take such a weight. None: x as it is.
    in_perm: torch.Tensor | None = None

    @property
    def kernel_bits(self) -> int:
        """What relay_gemm_blocks takes as `bits` (and the one-call decode step's LayerGemm.bits):
        4 or 8, with MIN_FLAG (bits 8 with m), GROUP16_FLAG, UNSIGNED_FLAG and DOT_FLAG (the dot
        layout) as the form has them. Q4_1's blocks are 4 and Q8_0's 8, as before the flags."""
        flags = MIN_FLAG if self.bits != 4 and self.has_m else 0
        flags |= GROUP16_FLAG if self.group == 16 else 0
        flags |= UNSIGNED_FLAG if self.bits == 8 and self.q_unsigned else 0
        flags |= KSCALES_FLAG if self.kscales else 0
        return self.bits | flags | (DOT_FLAG if self.dot else 0)

    @property
    def bytes_per_weight(self) -> float:
        """What a GEMM reads per weight: quants, d and (where has_m) m, or the records."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m)) / (
            self.q.shape[0] * STRIP * self.in_features
        )

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """d and m as float32 [strips, K / group, STRIP] (m [strips, 0, STRIP] without one): the
        arrays as they are, or computed from the records as the kernels compute them (D * sc,
        -Dmin * mn: float32 products)."""
        if not self.kscales:
            return self.d, self.m
        return _record_scales(self.d, self.group, self.has_m)

    def with_float_scales(self) -> BlockWeight:
        """The same weight with float32 d and m arrays (today's forms; the same outputs bit for bit)."""
        d, m = self.float_scales()
        return replace(self, d=d.contiguous(), m=m.contiguous(), kscales=False)

    def to_six_bits(self) -> BlockWeight:
        """The same 8-bit blocks with their quants (all in -32..31) in 6 bits: u = q + 32 as a
        4-bit and a 2-bit plane (csrc/blocks.h), in this weight's layout. The kernels read them as
        the 8-bit quants, to the same outputs bit for bit."""
        if self.bits != 8:
            raise ValueError(f"only 8-bit quants narrow to 6 bits, not {self.bits}-bit ones")
        q = strips_layout(self.q, 8) if self.dot else self.q
        if q.numel() and (int(q.min()) < -SIX_OFFSET or int(q.max()) >= SIX_OFFSET):
            raise ValueError("quants outside -32..31 do not fit in 6 bits")
        six = _six_strips((q.to(torch.int16) + SIX_OFFSET).to(torch.uint8))
        narrowed = replace(self, bits=6, q=six, q_unsigned=False, dot=False)
        return narrowed.to_dot() if self.dot else narrowed

    def to_eight_bits(self) -> BlockWeight:
        """to_six_bits' inverse: the same weight's quants as int8 (the 8-bit form a benchmark
        compares with), in this weight's layout."""
        if self.bits != 6:
            raise ValueError(f"only 6-bit quants widen to 8 bits, not {self.bits}-bit ones")
        u = _six_values(strips_layout(self.q, 6) if self.dot else self.q)
        q = (u.to(torch.int16) - SIX_OFFSET).to(torch.int8)
        unsigned = bool(q.min() >= 0) and bool(q.max() <= 31)
        wide = replace(self, bits=8, q=q, q_unsigned=unsigned, dot=False)
        return wide.to_dot() if self.dot else wide

    def to_dot(self) -> BlockWeight:
        """The same blocks with q in the integer dot products' layout."""
        if self.dot:
            return self
        return replace(self, q=dot_layout(self.q, self.bits), dot=True)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these blocks stand for, computed as the dequantizer did: d * q, then
        + m where the form has one (two float32 roundings)."""
        n, k = self.out_features, self.in_features
        qs = strips_layout(self.q, self.bits) if self.dot else self.q
        if self.bits == 4:
            q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, k, STRIP).float()
        elif self.bits == 6:
            q = _six_values(qs).float() - SIX_OFFSET
        else:
            q = qs.float()
        d, m = self.float_scales()
        w = d.repeat_interleave(self.group, dim=1) * q
        if self.has_m:
            w = w + m.repeat_interleave(self.group, dim=1)
        w = w.permute(0, 2, 1).reshape(-1, k)[:n]
        if self.in_perm is None:
            return w
        unpermuted = torch.empty_like(w)
        unpermuted[:, self.in_perm] = w  # (block column j holds input in_perm[j])
        return unpermuted


def _nibbles(
    q: torch.Tensor,
) -> torch.Tensor:  # [S, K / 2, STRIP] pairs -> [S, K, STRIP] quants 0..15
    return torch.stack([q & 0x0F, q >> 4], dim=2).reshape(q.shape[0], -1, STRIP)


SIX_OFFSET = 32  # the 6-bit form's u = q + 32


def _six_strips(u: torch.Tensor) -> torch.Tensor:
    """u 0..63 [S, K, STRIP] -> the 6-bit strips layout [S, K / 32 * 24, STRIP] (csrc/blocks.h):
    per block the low nibbles of inputs 2p, 2p + 1 in row p's byte (bits 4's pairs), then row
    16 + r's byte holding inputs 4r + j's high 2 bits at bits 2j."""
    s, k, _ = u.shape
    b = u.reshape(s, k // BLOCK, BLOCK, STRIP)
    low = (b[:, :, 0::2] & 0x0F) | ((b[:, :, 1::2] & 0x0F) << 4)
    hb = (b >> 4).reshape(s, k // BLOCK, 8, 4, STRIP)
    high = hb[:, :, :, 0] | (hb[:, :, :, 1] << 2) | (hb[:, :, :, 2] << 4) | (hb[:, :, :, 3] << 6)
    return torch.cat([low, high], dim=2).reshape(s, -1, STRIP)


def _six_values(q: torch.Tensor) -> torch.Tensor:
    """_six_strips' inverse: u uint8 [S, K, STRIP]."""
    s, nb = q.shape[0], q.shape[1] // 24
    b = q.reshape(s, nb, 24, STRIP)
    low = torch.stack([b[:, :, :16] & 0x0F, b[:, :, :16] >> 4], dim=3)
    high = torch.stack([(b[:, :, 16:] >> (2 * j)) & 3 for j in range(4)], dim=3)
    return (
        low.reshape(s, nb * BLOCK, STRIP) | (high.reshape(s, nb * BLOCK, STRIP) << 4)
    ).contiguous()


def _six_dot(u: torch.Tensor) -> torch.Tensor:
    """u 0..63 [S, K, STRIP] -> the 6-bit dot layout [S, bytes] (csrc/gemm_dot.c): per group of
    8 features and block, bits 4's 4 units of u's low nibbles, then H0 and H1: byte 4f + j of
    H_t holds at bits 4v + 2h the high 2 bits of input 16t + 8v + 4h + j."""
    s, k, _ = u.shape
    nb = k // BLOCK
    pairs = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
    low = dot_layout(pairs, 4).reshape(s, 4, nb, 128)
    # k = 32 b + 16 t + 8 v + 4 h + j, feature 8 g + f -> [s, g, b, t, f, j, v, h]
    hb = (u >> 4).reshape(s, nb, 2, 2, 2, 4, 4, 8).permute(0, 6, 1, 2, 7, 5, 3, 4)
    high = hb[..., 0, 0] | (hb[..., 0, 1] << 2) | (hb[..., 1, 0] << 4) | (hb[..., 1, 1] << 6)
    return torch.cat([low, high.reshape(s, 4, nb, 64)], dim=3).contiguous().reshape(s, -1)


def _six_from_dot(q: torch.Tensor) -> torch.Tensor:
    """_six_dot's inverse: u uint8 [S, K, STRIP]."""
    s = q.shape[0]
    nb = q.shape[1] // (4 * 192)
    t = q.reshape(s, 4, nb, 192)
    low = _nibbles(strips_layout(t[..., :128].reshape(s, -1), 4))
    h = t[..., 128:].reshape(s, 4, nb, 2, 8, 4)  # g, b, t, f, j
    fields = torch.stack([(h >> (2 * i)) & 3 for i in range(4)], dim=-1).reshape(
        s, 4, nb, 2, 8, 4, 2, 2
    )
    high = fields.permute(0, 2, 3, 6, 7, 5, 1, 4).reshape(
        s, nb * BLOCK, STRIP
    )  # b, t, v, h, j, g, f
    return (low | (high << 4)).contiguous()


def dot_layout(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Strips' quants ([S, K / 2, STRIP] 4-bit pairs or [S, K, STRIP] int8) in csrc/gemm_dot.c's
    layout: per strip 4 groups of 8 features, then blocks, then 32-byte units of 8 features x 4 bytes
    (8-bit: unit o holds inputs 4o .. 4o + 3 of the block, so units 0-3 are a group of 16's first
    16 inputs whatever the group: the layout does not depend on it; 6-bit: _six_dot)."""
    s = q.shape[0]
    if bits == 6:
        return _six_dot(_six_values(q))
    if bits == 4:
        k = q.shape[1] * 2
        # k = 32 b + 8 o + 4 h + j, feature 8 g + f; byte = quant(h = 0) | quant(h = 1) << 4
        t = _nibbles(q).reshape(s, k // 32, 4, 2, 4, 4, 8).permute(0, 5, 1, 2, 6, 4, 3)
        return (t[..., 0] | (t[..., 1] << 4)).contiguous().reshape(s, -1)
    k = q.shape[1]
    # k = 32 b + 4 o + j
    return q.reshape(s, k // 32, 8, 4, 4, 8).permute(0, 4, 1, 2, 5, 3).contiguous().reshape(s, -1)


def strips_layout(q: torch.Tensor, bits: int) -> torch.Tensor:
    """dot_layout's inverse."""
    s = q.shape[0]
    if bits == 6:
        return _six_strips(_six_from_dot(q))
    if bits == 4:
        nb = q.shape[1] // (4 * 128)
        t = q.reshape(s, 4, nb, 4, 8, 4)  # g, b, o, f, j
        t = torch.stack([t & 0x0F, t >> 4], dim=-1).permute(0, 2, 3, 6, 5, 1, 4)  # b, o, h, j, g, f
        t = t.reshape(s, nb * 32, STRIP)
        return (t[:, 0::2] | (t[:, 1::2] << 4)).contiguous()
    nb = q.shape[1] // (4 * 256)
    return (
        q.reshape(s, 4, nb, 8, 8, 4)
        .permute(0, 2, 3, 5, 1, 4)
        .contiguous()
        .reshape(s, nb * 32, STRIP)
    )


def recover(weight: torch.Tensor) -> BlockWeight | None:
    """The Q4_1 or Q8_0 blocks a float32 [N, K] weight was dequantized from, or None if it was
    not (checked exactly: every weight must come back bit for bit)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    blocks = weight.detach().reshape(-1, BLOCK)
    for bits, fit in ((4, _fit_q4_1), (8, _fit_q8_0)):
        if fit(blocks[:PROBE_BLOCKS]) is None:
            continue
        parts = []
        for start in range(
            0, blocks.shape[0], CHUNK_BLOCKS
        ):  # bounded scratch for a large vocabulary
            found = fit(blocks[start : start + CHUNK_BLOCKS])
            if found is None:
                break
            d, m, q = found
            parts.append((d, m, q.to(torch.int8)))
        else:
            d, m, q = (torch.cat(t) for t in zip(*parts))
            return pack(bits, d, m, q, weight.shape[0], weight.shape[1])
    return None


def _fp16_neighbours(x: torch.Tensor) -> list[torch.Tensor]:
    """x rounded to float16 and the float16 values on either side, as float32 (non-negative x)."""
    h = x.to(torch.float16)
    bits = h.view(torch.int16)
    below = torch.where(bits > 0, bits - 1, bits).view(torch.float16)
    above = (bits + 1).view(torch.float16)
    return [t.float() for t in (h, below, above)]


def _choose(
    candidates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """candidates: (ok [B], d [B], q [B, 32]); per block the first ok one, or None if a block has none."""
    ok_any = torch.zeros_like(candidates[0][0])
    d = torch.zeros_like(candidates[0][1])
    q = torch.zeros_like(candidates[0][2])
    for ok, dc, qc in candidates:
        take = ok & ~ok_any
        d = torch.where(take, dc, d)
        q = torch.where(take[:, None], qc, q)
        ok_any |= ok
    return (d, q) if bool(ok_any.all()) else None


def _fit_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d, m, q) with blocks == d * q + m exactly (two roundings, as the dequantizer), or None."""
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    if not torch.equal(
        lo.to(torch.float16).float(), lo
    ):  # m is a float16, and the minimum has q = 0
        return None
    candidates = []
    for d in _fp16_neighbours((hi - lo) / 15):
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((blocks - lo[:, None]) / safe[:, None]).clamp_(0, 15)
        ok = ((d[:, None] * q + lo[:, None]) == blocks).all(-1)
        candidates.append((ok, d, q))
    chosen = _choose(candidates)
    return None if chosen is None else (chosen[0], lo, chosen[1])


def _fit_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d, zeros, q) with blocks == d * q exactly, or None."""
    amax = blocks.abs().amax(-1)
    candidates = []
    for d in _fp16_neighbours(amax / 127):
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127)
        ok = ((d[:, None] * q) == blocks).all(-1)
        candidates.append((ok, d, q))
    chosen = _choose(candidates)
    return None if chosen is None else (chosen[0], torch.zeros_like(amax), chosen[1])


def pack(
    bits: int,
    d: torch.Tensor | np.ndarray,
    m: torch.Tensor | np.ndarray | None,
    q: torch.Tensor | np.ndarray,
    n: int,
    k: int,
    group: int = 32,
    has_m: bool | None = None,
) -> BlockWeight:
    """A [n, k] weight's blocks in the kernels' strips: w = d * q (+ m), d and m per `group` inputs.

    bits: 4 (q 0..15) or 8 (q int8 values: -128..127, or 0..31 for 5-bit quants); group: 32, or 16
    (bits 8 only); d, m: [n, k / group] float32 (or flat, row-major); q: [n, k] (or flat); torch
    tensors or numpy arrays (gguf_blocks.RowBlocks' fields as they are). m may be None or all
    zeros where the form has no minimum: bits 8 blocks then keep none (has_m False; their GEMMs
    skip it; -0.0 or 0.0 would add nothing: x + -0.0 is x, and only a -0.0 weight reads as 0.0
    after + 0.0); has_m True keeps m whatever its values (rows of a weight packed a part at a
    time: gguf_weights.read_blocks). The blocks are not checked here: callers compare dequantize() with the weight."""
    if bits not in (4, 8) or group not in (16, 32) or (bits == 4 and group != 32) or k % BLOCK:
        raise ValueError(f"no kernel form for bits={bits} group={group} k={k}")
    d, q = torch.as_tensor(d), torch.as_tensor(q)
    m = None if m is None else torch.as_tensor(m)
    strips = -(-n // STRIP)
    pad = strips * STRIP - n
    ngrp = k // group
    if has_m is None:
        has_m = bits == 4 or (m is not None and bool((m != 0).any()))
    if bits == 4 and m is None:
        m = torch.zeros(n, ngrp)

    def strip_minor(
        t: torch.Tensor, cols: int
    ) -> torch.Tensor:  # [n, cols] -> [strips, cols, STRIP]
        t = torch.cat([t.reshape(n, cols), t.new_zeros(pad, cols)])
        return t.reshape(strips, STRIP, cols).transpose(1, 2).contiguous()

    q_unsigned = False
    if bits == 4:
        qi = q.reshape(n, k).to(torch.uint8)
        data = qi[:, 0::2] | (qi[:, 1::2] << 4)
        data = strip_minor(data, k // 2)
    else:
        data = strip_minor(q.reshape(n, k).to(torch.int8), k)
        q_unsigned = n > 0 and bool(data.min() >= 0) and bool(data.max() <= 31)
    return BlockWeight(
        bits=bits,
        q=data,
        d=strip_minor(d.float(), ngrp),
        m=strip_minor(m.float(), ngrp) if has_m else torch.zeros(strips, 0, STRIP),
        out_features=n,
        in_features=k,
        group=group,
        has_m=has_m,
        q_unsigned=q_unsigned,
    )


def record_bytes(group: int, has_m: bool) -> int:
    """A KSCALES_FLAG record's bytes (csrc/blocks.h ks_record_bytes)."""
    return (2 if has_m else 1) * (2 * STRIP + QK_K // group * STRIP)


def _record_scales(rec: torch.Tensor, group: int, has_m: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Records [strips, K / 256, bytes] -> d, m float32 [strips, K / group, STRIP] (csrc/blocks.h)."""
    s, nsb, _ = rec.shape
    subs = QK_K // group

    def floats(at: int) -> torch.Tensor:  # [s, nsb, 1, STRIP]: the float16 D (-Dmin) as float32
        return rec[..., at : at + 2 * STRIP].contiguous().view(torch.float16).float()[:, :, None]

    def ints(at: int) -> torch.Tensor:  # [s, nsb, subs, STRIP] as float32
        return (
            rec[..., at : at + subs * STRIP]
            .contiguous()
            .view(torch.int8)
            .reshape(s, nsb, subs, STRIP)
            .float()
        )

    sc_at = 4 * STRIP if has_m else 2 * STRIP
    d = (floats(0) * ints(sc_at)).reshape(s, nsb * subs, STRIP)
    if not has_m:
        return d, torch.zeros(s, 0, STRIP)
    m = (floats(2 * STRIP) * ints(sc_at + subs * STRIP)).reshape(s, nsb * subs, STRIP)
    return d, m


def _exact_half(t: torch.Tensor, name: str) -> torch.Tensor:
    """float32 t as float16, which must hold every value exactly (signs of zero included): a
    record's D and -Dmin are the file's float16 values."""
    h = t.half()
    if not torch.equal(h.float().view(torch.int32), t.view(torch.int32)):
        bad = t[h.float().view(torch.int32) != t.view(torch.int32)][0].item()
        raise ValueError(f"super-block {name} {bad!r} is not a float16 value (a k-quant's are)")
    return h


def pack_kquant(
    bits: int,
    super_d: torch.Tensor | np.ndarray,
    super_dmin: torch.Tensor | np.ndarray | None,
    sub_scales: torch.Tensor | np.ndarray,
    sub_mins: torch.Tensor | np.ndarray | None,
    q: torch.Tensor | np.ndarray,
    n: int,
    k: int,
    group: int = 32,
    has_m: bool | None = None,
) -> BlockWeight:
    """A [n, k] weight of k-quant super-blocks in the compact form (KSCALES_FLAG): per group
    d = super_d * sub_scales and m = -(super_dmin * sub_mins), float32 products, exactly what
    pack() would hold as float32 arrays (gguf_blocks' decoders compute them so).

    super_d, super_dmin: float32 [n, k / 256] (the float16 D, Dmin as float32: the records hold them
    as float16, and a value float16 cannot hold exactly is refused with a ValueError); sub_scales,
    sub_mins: integers in int8 range [n, k / group] (Q4_K/Q5_K 0..63, Q6_K -128..127); q as pack()
    takes it. super_dmin / sub_mins None (Q6_K): no minimum, or, where has_m, m = -0.0 (Dmin 0,
    mn 0: the -0.0 common_form gives a part without one). has_m: default bits 4 or sub_mins given.
    k: a multiple of 256."""
    if k % QK_K:
        raise ValueError(f"no compact k-quant form for k={k} (not whole super-blocks of {QK_K})")
    if has_m is None:
        has_m = bits == 4 or sub_mins is not None
    if bits == 4 and not has_m:
        raise ValueError("bits 4 always has a minimum")
    nsb, ngrp = k // QK_K, k // group
    f16 = [torch.as_tensor(super_d).float().reshape(n, nsb)]
    i8 = [torch.as_tensor(sub_scales).reshape(n, ngrp).to(torch.int8)]
    if has_m:
        dmin = torch.zeros(n, nsb) if super_dmin is None else torch.as_tensor(super_dmin).float()
        f16.append(-dmin.reshape(n, nsb))
        mins = torch.zeros(n, ngrp) if sub_mins is None else torch.as_tensor(sub_mins)
        i8.append(mins.reshape(n, ngrp).to(torch.int8))
    # today's form for the quants (d and m there are placeholders, replaced by the records)
    blocks = pack(
        bits, torch.zeros(n, ngrp), None, q, n, k, group, has_m=False if bits == 8 else None
    )
    strips = blocks.q.shape[0]
    pad = strips * STRIP - n

    def strip_minor(
        t: torch.Tensor, per: int
    ) -> torch.Tensor:  # [n, nsb * per] -> [s, nsb, per * STRIP bytes]
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
        t = t.reshape(strips, STRIP, nsb, per).permute(0, 2, 3, 1).contiguous()
        return t.view(torch.uint8).reshape(strips, nsb, -1)

    parts = [strip_minor(_exact_half(t, name), 1) for t, name in zip(f16, ("D", "-Dmin"))]
    parts += [strip_minor(t, ngrp // nsb) for t in i8]
    rec = torch.cat(parts, dim=2).contiguous()
    assert rec.shape[2] == record_bytes(group, has_m)
    return replace(
        blocks,
        d=rec,
        m=torch.zeros(strips, 0, STRIP),
        has_m=has_m,
        kscales=True,
    )
