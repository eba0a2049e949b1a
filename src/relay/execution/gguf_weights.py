"""A GGUF file's weights loaded straight into a Llama-family model, with no float copy on disk or
in memory of a weight the kernels read as blocks.

Each GEMM weight (q/k/v fused, o, gate/up fused, down, and the LM head) is read from the file's
mapped tensors, decoded into the block kernels' form (gguf_blocks.decode_rows: the
dequantizer's exact values) and packed (weight_blocks.pack); the module then keeps a stand-in
weight with no storage (layers.stand_in) and every GEMM of it reads the blocks. What the file
changes is undone on rows: llama.cpp's q/k rotary permutation is a reordering of rows, a tensor-
parallel shard a range of rows (column-parallel) or of whole blocks along K (row-parallel). The
token embedding dequantizes only the rows a step looks up (EmbeddingRows). Norms and biases, and
a weight whose type has no block form (or a shard that cuts a block), are dequantized to floats
one tensor at a time and loaded as a checkpoint's are.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

from relay.execution.gguf_blocks import (
    DECODERS,
    RowBlocks,
    common_form,
    decode_rows,
    pack_rows,
    six_bit_form,
)
from relay.execution.gguf_header import FileTensor, GgufHeader, read_header
from relay.execution.layers import stand_in
from relay.execution.weight_blocks import STRIP, BlockWeight

logger = logging.getLogger(__name__)

TABLE_FILE = "gguf_tensors.json"  # beside the config of a GGUF model (model_files.open_gguf)


class GgufFile:
    """A GGUF file's tensors by name, mapped read-only (the page cache holds what is read; only
    what a load copies out becomes the process's own memory)."""

    def __init__(self, path: str, tensors: dict[str, FileTensor], arch: str = ""):
        self.path, self.tensors, self.arch = path, tensors, arch  # arch: general.architecture

    @classmethod
    def read(cls, path: str, header: GgufHeader | None = None) -> GgufFile:
        """The tensor table from the file's header (parsed here unless given)."""
        header = header or read_header(path)
        return cls(path, header.tensors, header.arch)

    @classmethod
    def from_table(cls, path: str, table: dict) -> GgufFile:
        tensors = {
            n: FileTensor(t["offset"], t["qtype"], tuple(t["shape"])) for n, t in table.items()
        }
        return cls(path, tensors)

    def table(self) -> dict:
        """What from_table takes (saved beside the model's config: TABLE_FILE)."""
        return {
            n: {"offset": t.offset, "qtype": t.qtype, "shape": list(t.shape)}
            for n, t in self.tensors.items()
        }

    def matrix_weights(self) -> int:
        """How many weights the file's matrices hold (what float copies of them would hold)."""
        return sum(int(np.prod(t.shape)) for t in self.tensors.values() if len(t.shape) == 2)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as [rows, bytes per row] (a view of the mapped file)."""
        from gguf.constants import GGML_QUANT_SIZES

        t = self.tensors[name]
        per, size = GGML_QUANT_SIZES[t.qtype]
        rows, k = int(np.prod(t.shape[:-1])), t.shape[-1]
        return np.memmap(self.path, np.uint8, "r", offset=t.offset, shape=(rows, k // per * size))

    def floats(self, name: str, rows: np.ndarray | None = None) -> torch.Tensor:
        """The tensor (or these rows of it) dequantized as transformers' reader does, float32."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        raw = self.raw(name)
        raw = raw if rows is None else raw[rows]
        out = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t.qtype))
        shape = t.shape if rows is None else (len(rows), *t.shape[1:])
        return torch.from_numpy(np.array(out, dtype=np.float32).reshape(shape))

    def blocks(self, name: str, rows: np.ndarray, cols: slice | None = None) -> RowBlocks | None:
        """These rows (and columns: whole 32-weight blocks) of a matrix in the block kernels'
        form, or None where its type has none or cols cuts a block (a k-quant's integer scales
        dropped where cols cuts a super-block of 256: RowBlocks.columns)."""
        t = self.tensors[name]
        k = t.shape[-1]
        if len(t.shape) != 2 or t.qtype not in DECODERS or k % DECODERS[t.qtype][0]:
            return None
        found = decode_rows(self.raw(name)[rows], t.qtype, k)
        if cols is None or (cols.start, cols.stop) == (0, k):
            return found
        return found.columns(cols)


