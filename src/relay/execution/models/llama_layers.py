"""The Llama decoder layer and its parts: attention (q/k/v fused into one GEMM, Qwen3's q/k
norms, rotary through torch or Relay's fused CPU kernel) and the SiLU-gated MLP (gate/up fused),
each split over the tensor-parallel ranks. Gemma's, OLMo 2's and the MoE models' layers build on
them; Granite's (residual_multiplier) and StarCoder 2's (LayerNorms, biases everywhere, the
ungated GELU MLP) are these with options.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from relay.config import ModelConfig
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup, head_partition, split_evenly
from relay.execution.kernels import cpu_ops
from relay.execution.layers import Linear, RMSNorm, RotaryEmbedding, StepRope, apply_rotary
from relay.execution.models.linear_slots import Slot


class Attention(nn.Module):
    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int):
        super().__init__()
        self.shard = head_partition(mc.num_heads, mc.num_kv_heads, tp.size, tp.rank)
        self.layer_id = layer_id
        self.head_dim = d = mc.head_dim
        self.num_heads, self.num_kv_heads = self.shard.q_count, self.shard.kv_count
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = Linear(mc.hidden_size, sum(self.sizes), mc.attention_bias, dtype)
        self.o_proj = Linear(self.num_heads * d, mc.hidden_size, mc.o_proj_and_mlp_bias, dtype, tp)
        self.qk_norm = mc.qk_norm
        if mc.qk_norm:
            self.q_norm = RMSNorm(d, mc.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, mc.rms_norm_eps, dtype)
        self.rotary: RotaryEmbedding | None = None  # the model's tables, for the fused CPU rotary

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        attn: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj(attention) of every row, or of the rows in keep only (every row's keys and
        values still go into the cache)."""
        t, d = x.shape[0], self.head_dim
        qkv = self.project_qkv(x)
        nq, nk = self.num_heads, self.num_kv_heads
        v = qkv[:, (nq + nk) * d :].view(t, nk, d)
        if self.rotary is not None:  # Relay's CPU kernels norm and rotate q and k in place, in qkv
            if self.qk_norm:
                qw, kw = self.q_norm.kernel_weight, self.k_norm.kernel_weight
                cpu_ops.head_norm(qkv, qw, kw, self.q_norm.eps, nq, nk, d)
            cpu_ops.rope(qkv, self.rotary.cos, self.rotary.sin, rope.positions, nq, nk, d)
            q, k = qkv[:, : nq * d].view(t, nq, d), qkv[:, nq * d : (nq + nk) * d].view(t, nk, d)
        elif self.qk_norm:
            q, k = qkv[:, : nq * d].view(t, nq, d), qkv[:, nq * d : (nq + nk) * d].view(t, nk, d)
            q, k = (
                apply_rotary(self.q_norm(q), rope.cos, rope.sin),
                apply_rotary(self.k_norm(k), rope.cos, rope.sin),
            )
        else:  # q and k sit side by side in qkv: rotate them in one pass
            q, k = apply_rotary(
                qkv[:, : (nq + nk) * d].view(t, nq + nk, d), rope.cos, rope.sin
            ).split([nq, nk], dim=1)
        out = self.attend(attn, q, k, v)
        if keep is not None:
            out = out[keep]
            if not out.shape[
                0
            ]:  # no row's output is read: its keys and values were all it had to give
                return out.new_empty(0, self.o_proj.weight.shape[0])
        return self.o_proj(out)

    def attend(
        self, attn: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The backend's attention of this layer (gpt-oss's passes its sinks)."""
        return attn.forward(q, k, v, self.layer_id)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[q | k | v] of each row, as the rotary embedding takes them (OLMo 2 norms q and k here)."""
        return self.qkv_proj(x)


