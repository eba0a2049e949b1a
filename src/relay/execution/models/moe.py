"""Mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE and Mixtral.

Attention is the Llama family's (Qwen2-MoE's q/k/v biases, Qwen3-MoE's q/k norms: config
flags); a sparse layer's feed-forward block is a SparseMoeBlock. Its router is replicated on
every rank; each expert is an MLP whose intermediate features split over the ranks as the dense
MLP's do, and the block all-reduces once, after it has summed its experts' (and its shared
expert's) partial outputs: the routing weights and the shared expert's gate scale whole rows,
so they commute with the sum over ranks.

On CPU a step's tokens are grouped by expert: one GEMM per expert that has tokens (through
Linear, so the packed, bfloat16 GEMV and quantized paths apply to expert weights too), none for
the others. That data-dependent work is why a MoE model does not capture CUDA graphs, and why
the one-call C decoder layers (use_decode_layers / use_prompt_layers, which know dense MLPs
only) are not used for it: its steps run layer by layer. On CUDA, with Triton installed, the
experts run as two grouped GEMMs (kernels/triton_moe.py: checked under Triton's interpreter
only, never yet on a GPU).
"""

from __future__ import annotations

import importlib.util
import re

import torch
import torch.nn.functional as F
from torch import nn

from relay.config import ModelConfig
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup
from relay.execution.models.llama import LlamaForCausalLM
from relay.execution.models.llama_layers import MLP