@dataclass
class Part:
    """Rows of one file tensor that go into a GEMM weight: this rank's rows in the model's order,
    and the columns of a row-parallel shard; order: the whole tensor's rows in the model's order
    (for loading it as floats, which the model shards itself), None where unchanged."""

    name: str  # the GGUF tensor
    rows: np.ndarray
    cols: slice | None = None
    order: np.ndarray | None = None


def qk_row_order(rows: int, heads: int, permuted: bool) -> np.ndarray:
    """Row i of transformers' q or k weight is this row of the file's: llama.cpp interleaves each
    head's two rotary halves (LlamaModel.permute); transformers' reader undoes it."""
    order = np.arange(rows)
    if not permuted:
        return order
    return order.reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


class EmbeddingRows:
    """A token embedding looked up from the file: each step dequantizes only the rows it needs
    (the whole table never becomes floats). Every rank looks up every row itself, so a
    vocabulary split over ranks needs no all-reduce."""

    def __init__(self, file: GgufFile, name: str, dtype: torch.dtype):
        from gguf import GGMLQuantizationType

        self.raw, self.dtype = file.raw(name), dtype
        self.qtype = GGMLQuantizationType(file.tensors[name].qtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        unique, inverse = np.unique(ids.reshape(-1).numpy(), return_inverse=True)
        rows = torch.from_numpy(dequantize(self.raw[unique], self.qtype)).to(self.dtype)
        return rows[torch.from_numpy(inverse)].reshape(*ids.shape, -1)


@dataclass
class LoadReport:
    blocks: list[str]  # GEMM weights read as blocks (module names)
    floats: list[str]  # GEMM weights that became floats, with why


def load_llama(
    model,
    file: GgufFile,
    arch: str,
    use_blocks: bool,
    keep_floats: bool = False,
    dot: bool = False,
) -> LoadReport:
    """Load a Llama-family model (LlamaForCausalLM: Llama, Mistral, Qwen2, Qwen3) from the GGUF
    file of GGUF architecture arch: GEMM weights as blocks where use_blocks and their types
    allow (in the integer dot products' layout with dot), else floats; with keep_floats, floats
    beside the blocks too (for GEMMs of more rows than the blocks win at: ModelLoader decides);
    norms and biases as floats."""
    mc, report = model.config, LoadReport([], [])
    loaded: set[str] = set()

    def gemm(module_name: str, parts: list[Part], hf_names: list[str]) -> None:
        module = model.get_submodule(module_name)
        if use_blocks:
            blocks = read_blocks(file, parts, dot)
            if blocks is not None:
                install_blocks(module, blocks, model.dtype, keep_floats)
                report.blocks.append(module_name)
                if not keep_floats:
                    loaded.add(module_name + ".weight")
                    return
        if module.blocks is None:
            types = sorted({_type_name(file.tensors[p.name].qtype) for p in parts})
            report.floats.append(f"{module_name} ({'/'.join(types)})")
        for part, hf in zip(parts, hf_names):
            full = file.floats(part.name)
            order = part.order
            _load_float(model, loaded, f"{hf}.weight", full if order is None else full[order])

    permuted = arch == "llama"
    d = mc.head_dim
    q_order = qk_row_order(mc.num_heads * d, mc.num_heads, permuted)
    k_order = qk_row_order(mc.num_kv_heads * d, mc.num_kv_heads, permuted)
    bias_rows = {"attn_q.bias": q_order, "attn_k.bias": k_order}  # permuted with their weights
    for i, layer in enumerate(model.layers):
        a, mlp, blk, pre = layer.self_attn, layer.mlp, f"blk.{i}.", f"layers.{i}."
        sh = a.shard
        qs, ks = (
            slice(sh.q_start * d, (sh.q_start + sh.q_count) * d),
            slice(sh.kv_start * d, (sh.kv_start + sh.kv_count) * d),
        )
        gemm(
            pre + "self_attn.qkv_proj",
            [
                Part(blk + "attn_q.weight", q_order[qs], order=q_order),
                Part(blk + "attn_k.weight", k_order[ks], order=k_order),
                Part(blk + "attn_v.weight", np.arange(mc.num_kv_heads * d)[ks]),
            ],
            [pre + "self_attn.q_proj", pre + "self_attn.k_proj", pre + "self_attn.v_proj"],
        )
        gemm(
            pre + "self_attn.o_proj",
            [Part(blk + "attn_output.weight", np.arange(mc.hidden_size), qs)],
            [pre + "self_attn.o_proj"],
        )
        mine = np.arange(mlp.start, mlp.start + mlp.inter)
        gemm(
            pre + "mlp.gate_up_proj",
            [Part(blk + "ffn_gate.weight", mine), Part(blk + "ffn_up.weight", mine)],
            [pre + "mlp.gate_proj", pre + "mlp.up_proj"],
        )
        gemm(
            pre + "mlp.down_proj",
            [
                Part(
                    blk + "ffn_down.weight", np.arange(mc.hidden_size), slice(mine[0], mine[-1] + 1)
                )
            ],
            [pre + "mlp.down_proj"],
        )
        for gguf_name, hf in _LAYER_FLOATS:
            if blk + gguf_name in file:
                rows = bias_rows.get(gguf_name)
                t = file.floats(blk + gguf_name)
                _load_float(model, loaded, pre + hf, t if rows is None else t[rows])
    _load_float(model, loaded, "norm.weight", file.floats("output_norm.weight"))
    _load_embedding(model, file, loaded, use_blocks and not keep_floats, gemm)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"{file.path} lacks weights for: {sorted(missing)[:8]}")
    return report


