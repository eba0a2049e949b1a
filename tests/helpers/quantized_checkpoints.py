"""Tiny AWQ, GPTQ and FP8 checkpoints for tests: a random float32 Llama whose GEMM weights are
quantized here and written in each format's own packing, as the formats document it (AutoAWQ's
WQLinear_GEMM.from_linear, AutoGPTQ's QuantLinear.pack, transformers' FineGrainedFP8 / vLLM's
Fp8 checkpoints), not by Relay's unpacking code. Each checkpoint comes with the float32 weights
it stands for, which the tests load into transformers as the reference.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from tests.helpers.tiny_models import tiny_llama_config

AWQ_ORDER = (
    0,
    2,
    4,
    6,
    1,
    3,
    5,
    7,
)  # AutoAWQ's order_map: nibble n of a word holds output ORDER[n]
GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(tokenizer_dir: str, path: str, seed: int = 0):
    """A float32 random Llama of hidden 128 and MLP 256 (so groups of 128 fit every GEMM),
    saved with the tokenizer files of tokenizer_dir; the transformers model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(hidden_size=128, intermediate_size=256)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def gemm_weights(model) -> dict[str, torch.Tensor]:
    """The decoder layers' GEMM weights by checkpoint layer name (model.layers.0.self_attn.q_proj)."""
    return {
        name.removesuffix(".weight"): p.detach()
        for name, p in model.named_parameters()
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in GEMMS
    }


def shared_input(name: str) -> int:
    """A number per GEMM input: layers that read the same x (q/k/v, gate/up) quantize it in the
    same act-order (GPTQ orders a layer's inputs by its Hessian, which x alone makes)."""
    layer = int(name.split(".")[2])
    role = {"q": 0, "k": 0, "v": 0, "o": 1, "gate": 2, "up": 2, "down": 3}
    return 4 * layer + role[name.rsplit(".", 1)[-1].removesuffix("_proj")]


