"""AWQ, GPTQ and FP8 checkpoints loaded (relay.checkpoint_quant reads which; checkpoint_linears
gathers and converts each quantized layer's tensors).

On CPU with the block kernels, a 4-bit (AWQ, GPTQ) layer's quants go straight into the kernels'
Q4_1 form (weight_blocks.pack: per 32 inputs w = d * q + m) with no float copy ever made: its
group of g = 32, 64 or 128 inputs (or a whole row) is g / 32 blocks of the same scale s and zero
point z, d = s and m = -z * s. Both products are exact in float32 (s is an fp16 checkpoint value:
11 significant bits, times a quant or zero point of at most 5) and so is their sum, (q - z) * s:
the blocks are the checkpoint's dequantized weights bit for bit. The cost is d and m in float32
per 32 inputs: 6 bits a weight where the checkpoint has ~4.25.

Act-order GPTQ (desc_act: each input's group is g_idx[i]) scatters a group over the row. Its
inputs are reordered at load so that each group's are side by side (a stable sort by g_idx, the
same for every row of the weight: q/k/v, and gate/up, share their input and g_idx), and each GEMM
takes x's columns in that order (BlockWeight.in_perm: one index_select of x per GEMM, as vLLM's
exllama and Marlin GPTQ kernels permute activations); such a model runs layer by layer, not in
the one-call decode step. A module whose blocks would mix groups (a group size that is not a
multiple of 32, a tensor-parallel shard that cuts one, fused parts with different g_idx) gets the
dequantized floats instead.

Everywhere else (a GPU, --quantization, --disable-weight-blocks, no kernel) a 4-bit layer is
dequantized to float32, (q - z) * s, and loaded as a float checkpoint's weight (rounded to the
model's dtype once), a layer at a time. FP8 weights are always dequantized so (e4m3 value times
its per-tensor, per-row or per-block scale, in float32): Relay has no fp8 GEMM, on CPU or GPU.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator

import torch

from relay.checkpoint_quant import CheckpointQuant
from relay.execution.checkpoint_linears import LinearParts
from relay.execution.gguf_weights import install_blocks
from relay.execution.packed_int4 import Int4Linear
from relay.execution.weight_blocks import BLOCK, BlockWeight, pack

logger = logging.getLogger(__name__)

Weights = Iterable[tuple[str, torch.Tensor]]


def _float(linear: Int4Linear | torch.Tensor) -> torch.Tensor:
    return linear.dequantize() if isinstance(linear, Int4Linear) else linear


def dequantized(weights: Weights, quant: CheckpointQuant, layer_of: Callable) -> Iterator:
    """The checkpoint's tensors (in layer order) with each quantized layer's parts replaced by
    its float32 weight (`<layer>.weight`), converted once all of its decoder layer's tensors are
    in: what a float checkpoint's loader takes."""
    parts, current = LinearParts(quant), None
    for name, tensor in weights:
        layer = layer_of(name)
        if layer != current:
            yield from ((f"{p}.weight", _float(lin)) for p, lin in parts.drain())
            current = layer
        if not parts.take(name, tensor):
            yield name, tensor
    yield from ((f"{p}.weight", _float(lin)) for p, lin in parts.drain())