def install_blocks(
    module, blocks: BlockWeight, dtype: torch.dtype, keep_float: bool = False
) -> None:
    """The module's GEMMs read blocks (a bfloat16 model's may round x to bfloat16, as its own GEMMs
    would); unless keep_float, its float weight becomes a stand-in with no storage (freed)."""
    blocks.round_bf16 = dtype == torch.bfloat16
    module.blocks = blocks
    if not keep_float:
        module.weight = stand_in(module.weight.shape, module.weight.dtype)


# Per-layer tensors that stay float: (GGUF name, the model's parameter under layers.N.)
_LAYER_FLOATS = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
)


def _load_float(model, loaded: set[str], hf_name: str, tensor: torch.Tensor) -> None:
    """One float tensor through the model's own checkpoint loading (its shard of it)."""
    with torch.no_grad():
        target = model._load_one(hf_name, tensor)
    if target:
        loaded.add(target)


def _load_embedding(model, file: GgufFile, loaded: set[str], lookup: bool, gemm) -> None:
    """The token embedding looked up from the file where lookup and its rows decode
    (EmbeddingRows), else floats; the LM head (output.weight, or tied: the embedding's rows of
    this rank's vocabulary shard) like every GEMM weight."""
    emb, head = model.embed_tokens, model.lm_head
    tied = head is emb
    if lookup and file.tensors["token_embd.weight"].qtype in DECODERS:
        emb.lookup = EmbeddingRows(file, "token_embd.weight", model.dtype)
        if not tied:  # (tied: the head's blocks stand for it below)
            emb.weight = stand_in(emb.weight.shape, emb.weight.dtype)
            loaded.add("embed_tokens.weight")
    else:
        _load_float(model, loaded, "model.embed_tokens.weight", file.floats("token_embd.weight"))
    shard = np.arange(head.start, head.start + head.weight.shape[0])
    if tied:  # its floats, if it has them, are loaded already
        hf = ["model.embed_tokens"] if emb.lookup is not None else []
        gemm("embed_tokens", [Part("token_embd.weight", shard)], hf)
    else:
        gemm("lm_head", [Part("output.weight", shard)], ["lm_head"])


CHUNK_ROWS = 2048  # output rows decoded and packed at a time (a multiple of the kernels' strips)
# Weights all of whose parts are k-quants keep the file's compact scales (weight_blocks.pack_kquant):
# the same outputs bit for bit from fewer bytes. False: float32 d and m (benchmarks' "before").
COMPACT_SCALES = True
# 8-bit quants that fit narrowed to 6 bits (gguf_blocks.six_bit_form: Q6_K, Q5_K, Q5_1, fused weights
# with such parts): the same outputs bit for bit from 6.5 bits a weight, not 8.5. False: the 8-bit
# form (benchmarks' "before").
SIX_BIT_QUANTS = True
_WITH_MIN = (3, 7, 12, 13)  # Q4_1, Q5_1, Q4_K, Q5_K: the types whose blocks have a minimum


