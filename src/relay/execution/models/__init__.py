"""Model registry: config.json's `architectures[0]` -> the class that implements it."""

from __future__ import annotations

from torch import nn

from relay.execution.models.deepseek import DeepseekForCausalLM
from relay.execution.models.gemma import GemmaForCausalLM
from relay.execution.models.gpt_oss import GptOssForCausalLM
from relay.execution.models.llama import LlamaForCausalLM, Starcoder2ForCausalLM
from relay.execution.models.moe import MoeForCausalLM
from relay.execution.models.olmo2 import Olmo2ForCausalLM
from relay.execution.models.phi3 import Phi3ForCausalLM
from relay.hf_config import check_architecture

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # with sliding_window (ModelConfig.layer_windows)
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,  # its multipliers: ModelConfig's fields
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,  # attention sinks, its MoE, MXFP4 experts
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,  # latent attention (models/mla.py), MoE
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,  # V2's with its router (ModelConfig.moe_routing)
}


def model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    return MODELS[architecture]
