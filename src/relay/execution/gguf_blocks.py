"""A GGUF checkpoint's blocks read from the file itself, for the float32 weights converted from it.

weight_blocks.recover finds Q4_1 and Q8_0 blocks again from their float values alone. The other
common types cannot be found that way: a Q4_K sub-block's scale and minimum are float32 products
(a float16 super-block scale times a 6-bit integer), and its extreme quants need not occur; Q4_0
and Q5_0 scales are the largest weight over 8 and 16. Their raw blocks are in the GGUF file, and
each block of these types is exactly one of the forms Relay's block GEMMs read (csrc/blocks.h,
gemm_blocks.c, gemm_dot.c), with the dequantizer's roundings (gguf.quants):

    Q8_0, Q4_0, Q5_0   w = d * q,      q = quant - 0 / 8 / 16 in int8, per 32   -> bits 8
    Q6_K               w = d * q,      q = quant - 32 in int8, per 16            -> bits 8, group 16
                       (d = the float16 super-block scale times an int8 one: exact in float32)
    Q5_1, Q5_K         w = d * q + m,  q 0..31 in int8, per 32 (Q5_K: m = -min)  -> bits 8 with m
    Q4_1, Q4_K         w = d * q + m,  q in 0..15, per 32 (Q4_K: d = scale, m = -min) -> bits 4

The other k- and i-quants are none of these: those weights stay float. Conversion reorders rows
(Llama's q/k rotary permutation) and Relay fuses q/k/v and gate/up, so a weight's rows are found
among the file's by a hash of their float32 values; rows from tensors of different types (a Q4_K_M
file's Q4_K q and k beside a Q6_K v) are lifted to one form (common_form), and the blocks built
from them are checked bit for bit against the weight (BlockWeight.dequantize) before any GEMM
reads them.

What a loader needs, for a GGUF tensor's rows (raw [rows, bytes per row]) of any of these types:

    parts = [decode_rows(raw, qtype, k) for raw, qtype in tensors]   # RowBlocks per tensor
    rows = common_form(parts)                                        # one form, rows concatenated
    blocks = pack_rows(rows, n, k)   # k-quants: compact scales (pack_kquant); else pack(...)

An 8-bit form whose quants all lie in -32..31 (every type here but Q8_0: SIX_BIT_TYPES) with scales
per 16 or a minimum is narrowed to 6 bits where it is packed (pack_rows' six_bits:
BlockWeight.to_six_bits): Q6_K as 6.5625 bits a weight with compact scales, as the file has it,
not 8.5625. Q4_0's and Q5_0's (per 32, no minimum) stay 8-bit: a bfloat16 model's GEMMs of them round x
to bfloat16 (csrc/gemm_blocks.c), which the 6-bit form does not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from relay.execution.weight_blocks import BLOCK, BlockWeight, pack, pack_kquant

QK_K = 256  # weights per k-quant super-block


@dataclass
class RowBlocks:
    """Rows of a weight in one kernel form (weight_blocks.pack takes its fields as they are):
    w = d * q + m per weight, each product and sum rounded to float32 as the dequantizer does.

    bits: 4 (q 0..15, uint8) or 8 (q int8); q [rows, K]; d, m float32 [rows, K / group]; m is -0.0
    where the type has no minimum (x + -0.0 is x exactly, a -0.0 weight included); group: 32, or 16
    (Q6_K's scales; bits 8 only).

    k-quants (Q4_K, Q5_K, Q6_K) also carry the integers d and m were computed from (None for
    other types): super_d [rows, K / 256] the super-block's float16 scale as float32, sub_scales
    [rows, K / group] int8 (Q4_K/Q5_K's 6-bit 0..63, Q6_K's int8) with d = super_d * sub_scales;
    where the type has mins, super_dmin [rows, K / 256] and sub_mins [rows, K / group] int8 (0..63)
    with m = -(super_dmin * sub_mins): weight_blocks.pack_kquant's compact form (pack_rows)."""

    bits: int
    d: np.ndarray
    m: np.ndarray
    q: np.ndarray
    group: int = BLOCK
    super_d: np.ndarray | None = None
    super_dmin: np.ndarray | None = None
    sub_scales: np.ndarray | None = None
    sub_mins: np.ndarray | None = None

    @property
    def kquant(self) -> bool:
        """Whether the rows carry k-quant integer scales (the compact form takes them)."""
        return self.super_d is not None

    def take(self, rows: np.ndarray | slice) -> RowBlocks:
        """These rows (an index array or a slice), every field alike."""
        pick = [None if t is None else t[rows] for t in self._ints()]
        return RowBlocks(self.bits, self.d[rows], self.m[rows], self.q[rows], self.group, *pick)

    def columns(self, cols: slice) -> RowBlocks | None:
        """Columns cols (whole groups) of every row, or None where cols cuts a group; the integer
        scales kept where cols is whole super-blocks, dropped (the float32 form) where not."""
        g = self.group
        if cols.start % g or cols.stop % g:
            return None
        gs = slice(cols.start // g, cols.stop // g)
        ints: list[np.ndarray | None] = [None] * 4
        if self.kquant and cols.start % QK_K == 0 and cols.stop % QK_K == 0:
            ss = slice(cols.start // QK_K, cols.stop // QK_K)
            ints = [
                None if t is None else t[:, ss if i < 2 else gs] for i, t in enumerate(self._ints())
            ]
        return RowBlocks(self.bits, self.d[:, gs], self.m[:, gs], self.q[:, cols], g, *ints)

    def without_kquant(self) -> RowBlocks:
        return RowBlocks(self.bits, self.d, self.m, self.q, self.group)

    def _ints(self) -> list[np.ndarray | None]:
        return [self.super_d, self.super_dmin, self.sub_scales, self.sub_mins]


def _f16(raw: np.ndarray) -> np.ndarray:  # [..., 2] bytes -> float32 [...]
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] bytes -> [n, 32]: low nibbles, then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> RowBlocks:
    return _eight(_f16(b[:, :2]), b[:, 2:].view(np.int8))


def _q4_0(b: np.ndarray) -> RowBlocks:
    return _eight(_f16(b[:, :2]), _nibbles(b[:, 2:]).astype(np.int8) - 8)


def _q5_0(b: np.ndarray) -> RowBlocks:
    high = np.unpackbits(
        b[:, 2:6], axis=-1, bitorder="little"
    )  # bit j of the uint32: quant j's 5th
    return _eight(_f16(b[:, :2]), (_nibbles(b[:, 6:]) | (high << 4)).astype(np.int8) - 16)


def _eight(d: np.ndarray, q: np.ndarray, group: int = BLOCK) -> RowBlocks:
    return RowBlocks(8, d, np.full_like(d, -0.0), q.astype(np.int8), group)


def _q5_1(b: np.ndarray) -> RowBlocks:
    """float16 d and m, 32 fifth bits (a little-endian uint32), then Q4_1's nibbles."""
    high = np.unpackbits(b[:, 4:8], axis=-1, bitorder="little")
    q = (_nibbles(b[:, 8:]) | (high << 4)).astype(np.int8)
    return RowBlocks(8, _f16(b[:, :2]), _f16(b[:, 2:4]), q)


def _q6_k(b: np.ndarray) -> RowBlocks:
    """Super-blocks of 256 in 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8
    scales, float16 d. Half h (128 weights) takes ql[64h .. 64h + 63] (low nibbles: its weights
    0-63, high nibbles 64-127) and qh[32h .. 32h + 31] (bits 2s, 2s + 1: its weights 32s + j);
    weight i's scale is d * scales[i / 16], an exact float32 product (11 x 8 significant bits)."""
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [n, h, shift, 64]
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03  # [n, h, s, 32]
    q = (low.reshape(n, 256) | (high.reshape(n, 256) << 4)).astype(np.int8) - 32
    found = _eight(d[:, None] * scales, q.reshape(n * 16, 16), group=16)
    found.super_d, found.sub_scales = d, b[:, 192:208].view(np.int8)
    return found


def _q5_k(b: np.ndarray) -> RowBlocks:
    """Super-blocks of 256 in 176 bytes: float16 d and dmin, Q4_K's 12 bytes of 6-bit scales and
    mins, qh[32] (bit s of byte j: sub-block s's weight j's fifth bit), then Q4_K's nibbles."""
    n = b.shape[0]
    scale, low, ints = _k_scales(b)
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return RowBlocks(
        8, scale, low, (q | (high << 4)).astype(np.int8).reshape(n * 8, 32), BLOCK, *ints
    )


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A Q4_K or Q5_K super-block's 8 sub-block scales d * sc and -(dmin * mn): float16 d and dmin,
    then 8 6-bit scales and mins packed in 12 bytes (gguf.quants.Q4_K.get_scale_min); and the
    integers they come from, RowBlocks' [super_d, super_dmin, sub_scales, sub_mins]."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scale = d[:, None] * sc.astype(np.float32)  # exact: 11 x 6 significant bits
    ints = [d, dmin, sc.astype(np.int8), mn.astype(np.int8)]
    return scale, -(dmin[:, None] * mn.astype(np.float32)), ints


def _q4_1(b: np.ndarray) -> RowBlocks:
    return RowBlocks(4, _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:]))


