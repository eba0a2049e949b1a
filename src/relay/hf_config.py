"""A checkpoint's config.json, as transformers writes it, read into ModelConfig's fields: the
architecture (from model_type where architectures is missing), Gemma's text configs and
rope, sliding windows per layer, soft-caps, Granite's multipliers, StarCoder 2's biases and
LayerNorm epsilon, gpt-oss's defaults and attention sinks, and the mixture-of-experts fields
(DeepSeek's, and its latent attention: relay.hf_deepseek).
"""

from __future__ import annotations

from typing import Any

from relay.hf_deepseek import DEEPSEEK, deepseek_fields
from relay.rope import rope_settings


def model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields from a checkpoint's config.json (transformers' names and defaults)."""
    arch = (cfg.get("architectures") or [_ARCH_BY_TYPE.get(cfg.get("model_type", ""), "")])[0]
    if arch == "Gemma3ForConditionalGeneration":
        cfg = gemma3_text_tower(cfg)
        arch = "Gemma3ForCausalLM"
    if arch in GEMMA or arch == "GemmaForCausalLM":
        cfg = gemma_config(arch, cfg)
    if arch == "Starcoder2ForCausalLM":
        _check_activation(arch, cfg.get("hidden_act") or "gelu_pytorch_tanh")
    if arch == GPT_OSS:
        cfg = gpt_oss_config(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = rope_settings(cfg, arch, head_dim)  # refuses a rope type Relay does not implement
    eos = cfg.get("eos_token_id")
    qkv_bias_default = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", GPT_OSS)
    # StarCoder 2 names one flag for all its biases (transformers' default: on)
    all_biases = arch == "Starcoder2ForCausalLM" and bool(cfg.get("use_bias", True))
    attention_bias = all_biases or bool(
        cfg.get("attention_bias", cfg.get("qkv_bias", qkv_bias_default))
    )
    fields = dict(
        architecture=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps")
        or cfg.get("norm_epsilon")
        or _DEFAULT_EPS.get(arch, 1e-6),
        rope_theta=rope.theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
        # Qwen2-MoE's config names its q/k/v biases qkv_bias
        attention_bias=attention_bias,
        # gpt-oss's attention_bias covers o_proj too (its experts' biases are its own)
        o_proj_and_mlp_bias=all_biases or (arch == GPT_OSS and attention_bias),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        rope_scaling=rope.scaling,
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        bos_token_id=cfg.get("bos_token_id"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        partial_rotary_factor=rope.partial_rotary_factor,
        **_granite_fields(arch, cfg),
        **_moe_fields(arch, cfg),
        **_attention_fields(arch, cfg),
    )
    if arch in DEEPSEEK:  # latent attention's pool head and softmax scale; DeepSeek's experts
        fields.update(deepseek_fields(arch, cfg, rope))
    return fields


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
GPT_OSS = "GptOssForCausalLM"
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # Gemma 1 has no soft-caps, windows or scalar
# transformers' defaults where a config.json leaves them out
_TIED_BY_DEFAULT = (*GEMMA, "GemmaForCausalLM", "Starcoder2ForCausalLM")
_DEFAULT_EPS = {"Starcoder2ForCausalLM": 1e-5, GPT_OSS: 1e-5}
# The architectures Relay runs: relay.execution.models.MODELS implements each (a test holds the two
# equal). Named here, where torch is not imported, for the launcher (relay::http, which never
# holds torch) to refuse another before any process starts.
ARCHITECTURES = (*_ARCH_BY_TYPE.values(),)


def check_architecture(architecture: str) -> None:
    """ValueError naming the architectures Relay runs, unless it runs this one."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r} (config.json architectures); "
            f"Relay runs {', '.join(sorted(ARCHITECTURES))}"
        )


# Where a config names no layer_types, which layers slide (transformers' defaults): Gemma 2
# alternates from layer 0, Gemma 3 makes every sliding_window_pattern-th layer global, Qwen2/3
# (use_sliding_window) slide from max_window_layers on, Mistral, Mixtral, Phi-3 and StarCoder 2
# slide everywhere.
_DEFAULT_LAYER_TYPES = {
    "Gemma2ForCausalLM": lambda cfg, i: (i + 1) % 2 != 0,
    GPT_OSS: lambda cfg, i: (i + 1) % 2 != 0,
    "Gemma3ForCausalLM": lambda cfg, i: (i + 1) % cfg.get("sliding_window_pattern", 6) != 0,
    "Qwen2ForCausalLM": lambda cfg, i: i >= cfg.get("max_window_layers", 28),
    "Qwen3ForCausalLM": lambda cfg, i: i >= cfg.get("max_window_layers", 28),
}


