"""A GGUF checkpoint's blocks read from the file itself, for the float32 weights converted from it.

weight_blocks.recover finds Q4_1 and Q8_0 blocks again from their float values alone. The other
common types cannot be found that way: a Q4_K sub-block's scale and minimum are float32 products
(a float16 super-block scale times a 6-bit integer), and its extreme quants need not occur; Q4_0
and Q5_0 scales are the largest weight over 8 and 16. Their raw blocks are in the GGUF file, and
each 32-weight block of these types is exactly one of the two forms Relay's block GEMMs read
(csrc/gemm_blocks.c, gemm_dot.c), with the dequantizer's roundings (gguf.quants):

    Q8_0, Q4_0, Q5_0   w = d * q,      q = quant - 0 / 8 / 16 in int8        -> the 8-bit form
    Q4_1, Q4_K         w = d * q + m,  q in 0..15 (Q4_K: d = scale, m = -min) -> the 4-bit form

Q5_1 and Q5_K (5-bit quants with a minimum), Q6_K (a scale per 16 weights) and the other k- and
i-quants are neither: those weights stay float. Conversion reorders rows (Llama's q/k rotary
permutation) and Relay fuses q/k/v and gate/up, so a weight's rows are found among the file's by a
hash of their float32 values, and the blocks built from them are checked bit for bit against the
weight (BlockWeight.dequantize) before any GEMM reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from relay.execution.weight_blocks import BLOCK, BlockWeight, pack

QK_K = 256  # weights per k-quant super-block


@dataclass
class RowBlocks:
    """Rows of a weight in one of the two forms: q [rows, K] (int8 or 0..15), d and m [rows, K / 32]."""

    bits: int
    d: np.ndarray
    m: np.ndarray
    q: np.ndarray


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


def _eight(d: np.ndarray, q: np.ndarray) -> RowBlocks:
    return RowBlocks(8, d, np.zeros_like(d), q.astype(np.int8))


def _q4_1(b: np.ndarray) -> RowBlocks:
    return RowBlocks(4, _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:]))


def _q4_k(b: np.ndarray) -> RowBlocks:
    """Super-blocks of 256: float16 d and dmin, 8 6-bit scales and mins packed in 12 bytes, then
    4 groups of 32 bytes whose low nibbles are sub-block 2g and high nibbles 2g + 1."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = b[:, 16:].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    scale = d[:, None] * sc.astype(np.float32)  # exact: 11 x 6 significant bits
    low = -(dmin[:, None] * mn.astype(np.float32))
    return RowBlocks(4, scale, low, q.reshape(n * 8, 32))


# type id (gguf.GGMLQuantizationType) -> (weights per block, bytes per block, decoder of blocks)
DECODERS = {
    8: (32, 34, _q8_0),  # Q8_0
    2: (32, 18, _q4_0),  # Q4_0
    6: (32, 22, _q5_0),  # Q5_0
    3: (32, 20, _q4_1),  # Q4_1
    12: (QK_K, 144, _q4_k),  # Q4_K
}


def decode_rows(raw: np.ndarray, qtype: int, k: int) -> RowBlocks:
    """Rows of a GGUF tensor (raw [rows, bytes per row]) in their form, per 32 weights."""
    per, size, decode = DECODERS[qtype]
    rows = raw.shape[0]
    found = decode(np.ascontiguousarray(raw).reshape(rows * (k // per), size))
    return RowBlocks(
        found.bits,
        found.d.reshape(rows, k // BLOCK),
        found.m.reshape(rows, k // BLOCK),
        found.q.reshape(rows, k),
    )


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
        from gguf import GGUFReader

        table = []  # (data offset, qtype, rows, weights per row)
        for t in GGUFReader(path).tensors:
            qtype, k = int(t.tensor_type), int(t.shape[0])  # GGUF lists the row length first
            if qtype in DECODERS and len(t.shape) == 2 and k % DECODERS[qtype][0] == 0:
                table.append((int(t.data_offset), qtype, int(t.shape[1]), k))
        table = np.array(table, dtype=np.int64).reshape(-1, 4)
        rows = cls.of(_map(path, table))
        index = dict(table=table, hashes=rows.hashes, owners=rows.owners)
        return rows, index | dict(size=np.array(os.path.getsize(path)))

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
        """weight's blocks, if every row of it is a row of one of the file's tensors and those
        rows share a form; checked bit for bit."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
            return None
        w = weight.detach().numpy()
        found = self._owners(row_hashes(np.concatenate([w[:, :BLOCK], w[:, -BLOCK:]], axis=1)))
        if found is None:
            return None
        parts = self._decode(found, w.shape[1])
        if parts is None:
            return None
        bits, d, m, q = parts
        blocks = pack(bits, torch.from_numpy(d), torch.from_numpy(m), torch.from_numpy(q), *w.shape)
        return blocks if torch.equal(blocks.dequantize(), weight) else None

    def _owners(self, hashes: np.ndarray) -> np.ndarray | None:
        if len(self.hashes) == 0:
            return None
        at = np.searchsorted(self.hashes, hashes).clip(max=len(self.hashes) - 1)
        if not np.array_equal(self.hashes[at], hashes):
            return None
        return self.owners[at]

    def _decode(self, owners: np.ndarray, k: int):
        """(bits, d, m, q) for the weight's rows from their owners' raw rows, or None."""
        n = len(owners)
        d, m = np.zeros((n, k // BLOCK), np.float32), np.zeros((n, k // BLOCK), np.float32)
        q, bits = np.zeros((n, k), np.int16), set()
        for i in np.unique(owners[:, 0]):
            t = self.tensors[i]
            if t.k != k:
                return None
            mine = np.flatnonzero(owners[:, 0] == i)
            rows = decode_rows(t.raw[owners[mine, 1]], t.qtype, k)
            d[mine], m[mine], q[mine] = rows.d, rows.m, rows.q
            bits.add(rows.bits)
        return None if len(bits) != 1 else (bits.pop(), d, m, q)