def _q4_k(b: np.ndarray) -> RowBlocks:
    """Super-blocks of 256: float16 d and dmin, 8 6-bit scales and mins packed in 12 bytes, then
    4 groups of 32 bytes whose low nibbles are sub-block 2g and high nibbles 2g + 1."""
    n = b.shape[0]
    scale, low, ints = _k_scales(b)
    qs = b[:, 16:].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    return RowBlocks(4, scale, low, q.reshape(n * 8, 32), BLOCK, *ints)


# The types whose decoded quants all lie in -32..31 (Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K: all
# but Q8_0), which the 6-bit form holds
SIX_BIT_TYPES = frozenset((2, 6, 3, 7, 12, 13, 14))


def six_bit_form(qtypes: list[int], bits: int, group: int, has_m: bool) -> bool:
    """Whether a weight of these parts' types, lifted to (bits, group, has_m), is packed in 6 bits:
    8-bit quants of types that fit, with scales per 16 or a minimum (see the module's docstring)."""
    return bits == 8 and (group == 16 or has_m) and all(t in SIX_BIT_TYPES for t in qtypes)


# type id (gguf.GGMLQuantizationType) -> (weights per block, bytes per block, decoder of blocks)
DECODERS = {
    8: (32, 34, _q8_0),  # Q8_0
    2: (32, 18, _q4_0),  # Q4_0
    6: (32, 22, _q5_0),  # Q5_0
    3: (32, 20, _q4_1),  # Q4_1
    7: (32, 24, _q5_1),  # Q5_1
    12: (QK_K, 144, _q4_k),  # Q4_K
    13: (QK_K, 176, _q5_k),  # Q5_K
    14: (QK_K, 210, _q6_k),  # Q6_K
}


