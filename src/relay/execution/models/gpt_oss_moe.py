"""gpt-oss's mixture of experts (transformers' GptOssMLP): what differs from Qwen's and Mixtral's
(models/moe.py, whose grouped expert loop it shares):

- the router has a bias, and picks the top-k of its logits before it softmaxes them (over those k
  only), in the activations' dtype;
- every expert has biases, and its activation is a clamped SwiGLU: the gate clamped to at most
  limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate);
- the checkpoint fuses gate and up into one tensor with their features interleaved (gate at the
  even rows, up at the odd), transformers 5 transposed in memory, and the released checkpoints
  store the expert weights in MXFP4 (relay.execution.mxfp4: dequantized at load).

Split over tensor-parallel ranks as the other MoE models: the router replicated, each expert's
intermediate features split (gate/up rows, down columns), one all-reduce per block after its
experts' partial sums. The down projection's bias is held by rank 0 alone (zeros elsewhere), so
the sum over ranks adds it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from relay.config import ModelConfig
from relay.execution.distributed import TPGroup, split_evenly
from relay.execution.layers import Linear
from relay.execution.models.moe import RoutedExperts


class GptOssRouter(nn.Module):
    """The [num_experts, hidden] router weight and its bias (replicated on every rank)."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype), requires_grad=False)


class GptOssExpert(nn.Module):
    """One expert: [gate | up] = x W_gate_up + b (de-interleaved at load), the clamped SwiGLU, then
    W_down + b_down; this rank's slice of its intermediate features."""

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.start, self.inter = split_evenly(mc.moe_intermediate_size, tp.size, tp.rank)
        self.rank = tp.rank
        self.gate_up_proj = Linear(mc.hidden_size, 2 * self.inter, True, dtype)
        self.down_proj = Linear(self.inter, mc.hidden_size, True, dtype)  # the block all-reduces
        self.alpha, self.limit = mc.swiglu_alpha, mc.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        # transformers' GptOssExperts._apply_gate, op for op
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down_proj((up + 1) * glu)

    def load_gate_up(self, w: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        """This rank's gate and up features of the expert's fused [2 x inter, hidden] weight and
        [2 x inter] bias, interleaved as the checkpoint has them (either may be None)."""
        n, s = self.inter, self.start
        for full, dest in ((w, self.gate_up_proj.weight), (bias, self.gate_up_proj.bias)):
            if full is not None:
                dest[:n].copy_(full[0::2][s : s + n])  # gate: the even rows
                dest[n:].copy_(full[1::2][s : s + n])  # up: the odd rows

    def load_down(self, w: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        """This rank's columns of the expert's [hidden, inter] down weight; its [hidden] bias on
        rank 0 only (the all-reduce then adds it once)."""
        if w is not None:
            self.down_proj.weight.copy_(w[:, self.start : self.start + self.inter])
        if bias is not None:
            self.down_proj.bias.copy_(bias if self.rank == 0 else torch.zeros_like(bias))


class GptOssMoeBlock(RoutedExperts):
    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.top_k = mc.num_experts_per_tok
        self.router = GptOssRouter(mc.num_experts, mc.hidden_size, dtype)
        self.experts = nn.ModuleList(GptOssExpert(mc, tp, dtype) for _ in range(mc.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return self.tp.all_reduce(self.experts_output(x, weights, experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights and expert ids [tokens, k], as GptOssTopKRouter: the
        top-k logits (with the bias), softmaxed over those k, in the activations' dtype."""
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts
