"""The quantized linear layers of an AWQ, GPTQ or FP8 checkpoint, gathered from the tensors that
make up each one (qweight, qzeros, scales, g_idx; an fp8 weight and its weight_scale or
weight_scale_inv) as the loader streams past them, and converted: a 4-bit layer into
packed_int4.Int4Linear, an fp8 one into its float32 weight. Every other tensor (norms, biases, an
embedding, a layer the checkpoint left unquantized) is the caller's to load as it is.
"""

from __future__ import annotations

import torch

from relay.checkpoint_quant import CheckpointQuant
from relay.execution.packed_int4 import Int4Linear, unpack_awq, unpack_gptq

INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")
FP8_PARTS = ("weight_scale", "weight_scale_inv", "input_scale")
FP8_DTYPES = (torch.float8_e4m3fn,)


class LinearParts:
    """Quantized layers' tensors by layer name (`model.layers.0.self_attn.q_proj`), until drained."""

    def __init__(self, quant: CheckpointQuant):
        self.quant = quant
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep the tensor if it is part of a quantized layer (True); False: load it as it is."""
        prefix, _, part = name.rpartition(".")
        ours = part in INT4_PARTS if self.quant.int4 else part in FP8_PARTS
        if self.quant.method == "fp8" and part == "weight" and tensor.dtype in FP8_DTYPES:
            ours = True
        if ours:
            self.pending.setdefault(prefix, {})[part] = tensor
        return ours

    def drain(self):
        """(layer name, Int4Linear or float32 weight) for every layer taken since the last drain,
        each converted as it is reached (the packed tensors then freed)."""
        pending, self.pending = self.pending, {}
        while pending:
            prefix, parts = pending.popitem()
            yield prefix, convert(prefix, parts, self.quant)


def convert(prefix: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant):
    """One layer's tensors as an Int4Linear (awq, gptq) or a float32 weight (fp8)."""
    need = ("qweight", "qzeros", "scales") if quant.int4 else ("weight",)
    missing = [p for p in need if p not in parts]
    if missing:
        raise ValueError(
            f"{quant.method} checkpoint: {prefix} lacks {', '.join(missing)} "
            f"(has {', '.join(sorted(parts))})"
        )
    if quant.method == "awq":
        linear = unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"])
    elif quant.method == "gptq":
        linear = unpack_gptq(
            parts["qweight"],
            parts["qzeros"],
            parts["scales"],
            parts.get("g_idx"),
            quant.zero_offset,
        )
    else:
        return fp8_weight(prefix, parts, quant)
    _check_groups(prefix, linear, quant)
    return linear


def _check_groups(prefix: str, linear: Int4Linear, quant: CheckpointQuant) -> None:
    """The scales' groups are what quantization_config says (a checkpoint read with the wrong
    config fails here, naming the layer, not as a garbled model)."""
    n, k = linear.shape
    groups = linear.scales.shape[1]
    want = 1 if quant.group_size == -1 else -(-k // quant.group_size)
    if groups != want:
        raise ValueError(
            f"{quant.method} checkpoint: {prefix} has {groups} groups of scales for {k} inputs, "
            f"not the {want} of group_size {quant.group_size}"
        )


def fp8_weight(prefix: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant) -> torch.Tensor:
    """The float32 weight of an fp8 layer: each e4m3 value times its scale (one float32
    rounding), the scale per tensor or per row (weight_scale) or per block (weight_scale_inv, its
    blocks weight_block_size: the "inv" is the scale the value is multiplied by, as DeepSeek's and
    transformers' FP8 checkpoints store it)."""
    w = parts["weight"].float()
    if "weight_scale_inv" in parts:
        if quant.weight_block is None:
            raise ValueError(f"fp8 checkpoint: {prefix} has block scales but no weight_block_size")
        return w * _block_scales(parts["weight_scale_inv"].float(), quant.weight_block, w.shape)
    if "weight_scale" not in parts:
        raise ValueError(f"fp8 checkpoint: {prefix} lacks weight_scale (or weight_scale_inv)")
    scale = parts["weight_scale"].float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.numel() == w.shape[0]:  # one per output row
        return w * scale.reshape(-1, 1)
    raise ValueError(f"fp8 checkpoint: {prefix} weight_scale of shape {list(scale.shape)}")


def _block_scales(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """[ceil(n / rows), ceil(k / cols)] block scales spread over the [n, k] weight (the last
    blocks of a row or column may be partial)."""
    n, k = shape
    want = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8 block scales of shape {list(scale.shape)} for a {n}x{k} weight")
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