def act_order_groups(k: int, group: int, seed: int) -> torch.Tensor:
    """g_idx as GPTQ's act-order leaves it: inputs quantized in a random order (its Hessian's),
    each run of `group` of that order one group, so that every group is scattered over the row."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def quantize_groups(w: torch.Tensor, g_idx: torch.Tensor, sym: bool, min_zero: int = 0):
    """Round-to-nearest 4-bit quantization per (row, group): (q [out, in] 0..15, z [out, groups]
    integers, s [out, groups] fp16); the weight it stands for is (q - z[:, g]) * s[:, g] in float32."""
    g = g_idx.long()
    groups = int(g.max()) + 1
    lo = torch.full((w.shape[0], groups), float("inf")).scatter_reduce(1, g.expand_as(w), w, "amin")
    hi = torch.full((w.shape[0], groups), -float("inf")).scatter_reduce(
        1, g.expand_as(w), w, "amax"
    )
    if sym:  # zero point 8: q - 8 in -8..7
        s = (torch.maximum(hi.abs(), lo.abs()) / 7.5).half()
        z = torch.full_like(s, 8, dtype=torch.float32)
    else:
        s = ((hi - lo) / 15).half()
        z = torch.round(-lo / s.float()).clamp(min_zero, 15)
    q = torch.round(w / s.float()[:, g] + z[:, g]).clamp(0, 15).to(torch.uint8)
    return q, z, s


def dequantize(q, z, s, g_idx) -> torch.Tensor:
    g = g_idx.long()
    return (q.float() - z[:, g]) * s.float()[:, g]


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 bit patterns the formats store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM.from_linear: intweight [in, out]; word j of row i ORs in
    intweight[i, 8j + AWQ_ORDER[n]] << 4n; the zeros [groups, out] likewise; scales [groups, out]."""

    def words(t: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
        t = t.long().reshape(t.shape[0], -1, 8)
        return _int32(sum(t[:, :, AWQ_ORDER[n]] << (4 * n) for n in range(8)))

    return {"qweight": words(q.t()), "qzeros": words(z.t()), "scales": s.t().contiguous()}


def pack_gptq(q, z, s, g_idx, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: intweight [in, out]; row r of qweight ORs in intweight[8r + n]
    << 4n; zeros (minus 1 in the v1 format, masked to 4 bits) packed along the outputs, nibble n of
    word c holding output 8c + n; scales [groups, out] fp16; g_idx [in]."""
    intweight = q.t().long()
    qweight = sum(intweight[n::8] << (4 * n) for n in range(8))
    zeros = ((z.t().long() - (1 if v1 else 0)) & 0xF).reshape(z.shape[1], -1, 8)
    qzeros = sum(zeros[:, :, n] << (4 * n) for n in range(8))
    return {
        "qweight": _int32(qweight),
        "qzeros": _int32(qzeros),
        "scales": s.t().contiguous(),
        "g_idx": g_idx,
    }


def int4_checkpoint(model, path: str, method: str, group: int, **opts) -> dict[str, torch.Tensor]:
    """Rewrite path's weights as an AWQ (method awq) or GPTQ checkpoint of this group size;
    opts: sym, act_order, v1 (gptq). The float32 weights it stands for, by layer name."""
    from safetensors.torch import save_file

    sym, act_order, v1 = opts.get("sym", False), opts.get("act_order", False), opts.get("v1", True)
    tensors = {n: p.detach().contiguous() for n, p in model.state_dict().items()}
    floats = {}
    for name, w in gemm_weights(model).items():
        k = w.shape[1]
        g_idx = (
            act_order_groups(k, group, seed=shared_input(name))
            if act_order
            else (torch.arange(k) // group).to(torch.int32)
        )
        # v1 stores z - 1 in 4 bits: a zero point of 0 reads back as 16 (AutoGPTQ's own quirk)
        q, z, s = quantize_groups(w, g_idx, sym, min_zero=1 if method == "gptq" and v1 else 0)
        floats[name] = dequantize(q, z, s, g_idx)
        del tensors[name + ".weight"]
        packed = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, g_idx, v1)
        tensors |= {f"{name}.{part}": t.contiguous() for part, t in packed.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
        if method == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq" if v1 else "gptq_v2",
        }
    )
    set_quantization_config(path, config)
    return floats


def fp8_checkpoint(model, path: str, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Rewrite path's weights as an FP8 (e4m3) checkpoint: per-tensor weight_scale (and an
    input_scale, as static checkpoints carry), or weight_scale_inv per block. The float32
    weights it stands for."""
    from safetensors.torch import save_file

    tensors = {n: p.detach().contiguous() for n, p in model.state_dict().items()}
    floats = {}
    for name, w in gemm_weights(model).items():
        if block is None:
            scale = (w.abs().amax() / 448).reshape(())
            full = scale
        else:
            n, k = w.shape
            rows, cols = -(-n // block[0]), -(-k // block[1])
            pad = torch.zeros(rows * block[0], cols * block[1])
            pad[:n, :k] = w.abs()
            scale = pad.reshape(rows, block[0], cols, block[1]).amax((1, 3)) / 448
            full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        fp8 = (w / full).to(torch.float8_e4m3fn)
        floats[name] = fp8.float() * full
        tensors[name + ".weight"] = fp8
        tensors[name + (".weight_scale" if block is None else ".weight_scale_inv")] = scale
        if block is None:
            tensors[name + ".input_scale"] = torch.tensor(0.01)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static"}
    if block is not None:
        config["weight_block_size"] = list(block)
    set_quantization_config(path, config)
    return floats


def set_quantization_config(path: str, quantization_config: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def reference_model(model, floats: dict[str, torch.Tensor]):
    """transformers' model with its GEMM weights the checkpoint's dequantized float32 values."""
    with torch.no_grad():
        for name, w in floats.items():
            model.get_submodule(name).weight.copy_(w)
    model.generation_config.eos_token_id = None
    return model
