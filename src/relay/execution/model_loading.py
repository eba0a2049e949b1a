"""Building a model and loading its weights for a runner: quantized, on CPU packed for its
GEMMs, and kept in their GGUF blocks where those are exact."""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Callable, Iterable

import numpy as np
import torch

from relay.config import EngineConfig, ModelConfig
from relay.execution import gguf_weights
from relay.execution.block_rows import ALL_ROWS, block_rows
from relay.execution.gguf_weights import open_file
from relay.execution.kernels import cpu_gemm, isa
from relay.execution.model_files import GgufSource, gguf_rows, gguf_source
from relay.execution.models import model_class
from relay.execution.placement import Placement, cpu_has_fast_bf16
from relay.execution.quantized_blocks import BITS, BlockQuantizer
from relay.execution.quantized_checkpoint import Int4BlockLoader, dequantized
from relay.execution.startup_timing import log_weight_blocks

logger = logging.getLogger(__name__)


class ModelLoader:
    """Builds the models of one TP rank (the target, and a draft model) as cfg asks."""

    def __init__(self, cfg: EngineConfig, place: Placement, context_len: int):
        self.cfg, self.place, self.context_len = cfg, place, context_len

    def load(self, model_dir: str, mc: ModelConfig, quantization: str | None) -> torch.nn.Module:
        """The model's weights, quantized, and on CPU packed for its GEMMs (and kept in their
        GGUF blocks where those are exact: see _wants_weight_blocks)."""
        dtype = self.place.dtype
        source = gguf_source(model_dir)
        if source is not None and self.cfg.load_format != "dummy":
            return self._load_gguf(source, model_dir, mc, quantization)
        if mc.quantization is not None and self.cfg.load_format != "dummy":
            if mc.quantization.int4 and self._block_kernels_usable(quantization):
                return self._load_int4_blocks(model_dir, mc)
            if self.place.tp.is_leader:
                logger.info("%s checkpoint: dequantized at load", mc.quantization.describe())
        if self._quantizes_to_blocks(quantization):
            return self._load_quantized_blocks(model_dir, mc, quantization)
        if self._keeps_bf16_weights(model_dir, mc, quantization):
            return self._load_bf16_weights(model_dir, mc)
        blocks = self._wants_weight_blocks(model_dir, quantization)
        # A bfloat16 model's blocks are recovered from the checkpoint's float32 values, before
        # they are rounded: loaded into a float32 twin first.
        model = self._build_model(model_dir, mc, torch.float32 if blocks else dtype)
        kept = model.use_weight_blocks(gguf_rows(model_dir)) if blocks else 0
        if model.dtype != dtype:
            model = self._cast_keeping_blocks(model, mc)
        if kept and self._int8_block_activations():
            model.use_dot_blocks()
        self._finish(model, quantization)
        if kept:
            rows = self._weight_block_rows(model.dtype)
            model.limit_weight_blocks(rows)
            log_weight_blocks(model, kept, rows)
        return model

    def _load_gguf(
        self, source: GgufSource, model_dir: str, mc: ModelConfig, quantization: str | None
    ) -> torch.nn.Module:
        """A model served from its GGUF file's own tensors (gguf_weights): on CPU with the block
        kernels, GEMM weights as blocks with no float copy; otherwise (a GPU, --quantization,
        --disable-weight-blocks) dequantized to floats a tensor at a time."""
        place = self.place
        use_blocks = self._block_kernels_usable(quantization)
        model = self._new_model(mc, place.dtype)
        file = open_file(source.path, model_dir)
        keep_floats = use_blocks and self._floats_beside_blocks(file, place.dtype)
        dot = self._int8_block_activations()
        report = gguf_weights.load_llama(model, file, source.arch, use_blocks, keep_floats, dot)
        if place.tp.is_leader:
            gguf_weights.log_report(report, source.path)
        self._finish(model, quantization)
        if report.blocks:
            model.limit_weight_blocks(self._weight_block_rows(model.dtype))
        release_free_memory()  # what decoding the file's blocks allocated and freed
        return model

    def _load_bf16_weights(self, model_dir: str, mc: ModelConfig) -> torch.nn.Module:
        """A float32 model whose GEMM weights and embedding stay the checkpoint's bfloat16
        (LlamaForCausalLM.keep_bf16_weights): no float32 copy, no oneDNN-packed one."""
        model = self._new_model(mc, self.place.dtype)
        model.keep_bf16_weights()
        self._fill_weights(model, model_dir)
        self._finish(model, None)
        if self.place.tp.is_leader:
            logger.info(
                "bfloat16 checkpoint: weights kept in bfloat16 (%.2f GiB), widened to float32 in "
                "the GEMMs (this CPU has no bfloat16 dot products)",
                weight_bytes(model) / (1 << 30),
            )
        return model

    def _keeps_bf16_weights(
        self, model_dir: str, mc: ModelConfig, quantization: str | None
    ) -> bool:
        """Whether a float32 model keeps a bfloat16 checkpoint's GEMM weights and embedding in
        bfloat16 (_load_bf16_weights): on a CPU without bfloat16 dot products (placement.
        pick_dtype gives it float32 there), from a checkpoint whose GEMM weights are all
        bfloat16, unquantized, with Relay's widening GEMM built. A float32 copy holds the same
        values in twice the memory (and its oneDNN-packed copy twice again); the widening GEMV
        reads half float32's bytes per decode step. Where the CPU has bfloat16 dot products a
        float32 model (asked for by --dtype) keeps its float32 weights and oneDNN's GEMMs."""
        return (
            self.place.on_cpu
            and self.place.dtype == torch.float32
            and not cpu_has_fast_bf16()
            and quantization is None
            and mc.quantization is None
            and self.cfg.load_format != "dummy"
            and hasattr(model_class(mc.architecture), "keep_bf16_weights")
            and checkpoint_gemm_dtypes(model_dir) == {"BF16"}
            and cpu_gemm.gemm_widen_available()
        )

    def _load_quantized_blocks(
        self, model_dir: str, mc: ModelConfig, quantization: str
    ) -> torch.nn.Module:
        """A float checkpoint with --quantization int4|int8 on the block kernels: each GEMM weight
        quantized into blocks as soon as its decoder layer is loaded, its floats freed
        (quantized_blocks), so that the whole float model is never held beside the blocks."""
        model = self._new_model(mc, self.place.dtype)
        quantizer = BlockQuantizer(model, quantization, self._int8_block_activations())

        def quantize_layer(i: int) -> None:
            quantizer.layer_done(i)
            # the layer's freed floats back to the system: held in the heap, a 1B model's load
            # peaked ~0.8 GB higher
            release_free_memory()

        self._fill_weights(model, model_dir, quantize_layer)
        quantizer.finish()
        self._finish(model, None)  # (floats left only where a shard cuts a block)
        release_free_memory()  # what the freed float weights and the rounding left in the heap
        if self.place.tp.is_leader:
            quantizer.log(weight_bytes(model))
        return model

    def _load_int4_blocks(self, model_dir: str, mc: ModelConfig) -> torch.nn.Module:
        """An AWQ or GPTQ checkpoint on the block kernels: each GEMM's 4-bit quants packed into
        blocks once its decoder layer is in, with no float copy (quantized_checkpoint)."""
        model = self._new_model(mc, self.place.dtype)
        loader = Int4BlockLoader(model, mc.quantization, self._int8_block_activations())
        show = self.place.tp.is_leader
        with torch.no_grad():
            loader.load(iter_safetensors(model_dir, show, by_layer=True), after_each_layer)
        self._finish(model, None)  # (floats only where a module's groups cut its blocks)
        release_free_memory()  # what unpacking the layers allocated and freed
        if show:
            loader.log(weight_bytes(model))
        return model

    def _finish(self, model: torch.nn.Module, quantization: str | None) -> None:
        """Quantized, then (on CPU) packed for its GEMMs (the packed copy holds the quantized
        values) and on Relay's CPU kernels."""
        _quantize(model, quantization)
        if self.place.on_cpu:
            if os.environ.get("RELAY_PACKED_GEMM", "1") != "0":
                model.pack_for_cpu()
            model.use_cpu_kernels()

    def _quantizes_to_blocks(self, quantization: str | None) -> bool:
        """Whether --quantization quantizes a float checkpoint into blocks (quantized_blocks): int4
        or int8 where the block kernels are usable; elsewhere torch's kernels (_quantize)."""
        return quantization in BITS and self._block_kernels_usable(None)

    def _block_kernels_usable(self, quantization: str | None) -> bool:
        """Whether GEMMs may read GGUF blocks: on CPU, unquantized, not turned off, with the
        kernel built."""
        return (
            self.place.on_cpu
            and quantization is None
            and not self.cfg.disable_weight_blocks
            and cpu_gemm.gemm_blocks_available()
        )

    def _floats_beside_blocks(self, file: gguf_weights.GgufFile, dtype: torch.dtype) -> bool:
        """Whether a GGUF model keeps float GEMM weights beside its blocks: where GEMMs of some
        row count run faster on the floats (the rule for this CPU level says the blocks win up
        to fewer rows than a prompt chunk has: AMX's bfloat16 tiles, float32 activations) and
        the floats fit in a quarter of the free memory. Elsewhere the blocks take every GEMM and
        the model holds no float copy of them."""
        if self._weight_block_rows(dtype) >= ALL_ROWS:
            return False
        float_bytes = dtype.itemsize * file.matrix_weights()
        return float_bytes < available_memory_bytes() // 4

    def _weight_block_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows GEMMs read the blocks: EngineConfig.weight_block_rows, else the
        measured rule for this CPU level (relay.execution.block_rows). Every TP rank derives the
        same number from the same config and level, so their steps take the same paths."""
        if self.cfg.weight_block_rows is not None:
            return self.cfg.weight_block_rows
        return block_rows(isa.level(), dtype, self._int8_block_activations())

    def _new_model(self, mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        with torch.device(self.place.device):
            model = model_class(mc.architecture)(mc, self.place.tp, dtype, self.context_len)
        return model.eval()

    def _build_model(self, model_dir: str, mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        model = self._new_model(mc, dtype)
        self._fill_weights(model, model_dir)
        return model

    def _fill_weights(
        self,
        model: torch.nn.Module,
        model_dir: str,
        layer_done: Callable[[int], None] | None = None,
    ) -> None:
        """The checkpoint's weights (or random ones: load_format dummy) into model; with
        layer_done, the checkpoint a decoder layer at a time and layer_done(i) called once layer
        i's tensors are all in (the model's other tensors come last)."""
        if self.cfg.load_format == "dummy":
            torch.manual_seed(self.cfg.seed)
            for name, p in model.named_parameters():
                p.data.fill_(1.0) if "norm" in name else p.data.normal_(0.0, 0.02)
            for i in range(len(model.layers) if layer_done else 0):
                layer_done(i)
            return
        show, quant = self.place.tp.is_leader, model.config.quantization
        # a quantized checkpoint's layers come dequantized, a decoder layer at a time
        by_layer = layer_done is not None or quant is not None
        weights = iter_safetensors(model_dir, show_progress=show, by_layer=by_layer)
        if quant is not None:
            weights = dequantized(weights, quant, layer_of)
        with torch.no_grad():
            if layer_done is None:
                model.load_weights(weights)
            else:
                model.load_weights(after_each_layer(weights, layer_done))

    def _wants_weight_blocks(self, model_dir: str, quantization: str | None) -> bool:
        """Whether to look for GGUF blocks in the checkpoint's GEMM weights: on CPU, unquantized,
        with the kernel built; in bfloat16 only from a float32 checkpoint (a bf16 one has lost
        them) whose float32 twin fits in a quarter of the free memory."""
        if self.cfg.load_format == "dummy" or not self._block_kernels_usable(quantization):
            return False
        if self.place.dtype == torch.float32:
            return True
        float32_bytes = checkpoint_float32_bytes(model_dir)
        return 0 < float32_bytes < available_memory_bytes() // 4

    def _int8_block_activations(self) -> bool:
        """Whether the GEMMs on GGUF blocks round activations to int8 (EngineConfig.block_activations):
        by default where the CPU has AVX2 (x86: its integer dot products; elsewhere the level is
        generic, where the plain C sums are slower than float), in float32 and bfloat16 alike: a
        bfloat16 model's decode step ran 1.85x faster at one row on int8 products than on its
        bfloat16 blocks (held to AVX512-BF16, 12.1 -> 6.5 ms; AMX 11.1 -> 6.0 ms), and the
        rounding costs about what bfloat16's own does (docs/benchmarks.md)."""
        if self.cfg.block_activations != "auto":
            return self.cfg.block_activations == "int8"
        return isa.at_least("avx2")

    def _cast_keeping_blocks(self, twin: torch.nn.Module, mc: ModelConfig) -> torch.nn.Module:
        """The model in the runner's dtype with twin's weights (rounded) and twin's blocks (exact)."""
        model = self._new_model(mc, self.place.dtype)
        model.load_state_dict(twin.state_dict())
        for mine, theirs in zip(model.gemm_modules(), twin.gemm_modules()):
            mine.blocks = theirs.blocks
            if mine.blocks is not None:
                mine.blocks.round_bf16 = self.place.dtype == torch.bfloat16
        return model


