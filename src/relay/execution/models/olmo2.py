"""OLMo 2 (Olmo2ForCausalLM): Llama's attention and MLP with the norms moved.

- no norm before attention or the MLP: each sublayer reads the residual stream itself, and its
  output is RMS-normalised (post_attention_layernorm, post_feedforward_layernorm) before it joins
  the stream;
- q and k are RMS-normalised over the whole projection (all heads at once, one weight of
  heads x head_dim), before the rotary embedding. Split over tensor-parallel ranks, that norm's
  mean of squares is summed over the ranks.

Neither is a layer the one-call C decoder computes (models/one_call_layers.py): OLMo 2 runs its
layers one by one, on Relay's CPU norm and rotary kernels where they run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from relay.config import ModelConfig
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup
from relay.execution.layers import RMSNorm, StepRope
from relay.execution.models.llama import LlamaForCausalLM
from relay.execution.models.llama_layers import MLP, Attention


class ProjectionNorm(nn.Module):
    """RMSNorm over a projection whose features are split over the ranks: this rank's slice of
    the weight, the mean of squares taken over every rank's features."""

    def __init__(self, local_dim: int, eps: float, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # in float32 bit for bit transformers' Olmo2RMSNorm
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        # each rank's sum of squares and feature count (kv heads copied to several ranks count
        # once per copy in both, which leaves the mean as it is)
        sums = torch.stack([x32.pow(2).sum(-1), torch.full_like(x32[:, 0], x32.shape[-1])], dim=-1)
        sums = self.tp.all_reduce(sums.contiguous())
        mean_square = (sums[:, 0] / sums[:, 1]).unsqueeze(-1)
        return (self.weight.float() * x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class Olmo2Attention(Attention):
    """Llama's attention with q and k normalised over their whole projections."""

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int):
        super().__init__(mc, tp, dtype, layer_id)
        q_size, k_size = self.sizes[0], self.sizes[1]
        self.q_norm = ProjectionNorm(q_size, mc.rms_norm_eps, dtype, tp)
        self.k_norm = ProjectionNorm(k_size, mc.rms_norm_eps, dtype, tp)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_end, k_end = self.sizes[0], self.sizes[0] + self.sizes[1]
        qkv[:, :q_end] = self.q_norm(qkv[:, :q_end])
        qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end])
        return qkv


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int):
        super().__init__()
        self.self_attn = Olmo2Attention(mc, tp, dtype, layer_id)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype)
        self.mlp = MLP(mc, tp, dtype)
        self.post_feedforward_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRope,
        attn: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's layer protocol: (the normed MLP output, the residual stream before it), which
        the next layer (or the final norm) adds; with keep, of those rows only."""
        if residual is not None:
            x = x + residual
        h = self.self_attn(x, rope, attn, keep)
        if keep is not None:
            x = x[keep]
            if not h.shape[0]:
                return h, x
        x = x + self.post_attention_layernorm(h)
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    def _make_layer(self, layer_id: int) -> nn.Module:
        return Olmo2DecoderLayer(self.config, self.tp, self.dtype, layer_id)

    def _load_one(self, name: str, w: torch.Tensor) -> str | list[str] | None:
        """Llama's loader, and this rank's heads' slice of the q/k norm weights."""
        parts = name.removeprefix("model.").split(".")
        if len(parts) != 5 or parts[3] not in ("q_norm", "k_norm"):
            return super()._load_one(name, w)
        attn: Olmo2Attention = self.layers[int(parts[1])].self_attn
        d, sh = self.config.head_dim, attn.shard
        start, count = (
            (sh.q_start, sh.q_count) if parts[3] == "q_norm" else (sh.kv_start, sh.kv_count)
        )
        getattr(attn, parts[3]).weight.copy_(w[start * d : (start + count) * d])
        return ".".join(parts[:-1] + ["weight"])
