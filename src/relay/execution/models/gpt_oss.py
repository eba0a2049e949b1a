"""gpt-oss (GptOssForCausalLM): the Llama decoder with, in each layer,

- attention sinks: a learned logit per query head that joins every softmax's denominator and
  attends no value (the attention backend's to apply: only the torch one does, on CPU in Relay's
  C decode and prompt-chunk kernels);
- sliding-window (sliding_window, e.g. 128) and full attention alternating (layer_types; from
  layer 0 by default), with biases on q, k, v and o;
- a mixture of experts of its own (models/gpt_oss_moe.py: the router's bias and top-k-then-softmax,
  the experts' biases and clamped SwiGLU), stored in MXFP4 in the released checkpoints;
- YaRN rope (relay.rope; config defaults in relay.hf_config.gpt_oss_config).

Half its layers attend the whole context, so no KV page is freed behind the window (as Gemma 2:
ModelConfig.kv_window). Its steps run layer by layer: the one-call C decoder layers know dense
MLPs and no sinks. Its chat format is harmony (relay.api.tool_parsers.harmony, picked for this
architecture where the chat template does not say).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from relay.config import ModelConfig
from relay.execution import mxfp4
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup
from relay.execution.models.gpt_oss_moe import GptOssExpert, GptOssMoeBlock
from relay.execution.models.llama import LlamaForCausalLM
from relay.execution.models.llama_layers import Attention, DecoderLayer


class GptOssAttention(Attention):
    """Llama's attention (q/k/v/o biases: ModelConfig flags) with this rank's heads' sinks."""

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int):
        super().__init__(mc, tp, dtype, layer_id)
        # float32 whatever the model's dtype: the kernels read them so, and a checkpoint's
        # bfloat16 values are exact in it
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)

    def attend(
        self, attn: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return attn.forward(q, k, v, self.layer_id, sinks=self.sinks)


# A layer's expert tensors: transformers' in-memory (and bfloat16 checkpoints') gate_up_proj
# [experts, hidden, 2 x inter] and down_proj [experts, inter, hidden], their biases, and the
# released checkpoints' MXFP4 *_blocks / *_scales ([experts, out, in] once dequantized).
_EXPERTS = re.compile(
    r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)"
)
_ROUTER = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.router\.(weight|bias)")
_SINKS = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.sinks")


class GptOssForCausalLM(LlamaForCausalLM):
    supports_cuda_graph = False  # which experts run, and on how many rows, depends on the tokens

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_positions: int):
        super().__init__(mc, tp, dtype, max_positions)
        # An MXFP4 tensor's blocks, held until its scales arrive (or the other way round).
        self._mxfp4_halves: dict[str, torch.Tensor] = {}

    def _make_layer(self, layer_id: int) -> nn.Module:
        moe = GptOssMoeBlock(self.config, self.tp, self.dtype)
        return DecoderLayer(
            self.config, self.tp, self.dtype, layer_id, moe, attention=GptOssAttention
        )

    def use_decode_layers(self, attn: AttentionBackend) -> bool:
        """Never: the one-call C decoder layers know dense MLPs and no sinks (every rank alike)."""
        return False

    def use_prompt_layers(self, attn: AttentionBackend) -> bool:
        """Never, as use_decode_layers."""
        return False

    def _load_one(self, name: str, w: torch.Tensor) -> str | list[str] | None:
        """Sinks (this rank's heads), the router and the experts; the rest as Llama's loader."""
        if m := _SINKS.fullmatch(name):
            attn: GptOssAttention = self.layers[int(m.group(1))].self_attn
            attn.sinks.copy_(w[attn.shard.q_start : attn.shard.q_start + attn.shard.q_count])
            return f"layers.{m.group(1)}.self_attn.sinks"
        if m := _ROUTER.fullmatch(name):
            getattr(self.layers[int(m.group(1))].mlp.router, m.group(2)).copy_(w)
            return f"layers.{m.group(1)}.mlp.router.{m.group(2)}"
        if m := _EXPERTS.fullmatch(name):
            return self._load_experts(int(m.group(1)), m.group(2), m.group(3), w)
        return super()._load_one(name, w)

    def _load_experts(self, layer: int, proj: str, kind: str, w: torch.Tensor) -> list[str]:
        """Every expert's share of one of a layer's expert tensors; the parameters it filled."""
        if kind in ("_blocks", "_scales"):
            key = f"{layer}.{proj}"
            other = self._mxfp4_halves.pop(key, None)
            if other is None:
                self._mxfp4_halves[key] = w  # the other half comes later
                return []
            blocks, scales = (w, other) if kind == "_blocks" else (other, w)
            return self._load_expert_weights(layer, proj, blocks, scales)
        if kind == "":  # transformers' [experts, in, out]: each expert's [out, in] is its transpose
            return self._load_expert_weights(layer, proj, w.transpose(1, 2))
        experts: list[GptOssExpert] = self.layers[layer].mlp.experts
        for expert, b in zip(experts, w):
            load = expert.load_gate_up if proj == "gate_up_proj" else expert.load_down
            load(None, b)
        return [f"layers.{layer}.mlp.experts.{e}.{proj}.bias" for e in range(len(experts))]

    def _load_expert_weights(
        self,
        layer: int,
        proj: str,
        w: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> list[str]:
        """Each expert's [out, in] weight from w [experts, out, in], or from MXFP4 blocks w and
        scales, dequantized an expert at a time (a released checkpoint's float32 layer would be
        2 GB at once)."""
        experts: list[GptOssExpert] = self.layers[layer].mlp.experts
        for e, expert in enumerate(experts):
            weight = w[e] if scales is None else mxfp4.dequantize(w[e], scales[e], self.dtype)
            load = expert.load_gate_up if proj == "gate_up_proj" else expert.load_down
            load(weight, None)
        return [f"layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(len(experts))]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._paired(weights))

    def _paired(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """weights, then a refusal if an MXFP4 tensor lacked its other half: named before the
        loader's list of missing parameters, which would not say why."""
        yield from weights
        if self._mxfp4_halves:
            raise ValueError(
                "checkpoint has MXFP4 blocks without their scales (or scales without blocks) "
                f"for layer.tensor {sorted(self._mxfp4_halves)}"
            )