def _quantize(model: torch.nn.Module, quantization: str | None) -> None:
    if quantization == "int8":
        model.quantize_int8()
    elif quantization == "w8a8":
        model.quantize_w8a8()
    elif quantization == "int4":
        model.quantize_int4()


def iter_safetensors(model_dir: str, show_progress: bool = True, by_layer: bool = False):
    """(name, tensor) for every tensor of the checkpoint, with a progress bar; by_layer: decoder
    layer 0's tensors first, then layer 1's, ..., then the rest (whatever files hold them)."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    names = []
    for path in files:
        with safe_open(path, framework="pt") as h:
            names += [(path, k) for k in h.keys()]
    if by_layer:
        names.sort(key=lambda pk: _layer_order(pk[1]))  # (stable: the files' order within a layer)
    for path, k in tqdm(
        names, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False
    ):
        # A file mapped for one tensor at a time: the pages read stay in the page cache, not in
        # this process's resident memory (2 GB of a 1B bfloat16 checkpoint's, mapped for the load).
        with safe_open(path, framework="pt") as h:
            tensor = h.get_tensor(k)
        yield k, tensor


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (model.layers.N....), or None."""
    found = _LAYER.search(name)
    return None if found is None else int(found.group(1))


def _layer_order(name: str) -> tuple[bool, int]:
    layer = layer_of(name)
    return (layer is None, layer or 0)


