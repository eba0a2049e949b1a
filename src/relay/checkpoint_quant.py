"""A checkpoint's own quantization, read from config.json's `quantization_config` (or, where an
older export left it out of config.json, its quantize_config.json / quant_config.json): what
Relay loads and how, or a ValueError naming what it does not (the launcher exits 2 with that
line before any process starts, as for an architecture it does not run).

    awq    4-bit, zero points, groups of q_group_size inputs, AutoAWQ's GEMM packing (version gemm)
    gptq   4-bit, groups of group_size (-1: the whole row), desc_act (act-order: g_idx), sym or
           not; checkpoint_format gptq stores each zero point minus 1 (AutoGPTQ's v1), gptq_v2 as is
    fp8    float8 e4m3 weights with a per-tensor (or per-row) weight_scale, or weight_scale_inv per
           weight_block_size block; activation scales (input_scale) are not used
    mxfp4  gpt-oss only: its experts' *_blocks / *_scales, dequantized by the model's own loader
           (execution/mxfp4.py); every other weight is a float, so this reads as no quantization

relay.execution.quantized_checkpoint loads them. Torch is not imported here: the launcher, which
never holds torch, reads this.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("awq", "gptq", "fp8")
# Files beside config.json that AutoGPTQ (quantize_config.json) and AutoAWQ (quant_config.json)
# wrote before transformers put quantization_config into config.json, and the method each implies
# where it names none.
SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # awq | gptq | fp8
    bits: int = 4
    group_size: int = 128  # inputs per scale (and zero point); -1: one group per row (gptq)
    desc_act: bool = False  # gptq act-order: each input's group is g_idx[i], not i // group_size
    sym: bool = True  # gptq: every zero point 8 (checkpoints store them all the same)
    zero_offset: int = 0  # added to each stored zero point: 1 for gptq's v1 format (stores z - 1)
    weight_block: tuple[int, int] | None = None  # fp8: [rows, cols] per weight_scale_inv
    activation_scheme: str = "dynamic"  # fp8: static checkpoints carry input_scale (unused)

    @property
    def int4(self) -> bool:
        """Packed 4-bit integer weights with scales and zero points (awq, gptq)."""
        return self.method in ("awq", "gptq")

    def describe(self) -> str:
        """For the start-up log: 'gptq 4-bit g128 act-order', 'fp8 e4m3 blocks 128x128'."""
        if self.method == "fp8":
            blocks = self.weight_block
            return "fp8 e4m3 " + (f"blocks {blocks[0]}x{blocks[1]}" if blocks else "per tensor")
        group = "per row" if self.group_size == -1 else f"g{self.group_size}"
        act = " act-order" if self.desc_act else ""
        return f"{self.method} {self.bits}-bit {group}{act}{'' if self.sym else ' asym'}"


def read_checkpoint_quant(
    cfg: dict[str, Any], model_dir: str | None = None
) -> CheckpointQuant | None:
    """The checkpoint's quantization (None: a float checkpoint), or a ValueError naming the method
    or setting Relay does not load."""
    qc = cfg.get("quantization_config")
    if qc is None and model_dir is not None:
        qc = _side_file(model_dir)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4" and _is_gpt_oss(cfg):
        return None
    if method not in METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method or None!r} is not supported: Relay loads "
            f"awq, gptq and fp8 checkpoints (and quantizes float ones with --quantization)"
        )
    return {"awq": _awq, "gptq": _gptq, "fp8": _fp8}[method](qc)


def _is_gpt_oss(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (
        cfg.get("architectures") or []
    )


def _side_file(model_dir: str) -> dict[str, Any] | None:
    for name, method in SIDE_FILES:
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                return {"quant_method": method, **json.load(f)}
    return None


def _first(qc: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of names the config has (AutoAWQ's w_bit / q_group_size, transformers' bits /
    group_size: vLLM's AWQConfig reads either)."""
    for name in names:
        if qc.get(name) is not None:
            return qc[name]
    return default


def _four_bits(method: str, bits: Any) -> int:
    if bits != 4:
        raise ValueError(
            f"{method} checkpoint with bits {bits}: Relay loads 4-bit {method} checkpoints only"
        )
    return 4


def _group_size(method: str, group: Any, whole_row_ok: bool) -> int:
    if not isinstance(group, int) or not (group > 0 or (group == -1 and whole_row_ok)):
        raise ValueError(f"{method} checkpoint with group size {group!r}: not a group size")
    return group


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"awq checkpoint of version {version!r}: Relay loads AWQ's GEMM packing only "
            "(quantization_config.version gemm)"
        )
    if not _first(qc, "zero_point", default=True):
        raise ValueError("awq checkpoint without zero points (zero_point false): not supported")
    bits = _four_bits("awq", _first(qc, "w_bit", "bits"))
    group = _group_size("awq", _first(qc, "q_group_size", "group_size"), whole_row_ok=False)
    return CheckpointQuant("awq", bits, group, sym=False)


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = _four_bits("gptq", qc.get("bits"))
    group = _group_size("gptq", qc.get("group_size", 128), whole_row_ok=True)
    if qc.get("dynamic"):  # GPTQModel's per-module overrides (other bits, skipped modules)
        raise ValueError("gptq checkpoint with per-module overrides (dynamic): not supported")
    form = str(qc.get("checkpoint_format", "gptq")).lower()
    if form not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"gptq checkpoint_format {form!r}: Relay loads gptq and gptq_v2 (not marlin, ...)"
        )
    return CheckpointQuant(
        "gptq",
        bits,
        group,
        desc_act=bool(qc.get("desc_act", False)),
        sym=bool(qc.get("sym", True)),
        zero_offset=1 if form == "gptq" else 0,
    )


def _fp8(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint of format {fmt!r}: Relay loads e4m3 weights only")
    block = qc.get("weight_block_size")
    if block is not None and (
        len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"fp8 checkpoint with weight_block_size {block!r}: not [rows, cols]")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 checkpoint with activation_scheme {scheme!r}: not supported")
    return CheckpointQuant(
        "fp8",
        bits=8,
        weight_block=None if block is None else (block[0], block[1]),
        activation_scheme=scheme,
    )