class ModuleBlocks:
    """One module's 4-bit parts (a fused GEMM's: q, k, v) until they are all in, then its blocks."""

    def __init__(self, module):
        self.module = module
        self.parts: list[tuple[str, object, Int4Linear]] = []  # (checkpoint layer, slot, linear)

    def blocks(self) -> BlockWeight | None:
        """The parts' rows in the module's order as blocks whose every 32 inputs share a scale
        and zero point; None where they cannot (see the module's docstring)."""
        n, k = self.module.weight.shape
        first_slot, first = self.parts[0][1:]
        perm = input_order(first.group[first_slot.cols])
        q = torch.empty(n, k, dtype=torch.uint8)
        d, m = torch.empty(n, k // BLOCK), torch.empty(n, k // BLOCK)
        filled = 0
        for _, slot, linear in self.parts:
            group = linear.group[slot.cols]
            group = group if perm is None else group[perm]
            if k % BLOCK or group.numel() != k or not one_group_per_block(group):
                return None
            quants = linear.q[slot.rows, slot.cols]
            rows = slice(slot.offset, slot.offset + quants.shape[0])
            q[rows] = quants if perm is None else quants[:, perm]
            block_group = group[::BLOCK]
            s = linear.scales[slot.rows][:, block_group]
            d[rows], m[rows] = s, -linear.zeros[slot.rows][:, block_group] * s
            filled += quants.shape[0]
        if filled != n:
            raise ValueError(f"the checkpoint fills {filled} of {n} rows of a GEMM weight")
        blocks = pack(4, d, m, q, n, k)
        blocks.in_perm = perm
        return blocks


def input_order(group: torch.Tensor) -> torch.Tensor | None:
    """The inputs in the order that puts each group's side by side (a stable sort by group, as
    vLLM's GPTQ kernels sort g_idx); None where they are already (no act-order)."""
    if bool((group[1:] >= group[:-1]).all()):
        return None
    return torch.sort(group, stable=True).indices


def one_group_per_block(group: torch.Tensor) -> bool:
    """Whether each run of BLOCK inputs belongs to one group."""
    blocks = group.reshape(-1, BLOCK)
    return bool((blocks == blocks[:, :1]).all())


class Int4BlockLoader:
    """Loads a 4-bit checkpoint into a model on the block kernels: each GEMM's parts placed by
    the model's linear_slots and packed into blocks once their decoder layer's tensors are all in
    (its float weight, never written, becomes a stand-in: layers.stand_in); other tensors, and a
    layer that has no slot or whose blocks would mix groups, as floats."""

    def __init__(self, model, quant: CheckpointQuant, dot: bool):
        self.model, self.quant, self.dot = model, quant, dot
        self.parts = LinearParts(quant)
        self.modules: dict[str, ModuleBlocks] = {}
        self.loaded: set[str] = set()
        self.blocks: list[str] = []
        self.floats: list[str] = []  # modules dequantized to floats, with why

    def load(self, weights: Weights, after_each_layer: Callable) -> None:
        """weights in layer order; after_each_layer(weights, done) calls done(i) once layer i's
        tensors are all taken (model_loading.after_each_layer)."""
        for name, tensor in after_each_layer(weights, self.layer_done):
            if not self.parts.take(name, tensor):
                self._load_float(name, tensor)
        self.layer_done(None)  # what no decoder layer holds (a quantized LM head)
        missing = {n for n, _ in self.model.named_parameters()} - self.loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")

    def layer_done(self, layer: int | None) -> None:
        for prefix, linear in self.parts.drain():
            slots = self.model.linear_slots(prefix)
            if slots is None or not isinstance(linear, Int4Linear):
                self._load_float(f"{prefix}.weight", _float(linear))
                continue
            for slot in slots:
                module = self.modules.setdefault(slot.name, ModuleBlocks(slot.module))
                module.parts.append((prefix, slot, linear))
        modules, self.modules = self.modules, {}
        for name, module in modules.items():
            self._install(name, module)

    def _install(self, name: str, module: ModuleBlocks) -> None:
        blocks = module.blocks()
        if blocks is None:
            self.floats.append(f"{name} (its groups cut its blocks of {BLOCK})")
            for prefix, linear in {id(lin): (p, lin) for p, _, lin in module.parts}.values():
                self._load_float(f"{prefix}.weight", linear.dequantize())
            return
        blocks = blocks.to_dot() if self.dot else blocks
        blocks.max_rows = sys.maxsize  # every GEMM: there is no float weight beside them
        install_blocks(module.module, blocks, self.model.dtype)
        self.loaded.add(f"{name}.weight")
        self.blocks.append(name)

    def _load_float(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            target = self.model._load_one(name, tensor)
        if isinstance(target, str):
            self.loaded.add(target)
        elif target:
            self.loaded.update(target)

    def log(self, weight_bytes: int) -> None:
        logger.info(
            "%s checkpoint: %d GEMM weights as 4-bit blocks, no float copy%s; weights %.2f GiB",
            self.quant.describe(),
            len(self.blocks),
            "" if not self.floats else "; dequantized to floats: " + ", ".join(self.floats),
            weight_bytes / (1 << 30),
        )