def after_each_layer(
    weights: Iterable[tuple[str, torch.Tensor]], layer_done: Callable[[int], None]
):
    """weights (in layer order: iter_safetensors by_layer) as they are, calling layer_done(i) once
    the consumer has taken the last of layer i's tensors and asks for the next."""
    current = None
    for name, tensor in weights:
        layer = layer_of(name)
        if current is not None and layer != current:
            layer_done(current)
        current = layer
        yield name, tensor
    if current is not None:
        layer_done(current)


def checkpoint_gemm_dtypes(model_dir: str) -> set[str]:
    """The safetensors dtypes (F32, BF16, ...) of the checkpoint's GEMM weights (*proj.weight),
    read from the files' headers."""
    from safetensors import safe_open

    found = set()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("proj.weight"):
                    found.add(f.get_slice(name).get_dtype())
    return found


def checkpoint_float32_bytes(model_dir: str) -> int:
    """The bytes of the checkpoint's float32 tensors (what a float32 twin of the model holds);
    0 if its GEMM weights are stored in another dtype."""
    from safetensors import safe_open

    total, gemm_weights_elsewhere = 0, False
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                if part.get_dtype() == "F32":
                    total += 4 * int(np.prod(part.get_shape()))
                elif name.endswith("proj.weight"):
                    gemm_weights_elsewhere = True
    return 0 if gemm_weights_elsewhere else total


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (where there is none: the physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_bytes(model: torch.nn.Module) -> int:
    """The memory a model's weights hold, in every form (floats, GGUF blocks, packed copies,
    quantized ones), each storage counted once; a stand-in weight (layers.stand_in) holds none."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.is_mkldnn:
            # oneDNN's blocked copy (pack_for_cpu) has no storage to ask (and strides (1, 0)):
            # its elements, at least what it holds
            seen[id(t)] = t.numel() * t.element_size()
        elif isinstance(t, torch.Tensor) and t.numel() and 0 not in t.stride():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(t, (tuple, list)):
            for x in t:
                add(x)
        elif hasattr(t, "__dataclass_fields__"):  # BlockWeight, Bf16Panels, Int4Weight, ...
            for name in t.__dataclass_fields__:
                add(getattr(t, name))

    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            add(t)
        for name in ("blocks", "packed", "int8", "int4", "w8a8"):
            add(getattr(module, name, None))
    return sum(seen.values())


def log_memory(models: list[torch.nn.Module | None], kv) -> None:
    """One start-up line: what this process's memory holds (a rank's share, under TP)."""
    import psutil

    gib = 1 << 30
    weights = sum(weight_bytes(m) for m in models if m is not None)
    # each buffer once (a latent-attention pool's v is its k)
    pool = sum({t.data_ptr(): t.untyped_storage().nbytes() for t in [*kv.k, *kv.v]}.values())
    rss = psutil.Process().memory_info().rss
    logger.info(
        "memory: weights %.2f GiB, KV pool %.2f GiB, other %.2f GiB (resident now %.2f GiB)",
        weights / gib,
        pool / gib,
        max(0, rss - weights - pool) / gib,
        rss / gib,
    )


def release_free_memory() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim): after a load that
    allocated and freed many large arrays, glibc keeps ~0.7 GB of a 1B model's decoding buffers
    in its heap otherwise (its mmap threshold grows with each large free), resident for good."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
