"""DeepSeek V2/V3's mixture of experts: models/moe.py's SparseMoeBlock (experts grouped per step,
summed in ascending expert order, one all-reduce) with DeepSeek's router and its shared experts
added ungated.

The router, as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter, in float32 whatever the
model's dtype (its weight is kept float32, as transformers keeps gate.weight):
- V2 "greedy": softmax over the experts, top-k;
- V2 "group_limited_greedy": the experts in moe_n_group groups, each scored by its best expert's
  probability; the top-k among the moe_topk_group best groups' experts (the others' scores 0);
- V3 "noaux_tc": sigmoid scores; the choice reads scores + e_score_correction_bias, a group
  scored by its best two experts' biased scores; the top-k among the best groups' experts
  (the others -inf), weighted by their unbiased scores, renormalised (+ 1e-20) where
  norm_topk_prob.
Then every weight times routed_scaling_factor. Weights stay float32 when they scale the
experts' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from relay.config import ModelConfig
from relay.execution.distributed import TPGroup
from relay.execution.models.moe import SparseMoeBlock


class DeepseekRouter(nn.Module):
    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.top_k, self.method = mc.num_experts_per_tok, mc.moe_routing
        self.groups, self.topk_groups = mc.moe_n_group, mc.moe_topk_group
        self.renormalize, self.scaling = mc.moe_renormalize, mc.routed_scaling_factor
        experts = mc.num_experts
        self.weight = nn.Parameter(
            torch.empty(experts, mc.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = None
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights (float32) and expert ids [tokens, k]."""
        logits = F.linear(x.float(), self.weight)
        if self.method == "noaux_tc":
            weights, experts = self._noaux_tc(logits.sigmoid())
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                best = scores.view(scores.shape[0], self.groups, -1).max(dim=-1).values
                scores = scores.masked_fill(~self._experts_in_best_groups(best), 0.0)
            weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, experts

    def _noaux_tc(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = scores + self.e_score_correction_bias
        best_two = choice.view(choice.shape[0], self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._experts_in_best_groups(best_two), float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, experts

    def _experts_in_best_groups(self, group_scores: torch.Tensor) -> torch.Tensor:
        """bool [tokens, experts]: whether an expert's group is among the token's topk_groups best."""
        best = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
        chosen = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        return chosen.repeat_interleave(self.weight.shape[0] // self.groups, dim=1)


class DeepseekMoeBlock(SparseMoeBlock):
    """Routed experts (each an MLP of moe_intermediate_size) plus the shared experts (one MLP of
    n_shared_experts x moe_intermediate_size, ModelConfig.shared_expert_intermediate_size) that
    every token takes, their sum all-reduced once."""

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__(mc, tp, dtype)
        self.gate = DeepseekRouter(mc)
        self.shared_expert_gate = None  # DeepSeek adds its shared experts' output as it is

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self.experts_output(x, weights, experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.tp.all_reduce(out)
