"""Tiny GGUF checkpoints written as llama.cpp's convert_hf_to_gguf.py writes them.

write_gguf() takes a transformers model (tiny, random weights) and writes it as a GGUF file:
tensor names from gguf-py's TensorNameMap (the map llama.cpp converts with, and transformers reads
with), llama.cpp's metadata keys, and llama.cpp's changes to the weights: Llama's q/k rows
permuted for its rotary layout, Gemma's norm weights stored as 1 + w, each layer's experts stacked
into one tensor per projection, a tied output projection left out, 1-element dimensions squeezed
(Qwen2-MoE's shared-expert gate is a vector). Its vocabulary is a byte-level BPE (a GPT-2-style
tokenizer, as SmolLM2's and Qwen's files carry): the 256 bytes, some merges and an end-of-text
token, VOCAB_SIZE tokens in all.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

# Which GGUF architecture llama.cpp writes each transformers model_type as: Mistral and Mixtral
# are written as "llama" (Mixtral with its experts stacked, as the MoE models').
GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}
GEMMA = (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
F32 = gguf.GGMLQuantizationType.F32
# Kept in float32 by llama.cpp whatever the file's type: the routers (and every 1-D tensor).
_FLOAT_TENSORS = ("ffn_gate_inp",)


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small byte-level BPE: the 256 byte symbols, the merges that spell
    some common English pieces, then <|endoftext|>."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = []
    for word in _WORDS:
        piece = word[0]
        for ch in word[1:]:
            if piece + ch not in tokens:
                merges.append(f"{piece} {ch}")
                tokens.append(piece + ch)
            piece += ch
    return [*tokens, END_OF_TEXT], merges


# " " is Ġ in the byte alphabet. 256 bytes + these words' merges + 1 = VOCAB_SIZE tokens.
_WORDS = ["Ġthe", "Ġand", "Ġof", "Ġto", "Ġin", "Ġis", "ing", "er", "on", "Ġa", "Ġcapital",
          "ĠFrance", "ĠParis", "Ġhello", "Ġworld", "Ġit", "Ġwas", "Ġone", "Ġtime"]  # fmt: skip
END_OF_TEXT = "<|endoftext|>"
VOCAB_SIZE = len(byte_level_vocab()[0])


def write_gguf(path: str, model: torch.nn.Module, *, name: str = "tiny", qtype=F32) -> str:
    """Write model (its config's vocab_size must be VOCAB_SIZE) as a GGUF file of qtype (F32, F16,
    or a quantized type of gguf.quants, Q4_K, Q5_K or Q6_K for weight matrices; vectors and routers stay F32)
    at path. qtype may also be a dict from tensor name parts ("attn_q", "ffn_down", "token_embd",
    ...) to types, as a mixed file (Q4_K_M) has them; a matrix it does not name stays F32."""
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    if cfg.vocab_size != VOCAB_SIZE:
        raise ValueError(f"the model's vocab_size must be {VOCAB_SIZE} (the file's tokenizer)")
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    _write_config(writer, cfg, arch, qtype)
    _write_tokenizer(writer)
    for tensor_name, data in gguf_tensors(model, arch):
        _add_tensor(writer, tensor_name, data, qtype)
    if arch == gguf.MODEL_ARCH.LLAMA and _rope(cfg).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype) -> None:
    if isinstance(qtype, dict):
        qtype = next((t for part, t in qtype.items() if f"{part}." in name), F32)
    keep_float = data.ndim < 2 or any(f"{part}." in name for part in _FLOAT_TENSORS)
    if qtype == F32 or keep_float:
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif qtype in _K_QUANTIZERS:  # (gguf.quants cannot quantize to them)
        writer.add_tensor(name, _K_QUANTIZERS[qtype](data), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, k] (k a multiple of 256) as Q4_K super-blocks [rows, k / 256 * 144]: per 32
    weights a scale and a minimum, 6-bit multiples of the super-block's float16 d and dmin, and
    4-bit quants (plain rounding, not llama.cpp's search for the best scales: a valid file)."""
    rows = w.shape[0]
    b = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(b.min(-1), 0), b.max(-1)
    scale, low = (hi - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (low.max(-1) / 63).astype(np.float16)
    sc = _sixbit(scale, d)
    mn = _sixbit(low, dmin)
    step = d.astype(np.float32)[:, None] * sc
    off = dmin.astype(np.float32)[:, None] * mn
    safe = np.where(step > 0, step, 1)[..., None]
    q = np.clip(np.rint((b + off[..., None]) / safe), 0, 15).astype(np.uint8)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # group g: sub-blocks 2g, 2g + 1
    heads = np.stack([d, dmin], axis=1).view(np.uint8)
    return np.concatenate([heads, scales, qs], axis=1).reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """w [rows, k] (k a multiple of 256) as Q5_K super-blocks [rows, k / 256 * 176]: Q4_K's
    scales and minima (over 31 steps), 5-bit quants: the low nibbles as Q4_K's, the fifth bits of
    sub-block s as bit s of qh[j] (plain rounding: a valid file)."""
    rows = w.shape[0]
    b = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(b.min(-1), 0), b.max(-1)
    scale, low = (hi - lo) / 31, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (low.max(-1) / 63).astype(np.float16)
    sc, mn = _sixbit(scale, d), _sixbit(low, dmin)
    step = d.astype(np.float32)[:, None] * sc
    off = dmin.astype(np.float32)[:, None] * mn
    safe = np.where(step > 0, step, 1)[..., None]
    q = np.clip(np.rint((b + off[..., None]) / safe), 0, 31).astype(np.uint8)  # [n, 8, 32]
    low4 = q & 0x0F
    qs = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, 128)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    heads = np.stack([d, dmin], axis=1).view(np.uint8)
    return np.concatenate([heads, _k_scale_bytes(sc, mn), qh, qs], axis=1).reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w [rows, k] (k a multiple of 256) as Q6_K super-blocks [rows, k / 256 * 210]: per 16
    weights an int8 multiple of the super-block's float16 d, 6-bit quants stored minus 32: half h
    of the 256 in ql[64h ..] (low nibbles: its weights 0-63, high: 64-127) and qh[32h ..] (bits
    2s, 2s + 1: its weights 32s + j) (plain rounding: a valid file)."""
    rows = w.shape[0]
    b = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(b).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    u = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(scale / np.where(u > 0, u, 1)), -128, 127).astype(np.float32)
    step = (u * sc)[..., None]
    q = np.clip(np.rint(b / np.where(step > 0, step, 1)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # [n, half, 128]
    low4, high2 = q & 0x0F, q >> 4
    ql = (low4[..., :64] | (low4[..., 64:] << 4)).reshape(-1, 128)
    qh = (
        high2.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    ).sum(2, dtype=np.uint8)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate(
        [ql, qh.reshape(-1, 64), scales, d[:, None].view(np.uint8)], axis=1
    ).reshape(rows, -1)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins [n, 8] (float) in Q4_K's and Q5_K's 12 bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    return np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )


_K_QUANTIZERS = {
    gguf.GGMLQuantizationType.Q4_K: quantize_q4_k,
    gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
    gguf.GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def _sixbit(x: np.ndarray, unit: np.ndarray) -> np.ndarray:
    u = unit.astype(np.float32)[:, None]
    return np.clip(np.rint(x / np.where(u > 0, u, 1)), 0, 63).astype(np.float32)


def _rope(cfg) -> dict:
    """The rope of the (global) attention layers: llama.cpp writes only theirs."""
    return cfg.rope_parameters.get("full_attention") or cfg.rope_parameters


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """Llama 3.1+'s rope scaling as llama.cpp's converter stores it (LlamaModel's rope_freqs): a
    divisor per frequency, 1 for the short wavelengths, the factor for the long ones, smoothed
    in between."""
    import math

    rope = _rope(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_config(writer: gguf.GGUFWriter, cfg, arch, qtype) -> None:
    """The hyperparameters llama.cpp writes (TextModel.set_gguf_parameters and each model's)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(_rope(cfg)["rope_theta"])
    if _rope(cfg).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(_rope(cfg)["factor"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    mixed = isinstance(qtype, dict)
    writer.add_file_type(gguf.LlamaFileType.GUESSED if mixed else _FILE_TYPES[qtype])
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.PHI3):
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch in (*GEMMA, gguf.MODEL_ARCH.PHI3) and cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)


_FILE_TYPES = {
    gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
    gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
    gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
}


def _write_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokens, merges = byte_level_vocab()
    eot = len(tokens) - 1
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * eot + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)


def gguf_tensors(model: torch.nn.Module, arch) -> list[tuple[str, np.ndarray]]:
    """model's weights under their GGUF names, changed as llama.cpp changes them."""
    cfg = model.config
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    out = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        data = tensor.detach().float().numpy()
        for base, part in _split_experts(hf_name, data):
            stem, _, suffix = base.rpartition(".")
            if suffix not in ("weight", "bias"):
                stem, suffix = base, "weight"  # fused experts: a parameter without .weight
            gguf_name = names.get_name(stem)
            if gguf_name is None:
                raise KeyError(f"no GGUF name for {hf_name}")
            out.append((f"{gguf_name}.{suffix}", _llama_cpp_form(gguf_name, part, cfg, arch)))
    return out


def _split_experts(hf_name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """transformers 5 keeps each layer's experts fused, gate_up_proj [experts, 2 x inter, hidden]:
    llama.cpp stores the gate and up projections as two stacked tensors."""
    if not hf_name.endswith("experts.gate_up_proj"):
        return [(hf_name, data)]
    gate, up = np.split(data, 2, axis=1)
    prefix = hf_name.removesuffix("gate_up_proj")
    return [(prefix + "gate_proj", gate), (prefix + "up_proj", up)]


def _llama_cpp_form(gguf_name: str, data: np.ndarray, cfg, arch) -> np.ndarray:
    if arch == gguf.MODEL_ARCH.LLAMA and gguf_name.endswith(("attn_q", "attn_k")):
        heads = cfg.num_attention_heads if gguf_name.endswith("attn_q") else cfg.num_key_value_heads
        data = _permute(data, heads)
    if arch in GEMMA and gguf_name.endswith("norm"):
        data = data + 1  # llama.cpp's Gemma norms multiply by w, transformers' by (1 + w)
    return np.ascontiguousarray(data.squeeze())


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved (transformers'
    GGUF loader undoes it)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