class Router(nn.Module):
    """The [num_experts, hidden] gate weight (replicated: every rank routes every token)."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False
        )


class RoutedExperts(nn.Module):
    """What every sparse block does with its routing: each token's top_k experts (self.experts)
    run on it and their outputs sum, scaled by the routing weights (the rank's partial sums)."""

    top_k: int
    experts: nn.ModuleList

    def experts_output(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(token): this rank's partial sums.
        The (token, slot) pairs are sorted by expert, so each expert with tokens runs one GEMM over
        its tokens' rows and adds them back, scaled, into their tokens' rows; experts ascending,
        as transformers adds them (the same sums in the same order)."""
        if x.shape[0] == 1:
            return self._one_token_output(x, weights, experts)
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        scales = weights.flatten().index_select(0, order).unsqueeze(1)
        counts = torch.bincount(
            flat, minlength=len(self.experts)
        ).tolist()  # the step's one host sync
        end = 0
        for expert, n in zip(self.experts, counts):
            if not n:
                continue
            start, end = end, end + n
            rows = tokens[start:end]
            y = expert(x.index_select(0, rows)) * scales[start:end]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _one_token_output(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """experts_output of a single token (a batch-1 decode step): its k experts on x itself, no
        sort, gather or scatter. Summed in ascending expert order from the first term (0 + a is a
        exactly), so the bits are the grouped path's."""
        out = None
        for slot, e in sorted(enumerate(experts[0].tolist()), key=lambda pair: pair[1]):
            y = (self.experts[e](x) * weights[:, slot : slot + 1]).to(x.dtype)
            out = y if out is None else out + y
        return out


class SparseMoeBlock(RoutedExperts):
    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.top_k = mc.num_experts_per_tok
        self.renormalize = mc.moe_renormalize
        self.float32_weights = mc.moe_float32_weights
        self.gate = Router(mc.num_experts, mc.hidden_size, dtype)
        self.experts = nn.ModuleList(
            MLP(mc, tp, dtype, mc.moe_intermediate_size, reduce=False)
            for _ in range(mc.num_experts)
        )
        # On CUDA: the Triton grouped GEMMs over the experts' weights stacked [experts, out, in]
        # (stack_experts, on first use; the per-expert weights become views into the stacks).
        self.use_triton = (
            self.gate.weight.is_cuda and importlib.util.find_spec("triton") is not None
        )
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_expert = self.shared_expert_gate = None
        if mc.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                mc, tp, dtype, mc.shared_expert_intermediate_size, reduce=False
            )
            self.shared_expert_gate = Router(1, mc.hidden_size, dtype)

    @property
    def fused(self) -> bool:
        return self.experts[0].fused

    @fused.setter
    def fused(self, on: bool) -> None:  # the model's use_cpu_kernels sets every layer's mlp.fused
        for mlp in self.mlps():
            mlp.fused = on

    def mlps(self) -> list[MLP]:
        return list(self.experts) + ([self.shared_expert] if self.shared_expert is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self.experts_output(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(
                F.linear(x, self.shared_expert_gate.weight)
            ) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and expert ids [tokens, k], computed as transformers
        does: logits in the activations' dtype, softmax in float32, top-k, renormalised over the
        top-k where configured, then (Qwen) cast back to the activations' dtype."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), experts

    def experts_output(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        if self.use_triton:
            return self._triton_output(x, weights, experts)
        return super().experts_output(x, weights, experts)

    def _triton_output(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        from relay.execution.kernels.triton_moe import fused_experts

        if self._stacked is None:
            self._stacked = self.stack_experts()
        return fused_experts(x, *self._stacked, weights, experts)

    def stack_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' gate/up [experts, 2 x inter, hidden] and down [experts, hidden, inter]
        weights as two tensors; each expert's Linear weights become views into them (no second
        copy)."""
        gate_up = torch.stack([e.gate_up_proj.weight for e in self.experts])
        down = torch.stack([e.down_proj.weight for e in self.experts])
        for i, e in enumerate(self.experts):
            e.gate_up_proj.weight.data, e.down_proj.weight.data = gate_up[i], down[i]
        return gate_up, down


class MoeForCausalLM(LlamaForCausalLM):
    supports_cuda_graph = False  # which experts run, and on how many rows, depends on the tokens

    def _make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.is_moe_layer(layer_id):
            return SparseMoeBlock(self.config, self.tp, self.dtype)
        return MLP(self.config, self.tp, self.dtype)

    def use_decode_layers(self, attn: AttentionBackend) -> bool:
        """Never: the one-call C decoder layers know dense MLPs only (every rank says so alike)."""
        return False

    def use_prompt_layers(self, attn: AttentionBackend) -> bool:
        """Never, as use_decode_layers."""
        return False

    def _load_one(self, name: str, w: torch.Tensor) -> str | list[str] | None:
        """Expert weights under HF's names, else as the Llama family loads: Qwen's
        mlp.experts.{e}.{gate,up,down}_proj, mlp.gate, mlp.shared_expert(_gate); Mixtral's
        block_sparse_moe.experts.{e}.w1/w3/w2 (gate/up/down) and block_sparse_moe.gate; and the
        fused 3-D mlp.experts.gate_up_proj [experts, 2 x inter, hidden] / down_proj
        [experts, hidden, inter] that transformers 5 holds in memory."""
        m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)", name)
        if m is None or not isinstance(self.layers[int(m.group(1))].mlp, SparseMoeBlock):
            return super()._load_one(name, w)
        prefix = f"layers.{m.group(1)}.mlp."
        block: SparseMoeBlock = self.layers[int(m.group(1))].mlp
        part = m.group(2)
        if part in ("gate.weight", "shared_expert_gate.weight"):
            block.get_submodule(part.split(".")[0]).weight.copy_(w)
            return prefix + part
        e = re.fullmatch(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight", part)
        if e is not None:
            which = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(
                e.group(2), e.group(2)
            )
            return prefix + f"experts.{e.group(1)}." + block.experts[int(e.group(1))].load(which, w)
        s = re.fullmatch(r"shared_expert\.(gate_proj|up_proj|down_proj)\.weight", part)
        if s is not None and block.shared_expert is not None:
            return prefix + "shared_expert." + block.shared_expert.load(s.group(1), w)
        if part in ("experts.gate_up_proj", "experts.down_proj"):
            return [
                prefix + f"experts.{i}." + self._load_fused(expert, part, w[i])
                for i, expert in enumerate(block.experts)
            ]
        raise ValueError(f"unexpected checkpoint tensor {name!r}")

    @staticmethod
    def _load_fused(expert: MLP, part: str, w: torch.Tensor) -> str:
        """One expert's slice of a fused 3-D expert tensor: [2 x inter, hidden] gate then up, or
        [hidden, inter] down."""
        if part == "experts.down_proj":
            return expert.load("down_proj", w)
        gate, up = w.chunk(2, dim=0)
        expert.load("gate_proj", gate)
        return expert.load("up_proj", up)
