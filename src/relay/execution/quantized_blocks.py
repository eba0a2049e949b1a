"""--quantization int4 / int8 of a float checkpoint on CPU with the block kernels: every GEMM weight
quantized at load straight into the kernels' block forms (weight_blocks.pack) and served as a GGUF
file's blocks are (gguf_weights): its module keeps a stand-in weight with no storage, and every
GEMM of it, and the one-call decode step, reads the blocks.

    int4   Q4_1's form: per 32 inputs d = (max - min) / 15, m = min, q = round((w - m) / d) in 0..15
    int8   Q8_0's form: per 32 inputs d = max|w| / 127, q = round(w / d) in -127..127

d and m are kept in float32 (a GGUF file's are float16: the same kernels, a finer grid), and a
weight is d * q (+ m) rounded to float32 as the kernels and BlockWeight.dequantize compute it. A
block of equal weights has d = 0 and q = 0: w = m (int4), 0 (int8).

ModelLoader loads the checkpoint a decoder layer at a time and quantizes each layer's GEMM weights
once all of its tensors are in (BlockQuantizer.layer_done), freeing their floats, so the process
never holds the whole float model beside the blocks. A tied embedding looks its rows up from the LM
head's blocks (BlockRows); an untied one stays float. Under tensor parallelism each rank quantizes
its own shard: rows, or a row-parallel layer's inputs where every rank's are whole blocks;
elsewhere the weight takes torch's kernels as it does off the block kernels (layers.quantize_int4 /
quantize_int8), which the start-up log names.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

import torch

from relay.execution.gguf_weights import install_blocks
from relay.execution.layers import Linear, has_float_weight, quantize_int4, quantize_int8
from relay.execution.weight_blocks import BLOCK, STRIP, BlockWeight, pack, strips_layout

logger = logging.getLogger(__name__)

BITS = {"int4": 4, "int8": 8}
CHUNK_ROWS = 2048  # rows rounded and packed at a time (whole strips of STRIP)
_TORCH_QUANTIZERS = {
    "int4": quantize_int4,
    "int8": quantize_int8,
}  # off the blocks: Linear.int4/int8


def quantize_blocks(
    w: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows of a weight quantized per BLOCK inputs: (d, m, q) flat, as pack() takes them; m None
    for bits 8 (Q8_0 has no minimum)."""
    b = w.float().reshape(-1, BLOCK)
    if bits == 4:
        lo = b.amin(-1)
        d = (b.amax(-1) - lo) / 15
        safe = torch.where(d > 0, d, torch.ones_like(d))  # equal weights: d = 0, q = 0, w = m
        q = torch.round((b - lo[:, None]) / safe[:, None]).clamp_(0, 15).to(torch.uint8)
        return d, lo, q
    d = b.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(b / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return d, None, q


def quantize_weight(weight: torch.Tensor, bits: int, dot: bool) -> BlockWeight:
    """A [N, K] float weight as blocks (K whole blocks) that every GEMM reads, whatever its row
    count (there is no float weight beside them); in the integer dot products' layout with dot.
    Rounded and packed CHUNK_ROWS rows at a time, so that a load's scratch beside the blocks is a
    chunk's (a whole LM head's quants, unpacked, took ~1 GB more)."""
    n, k = weight.shape
    chunks = []
    for r in range(0, n, CHUNK_ROWS):
        rows = weight[r : r + CHUNK_ROWS]
        chunk = pack(bits, *quantize_blocks(rows, bits), rows.shape[0], k)
        chunks.append(chunk.to_dot() if dot else chunk)
    blocks = replace(
        chunks[0],
        **{f: torch.cat([getattr(c, f) for c in chunks]) for f in "qdm"},
        out_features=n,
        q_unsigned=all(c.q_unsigned for c in chunks),  # (bits 8: a chunk may hold only 0..31)
    )
    blocks.max_rows = sys.maxsize
    return blocks


def dequantized(weight: torch.Tensor, quantization: str) -> torch.Tensor:
    """The float32 weight --quantization int4|int8 serves in place of weight (for references)."""
    return quantize_weight(weight, BITS[quantization], dot=False).dequantize()


class BlockRows:
    """A tied embedding looked up from its LM head's blocks, this rank's vocabulary rows of them:
    each step dequantizes only the rows it needs, as BlockWeight.dequantize computes them (d * q,
    then + m, float32). Rows of other ranks' shards are zeros here and the all-reduce sums them in,
    as VocabParallelEmbedding's float rows are."""

    def __init__(self, blocks: BlockWeight, start: int, dtype: torch.dtype, tp):
        assert not blocks.kscales and blocks.group == BLOCK, "quantize_weight's forms"
        self.blocks, self.start, self.dtype, self.tp = blocks, start, dtype, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids.reshape(-1) - self.start
        outside = (local < 0) | (local >= self.blocks.out_features)
        unique, inverse = torch.unique(local.masked_fill(outside, 0), return_inverse=True)
        rows = self.rows(unique).to(self.dtype)[inverse]
        rows.masked_fill_(outside[:, None], 0)
        rows = rows.reshape(*ids.shape, -1)
        return rows if self.tp.size == 1 else self.tp.all_reduce(rows)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """These rows of the weight, float32 [len(rows), K]."""
        b, n = self.blocks, len(rows)
        strips, lanes = rows // STRIP, rows % STRIP
        q = strips_layout(b.q[strips], b.bits) if b.dot else b.q[strips]
        q = q[torch.arange(n), :, lanes]  # [n, K / 2] nibble pairs, or [n, K] int8
        if b.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=2).reshape(n, -1)
        w = b.d[strips, :, lanes].repeat_interleave(BLOCK, dim=1) * q.float()
        if b.has_m:
            w = w + b.m[strips, :, lanes].repeat_interleave(BLOCK, dim=1)
        return w