# Gemma3TextConfig's defaults: the released multimodal checkpoints' text_config names few fields.
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
    tie_word_embeddings=True,
)


def gemma3_text_tower(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config as its text tower's Gemma3ForCausalLM config (Relay
    serves text only: the model's loader skips the vision tower's weights)."""
    text = {
        **_GEMMA3_TEXT_DEFAULTS,
        **(cfg.get("text_config") or {}),
        "architectures": ["Gemma3ForCausalLM"],
    }
    for name in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if cfg.get(name) is not None and (cfg.get("text_config") or {}).get(name) is None:
            text[name] = cfg[name]
    return text


def gemma_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2/3 config.json with its rope as rope_settings reads it, after refusing by name
    what Relay does not implement. Gemma 3's rope: transformers 5 writes rope_parameters per
    layer type ({"full_attention": ..., "sliding_attention": ...}), the released checkpoints
    rope_theta, rope_scaling (the global layers') and rope_local_base_freq."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if arch == "GemmaForCausalLM" and act == "gelu":
        act = "gelu_pytorch_tanh"  # Gemma 1's released configs: transformers reads it so
    _check_activation(arch, act)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            f"config.json use_bidirectional_attention is not supported for {arch}: Relay generates "
            f"causally"
        )
    params = cfg.get("rope_parameters") or {}
    if "full_attention" not in params:
        return cfg
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not "
            f"supported; Relay rotates Gemma 3's sliding layers with the default rope"
        )
    flat = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    flat["rope_parameters"] = params["full_attention"]
    flat["rope_local_base_freq"] = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return flat


# GptOssConfig's rope where a config.json names none (the released checkpoints name it): YaRN
# stretching 4,096 positions 32 times over a base of 150,000.
_GPT_OSS_ROPE = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)


def gpt_oss_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss config.json with GptOssConfig's defaults where it leaves them out: its rope and
    rope_theta, and the head size it fixes (64) rather than hidden_size / heads."""
    cfg = dict(cfg)
    if not cfg.get("rope_scaling") and not cfg.get("rope_parameters"):
        cfg["rope_parameters"] = _GPT_OSS_ROPE
    cfg.setdefault("rope_theta", 150000.0)
    cfg.setdefault("head_dim", 64)
    return cfg


def _check_activation(arch: str, act: str) -> None:
    """ValueError naming the activation unless it is the tanh-approximated GELU Relay runs."""
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json hidden_activation {act!r} is not supported for {arch}; Relay implements "
            f"gelu_pytorch_tanh"
        )


def _granite_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (transformers' defaults: 1, which change nothing)."""
    if arch != "GraniteForCausalLM":
        return {}
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias is not supported for GraniteForCausalLM")
    return dict(
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
    )


def _attention_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's sliding windows, soft-caps and Gemma's query scalar and local rope base."""
    fields: dict[str, Any] = dict(layer_windows=_layer_windows(arch, cfg))
    if arch in GEMMA:
        fields.update(
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        )
    if arch == "Gemma3ForCausalLM":
        fields["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    if arch == GPT_OSS:
        fields["attention_sinks"] = True
    return fields


def _layer_windows(arch: str, cfg: dict[str, Any]) -> list[int | None]:
    window, layers = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if (
        not window or cfg.get("use_sliding_window") is False
    ):  # Qwen2's configs name a window they do not use
        return []
    types = cfg.get("layer_types")
    if types is None:
        slides = _DEFAULT_LAYER_TYPES.get(arch, lambda cfg, i: True)
        types = ["sliding_attention" if slides(cfg, i) else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"config.json layer_types must name sliding_attention or full_attention for each of the "
            f"{layers} layers, got {types!r}"
        )
    return [int(window) if t == "sliding_attention" else None for t in types]


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config (none for a dense architecture).
    Qwen2-MoE and Qwen3-MoE renormalise the top-k weights where norm_topk_prob says (default
    false), Mixtral always; Mixtral's experts are intermediate_size wide, Qwen's
    moe_intermediate_size. transformers 5 writes Qwen3-MoE's expert count as num_local_experts,
    the released checkpoints as num_experts."""
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            moe_renormalize=True,
            moe_float32_weights=True,
        )
    if arch == GPT_OSS:  # (older configs name the top-k experts_per_token)
        return dict(
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg.get("num_experts_per_tok") or cfg["experts_per_token"],
            moe_intermediate_size=cfg["intermediate_size"],
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return dict(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            moe_renormalize=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )
    return {}
