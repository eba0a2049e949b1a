"""The tiny random-weight models' configs: one shape (hidden 64, 2 layers, 4 heads over 2 KV
heads, a vocabulary of TINY_VOCAB) that the tests build their tiny models from, with overrides
(tiny_shape, tiny_llama_config), and that shape in each architecture conftest's tiny_model_dir
saves as checkpoints (tiny_config)."""

from __future__ import annotations

TINY_VOCAB = 1024


def tiny_shape(**overrides) -> dict:
    """The tiny models' shape as a config class's keyword arguments: hidden 64, MLP 128, 2 layers,
    4 query heads over 2 KV heads, 512 positions, TINY_VOCAB tokens whose last is the EOS, untied
    embeddings. overrides replace or add fields; the EOS stays the vocabulary's last token when
    only vocab_size is given."""
    vocab = overrides.get("vocab_size", TINY_VOCAB)
    shape = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=vocab - 1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    return {**shape, **overrides}


def tiny_llama_config(**overrides):
    """A LlamaConfig of tiny_shape(**overrides)."""
    from transformers import LlamaConfig

    return LlamaConfig(**tiny_shape(**overrides))


def tiny_config(arch: str):
    from transformers import (
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if arch == "llama":
        return tiny_llama_config()
    if (
        arch == "llama-fullvocab"
    ):  # text prompts tokenize into its vocabulary: a fast stand-in server model
        return tiny_llama_config(vocab_size=49152, max_position_embeddings=512, eos_token_id=2)
    if arch == "llama3":  # Llama 3's rope scaling; tied embeddings like the small Llama 3.2s
        return tiny_llama_config(
            tie_word_embeddings=True,
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
        return Qwen2Config(**tiny_shape())
    if arch == "qwen3":
        return Qwen3Config(**tiny_shape(head_dim=32))
    # Mixtures of experts, top-2. Qwen2-MoE: a shared expert, no top-k renormalisation, and its
    # middle layer dense (mlp_only_layers); Qwen3-MoE: q/k norms and norm_topk_prob.
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **tiny_shape(num_hidden_layers=3),
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **tiny_shape(head_dim=32),
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    if arch == "mixtral":
        return MixtralConfig(**tiny_shape(), num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(arch)