class BlockQuantizer:
    """Quantizes a model's GEMM weights into blocks as the loader completes them, freeing each
    one's floats; counts what it did for the start-up log."""

    def __init__(self, model, quantization: str, dot: bool):
        self.model, self.quantization, self.dot = model, quantization, dot
        self.bits = BITS[quantization]
        self.blocks = 0
        self.kept: list[str] = []  # modules on torch's kernels (a shard cuts a block)

    def layer_done(self, layer: int) -> None:
        """Decoder layer `layer`'s GEMM weights are all loaded: quantize them. (A checkpoint's
        layers past the decoder, DeepSeek V3's multi-token prediction, are not loaded.)"""
        if layer >= len(self.model.layers):
            return
        gemms = {id(m) for m in self.model.gemm_modules()}
        prefix = f"layers.{layer}."
        for name, module in self.model.layers[layer].named_modules(prefix=prefix.rstrip(".")):
            if id(module) in gemms:
                self._quantize(name, module)

    def finish(self) -> None:
        """The GEMM weights still float (the LM head; any a layer_done did not reach), and a
        tied embedding's lookup from the head's blocks."""
        names = {id(m): n for n, m in self.model.named_modules()}
        for module in self.model.gemm_modules():
            if module.blocks is None and getattr(module, self.quantization) is None:
                self._quantize(names[id(module)], module)
        emb = self.model.embed_tokens
        if emb is self.model.lm_head and emb.blocks is not None:
            emb.lookup = BlockRows(emb.blocks, emb.start, self.model.dtype, emb.tp)

    def _quantize(self, name: str, module) -> None:
        k = module.weight.shape[1]
        whole = k % BLOCK == 0
        if isinstance(module, Linear) and module.tp is not None:  # row-parallel: a shard of K
            whole = module.tp.all_true(whole)  # every rank's K whole blocks: so is every start
        if not whole:
            self.kept.append(name)
            q, module.weight.data = _TORCH_QUANTIZERS[self.quantization](module.weight)
            setattr(module, self.quantization, q)
            return
        assert has_float_weight(module), f"{name} has no weight to quantize"
        blocks = quantize_weight(module.weight, self.bits, self.dot)
        install_blocks(module, blocks, self.model.dtype)  # the floats freed here, one at a time
        self.blocks += 1

    def log(self, weight_bytes: int) -> None:
        total = self.blocks + len(self.kept)
        logger.info(
            "%d of %d GEMM weights quantized to %s blocks at load%s; weights %.2f GiB",
            self.blocks,
            total,
            self.quantization,
            ""
            if not self.kept
            else f" ({', '.join(self.kept)}: torch's {self.quantization} kernels, a shard cuts "
            f"a block of {BLOCK})",
            weight_bytes / (1 << 30),
        )
