"""The tiny random-weight models' configs: one shape (hidden 64, 2 layers, 4 heads over 2 KV
heads, a vocabulary of TINY_VOCAB) in each architecture the tests build from transformers'
config classes; conftest's tiny_model_dir saves them as checkpoints."""

from __future__ import annotations

TINY_VOCAB = 1024


def tiny_config(arch: str):
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=TINY_VOCAB - 1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if (
        arch == "llama-fullvocab"
    ):  # text prompts tokenize into its vocabulary: a fast stand-in server model
        return LlamaConfig(
            **{**common, "vocab_size": 49152, "max_position_embeddings": 512, "eos_token_id": 2}
        )
    if arch == "llama3":  # Llama 3's rope scaling; tied embeddings like the small Llama 3.2s
        return LlamaConfig(
            **{**common, "tie_word_embeddings": True},
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32})
    # Mixtures of experts, top-2. Qwen2-MoE: a shared expert, no top-k renormalisation, and its
    # middle layer dense (mlp_only_layers); Qwen3-MoE: q/k norms and norm_topk_prob.
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**common, "head_dim": 32},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(arch)