class MLP(nn.Module):
    """silu(x W_gate) * (x W_up) W_down, gate/up fused into one GEMM; the intermediate features
    split over the ranks (gate/up column-parallel, down row-parallel). With reduce=False the
    caller all-reduces: a MoE block sums its experts' partial outputs first, one all-reduce for all."""

    gelu = False  # the gate's activation: silu (Gemma's GeGLU: gelu_tanh)

    def __init__(
        self,
        mc: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
        reduce: bool = True,
    ):
        super().__init__()
        self.start, self.inter = split_evenly(
            intermediate_size or mc.intermediate_size, tp.size, tp.rank
        )
        self.gate_up_proj = Linear(mc.hidden_size, 2 * self.inter, False, dtype)
        self.down_proj = Linear(self.inter, mc.hidden_size, False, dtype, tp if reduce else None)
        self.fused = False  # Relay's CPU silu-and-mul kernel (set by the model where it runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(cpu_ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def load(self, which: str, w: torch.Tensor) -> str:
        """Copy this rank's slice of a checkpoint's full gate_proj, up_proj or down_proj weight in;
        the name of the parameter it went to."""
        return self.slot(which).load(w)

    def slot(self, which: str) -> Slot | None:
        """Where this rank's slice of the checkpoint's gate_proj, up_proj or down_proj goes: its
        features' rows of gate and up (side by side in gate_up_proj), their columns of down."""
        start, n = self.start, self.inter
        mine = slice(start, start + n)
        if which == "down_proj":
            return Slot("down_proj", self.down_proj, 0, slice(None), mine)
        offset = {"gate_proj": 0, "up_proj": n}.get(which)
        return None if offset is None else Slot("gate_up_proj", self.gate_up_proj, offset, mine)


class UngatedMLP(nn.Module):
    """gelu_pytorch_tanh(x W_fc + b_fc) W_proj + b_proj (StarCoder 2's c_fc and c_proj), split over
    the ranks as the gated MLP: c_fc column-parallel, c_proj row-parallel (its bias added once)."""

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.start, self.inter = split_evenly(mc.intermediate_size, tp.size, tp.rank)
        bias = mc.o_proj_and_mlp_bias
        self.c_fc = Linear(mc.hidden_size, self.inter, bias, dtype)
        self.c_proj = Linear(self.inter, mc.hidden_size, bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    def load(self, which: str, w: torch.Tensor) -> str:
        """Copy this rank's slice of a checkpoint's c_fc or c_proj weight or bias in ("c_fc.weight",
        ...); the name of the parameter it went to."""
        module, kind = which.split(".")
        return self.slot(module).load(w, kind)

    def slot(self, which: str) -> Slot | None:
        """Where this rank's slice of c_fc (its features' rows, and their biases) or c_proj (their
        columns; its bias whole: every rank adds all of it, once, after the sum) goes."""
        mine = slice(self.start, self.start + self.inter)
        if which == "c_fc":
            return Slot("c_fc", self.c_fc, 0, mine)
        return Slot("c_proj", self.c_proj, 0, slice(None), mine) if which == "c_proj" else None


class DecoderLayer(nn.Module):
    """Norm, attention, residual add; norm, MLP, residual add (the next layer's norm adds it).
    norm: the norms' class (Llama's RMSNorm, StarCoder 2's LayerNorm); attention: the attention's
    (gpt-oss's has sinks; DeepSeek's is latent: models/mla.py), built with Llama's arguments.
    Granite scales each sublayer's output by residual_multiplier before it joins the residual
    stream."""

    def __init__(
        self,
        mc: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        layer_id: int,
        mlp: nn.Module,
        norm: type[nn.Module] = RMSNorm,
        attention: type[Attention] = Attention,
    ):
        super().__init__()
        self.input_layernorm = norm(mc.hidden_size, mc.rms_norm_eps, dtype)
        self.self_attn = attention(mc, tp, dtype, layer_id)
        self.post_attention_layernorm = norm(mc.hidden_size, mc.rms_norm_eps, dtype)
        self.mlp = mlp  # the dense MLP, or a MoE block (models/moe.py)
        self.residual_multiplier = mc.residual_multiplier

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        # multiplied before the add, as transformers' Granite: residual + h * multiplier
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRope,
        attn: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer adds them,
        fused with its norm. With keep (row indices), both only for those rows: what the last
        layer needs where only some rows' logits are read."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rope, attn, keep)
        if keep is not None:
            residual = residual[keep]
            if not h.shape[0]:
                return h, residual
        h, residual = self.post_attention_layernorm.add_and_norm(self._scaled(h), residual)
        return self._scaled(self.mlp(h)), residual
