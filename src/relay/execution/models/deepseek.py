"""DeepSeek V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): the Llama decoder layer
(RMSNorms before attention and the MLP) with multi-head latent attention (models/mla.py) and,
from layer first_k_dense_replace on, DeepSeek's mixture of experts (models/deepseek_moe.py); the
first layers have a dense MLP of intermediate_size. V2 and V3 differ in the router and in the
rope layout only (ModelConfig's fields, relay.hf_deepseek).

Neither latent attention nor a MoE block is a layer the one-call C decoder computes
(models/one_call_layers.py): the layers run one by one, their GEMMs on Relay's CPU kernels, their
norms and SiLU-and-multiply on its fused ones, their attention on the torch backend's C decode
and prompt-chunk kernels (one kv head; the decode kernel takes up to cpu_attention.MAX_GROUP
query heads a rank, more run in torch). The rotary embedding is torch's: it rotates a slice of
each head, which the C rope kernel (whole heads) does not.

V3 checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the decoder
(model.layers.{num_hidden_layers}...): transformers does not load them, nor does Relay.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from relay.execution.layers import RMSNorm, RotaryEmbedding
from relay.execution.models.deepseek_moe import DeepseekMoeBlock
from relay.execution.models.llama_layers import MLP, DecoderLayer
from relay.execution.models.mla import MlaAttention
from relay.execution.models.moe import MoeForCausalLM

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")


class DeepseekForCausalLM(MoeForCausalLM):
    def _make_rotary(self, max_positions: int) -> RotaryEmbedding:
        mc = self.config  # over the rope features only; YaRN against max_position_embeddings
        return RotaryEmbedding(
            mc.qk_rope_head_dim,
            max_positions,
            mc.rope_theta,
            mc.rope_scaling,
            1.0,
            mc.max_position_embeddings,
        )

    def _fused_rope(self) -> bool:
        return False  # see the module's docstring

    def _make_layer(self, layer_id: int) -> nn.Module:
        mc, tp, dtype = self.config, self.tp, self.dtype
        mlp = self._make_mlp(layer_id)
        return DecoderLayer(mc, tp, dtype, layer_id, mlp, RMSNorm, attention=MlaAttention)

    def _make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.is_moe_layer(layer_id):  # from first_k_dense_replace on
            return DeepseekMoeBlock(self.config, self.tp, self.dtype)
        return MLP(self.config, self.tp, self.dtype)

    def _load_one(self, name: str, w: torch.Tensor) -> str | list[str] | None:
        """DeepSeek's checkpoint names: self_attn.* to the latent attention; mlp.shared_experts.*
        as the MoE loader's shared_expert.*; the router's e_score_correction_bias; else as the MoE
        (and Llama) loaders load them."""
        m = _LAYER.fullmatch(name)
        if m is None:
            return super()._load_one(name, w)
        index, part = int(m.group(1)), m.group(2)
        if index >= len(self.layers):  # V3's multi-token-prediction layers
            return None
        prefix, layer = f"layers.{index}.", self.layers[index]
        if part.startswith("self_attn."):
            target = layer.self_attn.load(part.removeprefix("self_attn."), w)
            names = [target] if isinstance(target, str) else target
            return [prefix + "self_attn." + n for n in names]
        if part == "mlp.gate.e_score_correction_bias":
            layer.mlp.gate.e_score_correction_bias.copy_(w)
            return prefix + part
        if part.startswith("mlp.shared_experts."):
            part = "mlp.shared_expert." + part.removeprefix("mlp.shared_experts.")
        return super()._load_one(prefix + part, w)