def decode_rows(raw: np.ndarray, qtype: int, k: int) -> RowBlocks:
    """Rows of a GGUF tensor in their kernel form (stable: loaders call it, then common_form, then
    weight_blocks.pack). raw: uint8 [rows, bytes per row] (a memmap slice will do), qtype: a
    DECODERS key (gguf.GGMLQuantizationType's value), k: weights per row (a multiple of the type's
    block). Returns RowBlocks with q [rows, k], d and m [rows, k / group] (and a k-quant's
    integer scales: super_d, super_dmin [rows, k / 256], sub_scales, sub_mins [rows, k / group])."""
    per, size, decode = DECODERS[qtype]
    rows = raw.shape[0]
    found = decode(np.ascontiguousarray(raw).reshape(rows * (k // per), size))
    ng = k // found.group

    def shaped(t: np.ndarray | None, cols: int) -> np.ndarray | None:
        return None if t is None else np.ascontiguousarray(t).reshape(rows, cols)

    return RowBlocks(
        found.bits,
        found.d.reshape(rows, ng),
        found.m.reshape(rows, ng),
        found.q.reshape(rows, k),
        found.group,
        shaped(found.super_d, k // QK_K),
        shaped(found.super_dmin, k // QK_K),
        shaped(found.sub_scales, ng),
        shaped(found.sub_mins, ng),
    )


def common_form(parts: list[RowBlocks], form: tuple[int, int] | None = None) -> RowBlocks:
    """Row blocks of several tensors (a fused q/k/v or gate/up: Q4_K beside Q6_K, Q5_K beside Q8_0,
    ...) as one weight: each part lifted exactly to a form that holds them all, then concatenated
    along rows in the order given (stable: see decode_rows). All 4-bit: the 4-bit form; else 8-bit,
    4-bit quants (0..15) becoming int8 ones. Any part with scales per 16 (Q6_K): every part's d and
    m repeated to 16 (the same scale on both halves). m stays -0.0 where a part has none. The
    weights are the parts' own bit for bit: only the arrays holding them grow. form: at least
    these (bits, group), for parts that are some of a weight's rows (its other rows need them).

    Where every part is a k-quant (Q4_K, Q5_K, Q6_K, of one type or several) the integer scales
    come along, lifted the same way (sub-block scales and mins repeated to 16; a part without mins,
    Q6_K beside Q4_K, gets Dmin 0 and mins 0: m = -(0 * 0) = -0.0, its m here), so that the rows
    pack into the compact form (pack_rows); a part of any other type (Q8_0 beside Q4_K, ...) drops
    them: the weight then keeps float32 d and m, today's form."""
    if not parts:
        raise ValueError("common_form of no rows")
    if len({p.q.shape[1] for p in parts}) != 1:
        raise ValueError("common_form: parts of different row lengths")
    bits = 4 if all(p.bits == 4 for p in parts) else 8
    group = min(p.group for p in parts)
    if form is not None:  # (bits, group) of a weight these parts are some of the rows of
        bits, group = max(bits, form[0]), min(group, form[1])

    def spread(t: np.ndarray, p: RowBlocks) -> np.ndarray:
        return np.repeat(t, p.group // group, axis=1) if p.group != group else t

    q = [p.q.astype(np.uint8 if bits == 4 else np.int8, copy=False) for p in parts]
    ints: list[np.ndarray | None] = [None] * 4
    if all(p.kquant for p in parts):
        mins = any(p.sub_mins is not None for p in parts)
        ints[0] = np.concatenate([p.super_d for p in parts]).astype(np.float32, copy=False)
        ints[2] = np.concatenate([spread(p.sub_scales, p) for p in parts]).astype(
            np.int8, copy=False
        )
        if mins:
            ints[1] = np.concatenate(
                [np.zeros_like(p.super_d) if p.super_dmin is None else p.super_dmin for p in parts]
            ).astype(np.float32, copy=False)
            ints[3] = np.concatenate(
                [
                    np.zeros((len(p.q), p.q.shape[1] // group), np.int8)
                    if p.sub_mins is None
                    else spread(p.sub_mins, p)
                    for p in parts
                ]
            ).astype(np.int8, copy=False)
    return RowBlocks(
        bits,
        np.concatenate([spread(p.d, p) for p in parts]).astype(np.float32, copy=False),
        np.concatenate([spread(p.m, p) for p in parts]).astype(np.float32, copy=False),
        np.concatenate(q),
        group,
        *ints,
    )


def pack_rows(
    rows: RowBlocks,
    n: int,
    k: int,
    has_m: bool | None = None,
    compact: bool = True,
    six_bits: bool | None = False,
) -> BlockWeight:
    """Rows in one form (common_form's) packed for the kernels: the compact k-quant form
    (weight_blocks.pack_kquant) where the rows carry integer scales and k is whole super-blocks,
    else float32 d and m (weight_blocks.pack); the same weights and outputs either way. has_m as
    pack() takes it (None: the compact form has m where the rows have mins or are 4-bit).
    six_bits: the 8-bit quants narrowed to 6 bits (BlockWeight.to_six_bits; a ValueError where
    they do not fit); None: where they fit and the form has scales per 16 or a minimum (a loader
    that packs a weight in chunks decides from its types instead: six_bit_form)."""
    blocks = _pack_rows(rows, n, k, has_m, compact)
    if six_bits is None:
        fits = rows.bits == 8 and (
            rows.q.size == 0 or -32 <= int(rows.q.min()) <= int(rows.q.max()) < 32
        )
        six_bits = fits and (blocks.group == 16 or blocks.has_m)
    return blocks.to_six_bits() if six_bits else blocks


def _pack_rows(rows: RowBlocks, n: int, k: int, has_m: bool | None, compact: bool) -> BlockWeight:
    if compact and rows.kquant and k % QK_K == 0:
        return pack_kquant(
            rows.bits,
            rows.super_d,
            rows.super_dmin,
            rows.sub_scales,
            rows.sub_mins,
            rows.q,
            n,
            k,
            rows.group,
            has_m,
        )
    return pack(rows.bits, rows.d, rows.m, rows.q, n, k, group=rows.group, has_m=has_m)


def _map(path: str, table: np.ndarray) -> list[SourceTensor]:
    """The tensors of table's rows (data offset, type, rows, weights per row) mapped from the file."""
    tensors = []
    for offset, qtype, rows, k in table.tolist():
        per, size, _ = DECODERS[qtype]
        raw = np.memmap(path, np.uint8, "r", offset=offset, shape=(rows, k // per * size))
        tensors.append(SourceTensor(raw, qtype, k))
    return tensors


def _edges(t: SourceTensor) -> np.ndarray:
    """Each row's first and last 32 weights, dequantized as gguf.quants does: what rows are found
    by (a whole row's values would cost 20x more, and a false match fails the final check)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    per, size, _ = DECODERS[t.qtype]
    qtype = GGMLQuantizationType(t.qtype)
    first = dequantize(np.ascontiguousarray(t.raw[:, :size]), qtype)[:, :BLOCK]
    last = dequantize(np.ascontiguousarray(t.raw[:, -size:]), qtype)[:, -BLOCK:]
    return np.concatenate([first, last], axis=1)


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each float32 row's bits (rows [R, K]): equal rows, equal hashes."""
    words = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
    mult = np.random.default_rng(len(rows[0])).integers(1, 2**63, rows.shape[1], dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (words * (mult | np.uint64(1))).sum(axis=1, dtype=np.uint64)
        return h ^ (h >> np.uint64(29))


@dataclass
class SourceTensor:
    raw: np.ndarray  # [rows, bytes per row], a view of the file
    qtype: int
    k: int  # weights per row


INDEX_FILE = "gguf_rows.npz"  # beside a converted checkpoint (model_files.convert_gguf)
_QTYPES = np.array(sorted(DECODERS), dtype=np.int64)  # the types an index lists the tensors of


class GgufRows:
    """The decodable tensors of a GGUF file, each row findable by a hash of its float32 values.

    Finding them reads the whole tensor table (gguf's reader parses every metadata string: 15 s
    for a 262,144-token vocabulary) and dequantizes two blocks of every row, so it is done once,
    when the file is converted, and saved beside the checkpoint as an index (INDEX_FILE: ~16
    bytes per row); a start maps the file's tensors from the offsets in it."""

    def __init__(self, tensors: list[SourceTensor], hashes: np.ndarray, owners: np.ndarray):
        self.tensors, self.hashes, self.owners = tensors, hashes, owners

    @classmethod
    def build(cls, path: str) -> tuple[GgufRows, dict[str, np.ndarray]]:
        """The rows of the GGUF file at path, and the index that load() takes."""
        from relay.execution.gguf_header import read_header

        table = []  # (data offset, qtype, rows, weights per row)
        for t in read_header(path).tensors.values():
            qtype, k = t.qtype, t.shape[-1]
            if qtype in DECODERS and len(t.shape) == 2 and k % DECODERS[qtype][0] == 0:
                table.append((t.offset, qtype, t.shape[0], k))
        table = np.array(table, dtype=np.int64).reshape(-1, 4)
        rows = cls.of(_map(path, table))
        index = dict(table=table, hashes=rows.hashes, owners=rows.owners, qtypes=_QTYPES)
        return rows, index | dict(size=np.array(os.path.getsize(path)))

    @staticmethod
    def index_is_current(index: dict[str, np.ndarray]) -> bool:
        """Whether a saved index covers every type DECODERS reads now (an index written before Q6_K,
        Q5_K and Q5_1 were decoded lists none of their tensors: rebuilt, those weights become
        blocks too)."""
        return "qtypes" in index and np.array_equal(index["qtypes"], _QTYPES)

    @classmethod
    def of(cls, tensors: list[SourceTensor]) -> GgufRows:
        """These tensors' rows, hashed."""
        hashes = [row_hashes(_edges(t)) for t in tensors] or [np.zeros(0, np.uint64)]
        owners = [
            np.stack([np.full(len(t.raw), i), np.arange(len(t.raw))], 1)
            for i, t in enumerate(tensors)
        ]
        order = np.argsort(np.concatenate(hashes), kind="stable")
        owners = np.concatenate(owners or [np.zeros((0, 2), np.int64)])
        return cls(tensors, np.concatenate(hashes)[order], owners[order])

    @classmethod
    def load(cls, path: str, index: dict[str, np.ndarray]) -> GgufRows | None:
        """The rows of the GGUF file at path through its saved index; None if the file is gone
        or is not the one indexed."""
        if not os.path.exists(path) or os.path.getsize(path) != int(index["size"]):
            return None
        return cls(_map(path, index["table"]), index["hashes"], index["owners"])

    def blocks_for(self, weight: torch.Tensor) -> BlockWeight | None:
        """weight's blocks, if every row of it is a row of one of the file's tensors (of one type
        or several: common_form); checked bit for bit."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
            return None
        w = weight.detach().numpy()
        found = self._owners(row_hashes(np.concatenate([w[:, :BLOCK], w[:, -BLOCK:]], axis=1)))
        if found is None:
            return None
        rows = self._decode(found, w.shape[1])
        if rows is None:
            return None
        blocks = pack_rows(rows, *w.shape, six_bits=None)
        return blocks if torch.equal(blocks.dequantize(), weight) else None

    def _owners(self, hashes: np.ndarray) -> np.ndarray | None:
        if len(self.hashes) == 0:
            return None
        at = np.searchsorted(self.hashes, hashes).clip(max=len(self.hashes) - 1)
        if not np.array_equal(self.hashes[at], hashes):
            return None
        return self.owners[at]

    def _decode(self, owners: np.ndarray, k: int) -> RowBlocks | None:
        """The weight's rows (in its order) from their owners' raw rows, in one form, or None."""
        parts, order = [], []
        for i in np.unique(owners[:, 0]):
            t = self.tensors[i]
            if t.k != k:
                return None
            mine = np.flatnonzero(owners[:, 0] == i)
            parts.append(decode_rows(t.raw[owners[mine, 1]], t.qtype, k))
            order.append(mine)
        rows = common_form(parts)
        back = np.argsort(np.concatenate(order))  # the parts' rows back to the weight's order
        return rows.take(back)
