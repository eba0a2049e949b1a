"""DeepSeek V2 / V3's config.json (DeepseekV2Config, DeepseekV3Config: transformers' names and
defaults) read into ModelConfig's fields: multi-head latent attention, its softmax scale, and
the mixture of experts with shared experts, grouped routing and dense first layers.

Where the released checkpoints' configs and transformers disagree, Relay computes what
transformers does: V2 routes with a softmax (greedy or group_limited_greedy) and never
renormalises its top-k weights (norm_topk_prob is read by V3 only); V3 always routes as
noaux_tc (sigmoid, e_score_correction_bias), whatever topk_method or scoring_func say.
"""

from __future__ import annotations

from typing import Any

from relay.rope import RopeSettings, yarn_mscale

DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

# transformers' defaults, for the fields a config.json may leave out
_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        moe_intermediate_size=1407,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        n_group=None,
        topk_group=None,
    ),
    "DeepseekV3ForCausalLM": dict(
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
}
_V2_ROUTINGS = ("greedy", "group_limited_greedy")


def deepseek_fields(arch: str, cfg: dict[str, Any], rope: RopeSettings) -> dict[str, Any]:
    """ModelConfig's fields that a DeepSeek config sets beyond (or in place of) the Llama ones."""
    c = {**_DEFAULTS[arch], **{k: v for k, v in cfg.items() if k in _DEFAULTS[arch]}}
    _refuse_what_is_not_implemented(arch, cfg, c)
    rank, rope_dim = c["kv_lora_rank"], c["qk_rope_head_dim"]
    if rope_dim % 2:
        raise ValueError(f"config.json qk_rope_head_dim must be even, got {rope_dim}")
    return dict(
        # the pool's one head: the latent and the rotated key part (ModelConfig.latent_kv)
        num_kv_heads=1,
        head_dim=rank + rope_dim,
        attention_multiplier=softmax_scale(
            c["qk_nope_head_dim"] + rope_dim, rope, cfg.get("max_position_embeddings", 2048)
        ),
        kv_lora_rank=rank,
        q_lora_rank=c["q_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=rope_dim,
        v_head_dim=c["v_head_dim"],
        # V2 rotates pairs of neighbours (its complex product); V3 as rope_interleave says
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(c["rope_interleave"]),
        **_moe_fields(arch, cfg, c),
    )


def softmax_scale(qk_head_dim: int, rope: RopeSettings, max_position_embeddings: int) -> float:
    """What q.k is multiplied by: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim)
    squared where a scaled rope names mscale_all_dim (transformers' yarn_apply_mscale: MLA scales
    the scores of the unrotated features too, not only the rotated ones through the tables)."""
    scale = qk_head_dim**-0.5
    s = rope.scaling or {}
    if s.get("mscale_all_dim"):
        factor = s.get("factor") or max_position_embeddings / s["original_max_position_embeddings"]
        mscale = yarn_mscale(factor, s["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _moe_fields(arch: str, cfg: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    experts = c["n_routed_experts"]
    v3 = arch == "DeepseekV3ForCausalLM"
    routing = "noaux_tc" if v3 else c["topk_method"]
    grouped = routing != "greedy"
    groups, topk_groups = (c["n_group"], c["topk_group"]) if grouped else (1, 1)
    if grouped and (not groups or not topk_groups or experts % groups or topk_groups > groups):
        raise ValueError(
            f"config.json n_group {groups} / topk_group {topk_groups} must group the "
            f"{experts} experts evenly ({routing} routing)"
        )
    if v3 and experts // groups < 2:  # noaux_tc scores a group by its best two experts
        raise ValueError(f"config.json n_group {groups} leaves fewer than 2 experts a group")
    top_k = cfg.get("num_experts_per_tok") or c.get("num_experts_per_tok")
    if not top_k:
        raise ValueError("config.json num_experts_per_tok is required")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=c["moe_intermediate_size"],
        moe_renormalize=v3 and bool(c["norm_topk_prob"]),
        moe_float32_weights=True,  # routing weights stay float32, as transformers' router's
        shared_expert_intermediate_size=c["moe_intermediate_size"] * (c["n_shared_experts"] or 0),
        decoder_sparse_step=1,
        mlp_only_layers=list(range(c["first_k_dense_replace"] or 0)),
        moe_routing=routing,
        moe_n_group=groups,
        moe_topk_group=topk_groups,
        routed_scaling_factor=float(c["routed_scaling_factor"]),
    )


def _refuse_what_is_not_implemented(arch: str, cfg: dict[str, Any], c: dict[str, Any]) -> None:
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise ValueError(
            f"config.json hidden_act {act!r} is not supported for {arch}; Relay implements silu"
        )
    if cfg.get("mlp_bias"):
        raise ValueError(f"config.json mlp_bias is not supported for {arch}")
    if arch == "DeepseekV2ForCausalLM" and c["topk_method"] not in _V2_ROUTINGS:
        raise ValueError(
            f"config.json topk_method {c['topk_method']!r} is not supported for {arch}; "
            f"transformers' and Relay's DeepSeek V2 route with {' or '.join(_V2_ROUTINGS)}"
        )