def read_blocks(
    file: GgufFile, parts: list[Part], dot: bool, six_bits: bool | None = None
) -> BlockWeight | None:
    """The parts' rows, one after the other, as one BlockWeight read by every GEMM of it, whatever
    its row count (no float weight to fall back on); None where some part has no block form.
    Decoded and packed CHUNK_ROWS rows at a time, so that what a load holds besides the blocks is
    a chunk's decoded arrays, not a whole tensor's (a 128k-token LM head's int8 quants alone are
    0.5 GB). Where every part is a k-quant (Q4_K, Q5_K, Q6_K) and a row-parallel shard's columns
    are whole super-blocks, the blocks keep the file's compact scales (KSCALES_FLAG,
    COMPACT_SCALES); elsewhere float32 d and m. 8-bit quants that fit are kept in 6 bits
    (six_bits; None: SIX_BIT_QUANTS)."""
    first = [file.blocks(p.name, p.rows[:1], p.cols) for p in parts]
    if any(f is None for f in first):
        return None
    form = common_form(first)
    compact = COMPACT_SCALES and form.kquant
    has_m = form.bits == 4 or any(file.tensors[p.name].qtype in _WITH_MIN for p in parts)
    qtypes = [file.tensors[p.name].qtype for p in parts]
    six_bits = SIX_BIT_QUANTS if six_bits is None else six_bits
    six_bits = six_bits and six_bit_form(qtypes, form.bits, form.group, has_m)
    starts = np.cumsum([0] + [len(p.rows) for p in parts])
    n = int(starts[-1])
    out, done, unsigned = None, 0, True
    for c0 in range(0, n, CHUNK_ROWS):
        c1 = min(c0 + CHUNK_ROWS, n)
        pieces = [
            file.blocks(p.name, p.rows[max(c0, a) - a : min(c1, b) - a], p.cols)
            for p, a, b in zip(parts, starts[:-1], starts[1:])
            if max(c0, a) < min(c1, b)
        ]
        rows = common_form(pieces, (form.bits, form.group))
        chunk = pack_rows(rows, c1 - c0, rows.q.shape[1], has_m, compact, six_bits)
        assert chunk.kscales == compact, "every chunk of a weight in one form"
        chunk = chunk.to_dot() if dot else chunk
        if out is None:  # the whole weight's arrays, filled a chunk's strips at a time
            strips = -(-n // STRIP)
            out = replace(
                chunk,
                **{
                    f: getattr(chunk, f).new_empty(strips, *getattr(chunk, f).shape[1:])
                    for f in "qdm"
                },
                out_features=n,
            )
        s = chunk.q.shape[0]
        for f in "qdm":
            getattr(out, f)[done : done + s] = getattr(chunk, f)
        done, unsigned = done + s, unsigned and chunk.q_unsigned
    blocks = replace(out, q_unsigned=unsigned)
    blocks.max_rows = sys.maxsize
    return blocks


def _type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return str(qtype)


def log_report(report: LoadReport, path: str) -> None:
    total = len(report.blocks) + len(report.floats)
    logger.info(
        "%s: %d of %d GEMM weights read as blocks from the file%s",
        os.path.basename(path),
        len(report.blocks),
        total,
        "" if not report.floats else "; as floats (no block form): " + ", ".join(report.floats),
    )


def save_table(file: GgufFile, out: str) -> None:
    with open(os.path.join(out, TABLE_FILE), "w") as f:
        json.dump({"size": os.path.getsize(file.path), "tensors": file.table()}, f)


def open_file(path: str, model_dir: str) -> GgufFile:
    """The GGUF file at path through the tensor table saved in model_dir (save_table), or read
    again where there is none or the file is not the one tabled."""
    try:
        with open(os.path.join(model_dir, TABLE_FILE)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = None
    if saved is None or saved["size"] != os.path.getsize(path):
        return GgufFile.read(path)
    return GgufFile.from_table(path, saved["tensors"])


def check_llama_shapes(file: GgufFile, config) -> None:
    """Every tensor a Llama-family model reads is in the file with the shape its config says;
    a ValueError naming the first that is not."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or hidden // heads
    inter, vocab = config.intermediate_size, config.vocab_size
    want = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        want["output.weight"] = (vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": (hidden,),
            b + "attn_q.weight": (heads * d, hidden),
            b + "attn_k.weight": (kv * d, hidden),
            b + "attn_v.weight": (kv * d, hidden),
            b + "attn_output.weight": (hidden, heads * d),
            b + "ffn_norm.weight": (hidden,),
            b + "ffn_gate.weight": (inter, hidden),
            b + "ffn_up.weight": (inter, hidden),
            b + "ffn_down.weight": (hidden, inter),
        }
    for name, shape in want.items():
        if name not in file:
            raise ValueError(
                f"the file has no tensor {name} (the config needs one of {list(shape)})"
            )
        got = file.tensors[name].shape
        if tuple(got) != shape:
            raise ValueError(f"tensor {name} is {list(got)} where the config says {list(shape)}")
