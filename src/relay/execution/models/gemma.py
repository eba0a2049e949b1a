"""Gemma 1, 2 and 3, text only (GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, and the
text tower of Gemma3ForConditionalGeneration).

What Gemma 1 changes in the Llama decoder: the (1 + w) norms, the scaled embedding and GeGLU
below, and head_dim may differ from hidden_size / heads; its layers have Llama's two norms.
What Gemma 2 and 3 change besides:
- every RMSNorm scales by (1 + w), in float32 before casting back (GemmaRMSNorm);
- the embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- the MLP is GeGLU: gelu_pytorch_tanh(x W_gate) * (x W_up) W_down;
- four norms a layer: before and after attention, before and after the MLP, each output
  normalised before it joins the residual stream;
- scores scale by query_pre_attn_scalar ** -0.5 (ModelConfig.attention_scale);
- Gemma 2: attention scores and the final logits soft-capped (cap * tanh(x / cap)); sliding-window
  attention on every other layer (from layer 0);
- Gemma 3: q and k normalised per head (a Gemma norm) before the rotary embedding; five sliding
  layers to one global (layer_types / sliding_window_pattern); the sliding layers rotate with
  rope_local_base_freq and the default rope, the global ones with rope_theta and rope_scaling.

Windows and soft-capped scores are the attention backend's to apply (ModelConfig.layer_windows,
attn_logit_softcap: only the torch backend does, on CPU in Relay's C attention kernels). A float32
model on CPU runs its norms (weights 1 + w, folded once), q/k norms, rotary and GeGLU in Relay's C
kernels, the ones the one-call C decoder layers (models/one_call_layers.py) run too, so a decode
step whose GEMMs read GGUF blocks runs in one C call, bit for bit as its layers one by one.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from relay.config import ModelConfig
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup
from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import cpu_ops
from relay.execution.layers import RotaryEmbedding, StepRope
from relay.execution.models.linear_slots import Slot
from relay.execution.models.llama import LlamaForCausalLM
from relay.execution.models.llama_layers import MLP, Attention


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) computed in float32, then cast to x's dtype (transformers' Gemma
    norms; Llama's casts before it scales by w). The checkpoint's w is kept as it is."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.folded: torch.Tensor | None = None  # 1 + w for Relay's CPU kernel (use_kernel)

    def use_kernel(self) -> None:
        """Norm float32 rows with Relay's CPU kernel, its weight 1 + w computed once (in float32,
        as transformers computes it: the same values)."""
        self.folded = 1.0 + self.weight.float()

    @property
    def kernel_weight(self) -> torch.Tensor:
        assert self.folded is not None, "use_kernel first"
        return self.folded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded is not None:
            return cpu_ops.rms_norm(x.contiguous(), self.folded, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """Llama's attention with Gemma norms on q and k where the model has them (Gemma 3)."""

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int):
        super().__init__(mc, tp, dtype, layer_id)
        if mc.qk_norm:
            self.q_norm = GemmaRMSNorm(mc.head_dim, mc.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(mc.head_dim, mc.rms_norm_eps, dtype)


class GeGluMLP(MLP):
    """gelu_pytorch_tanh(x W_gate) * (x W_up) W_down, split over the ranks as Llama's MLP."""

    gelu = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(cpu_ops.gelu_tanh_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3's layer (sandwich: norms before and after attention and the MLP), or Gemma 1's:
    Llama's two norms, post_attention_layernorm the one before the MLP (the checkpoints' names)."""

    def __init__(
        self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int, sandwich: bool
    ):
        super().__init__()
        self.sandwich = sandwich
        self.input_layernorm = GemmaRMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype)
        self.self_attn = GemmaAttention(mc, tp, dtype, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype)
        if sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype)
        self.mlp = GeGluMLP(mc, tp, dtype)
        if sandwich:
            self.post_feedforward_layernorm = GemmaRMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        attn: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream after this layer; with keep (row indices), of those rows only
        (every row's keys and values still go into the cache)."""
        h = self.self_attn(self.input_layernorm(x), rope, attn, keep)
        if keep is not None:
            x = x[keep]
            if not h.shape[0]:
                return h
        if not self.sandwich:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


# A Gemma3ForConditionalGeneration checkpoint's names: its text tower's under a prefix (as
# released, and as transformers 5 saves it; "model.language_model." as it holds it in memory),
# the vision tower's and projector's, which Relay (text only) does not load.
_TEXT_TOWER = re.compile(r"(?:language_model\.|model\.language_model\.)(.*)")
_VISION = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..*")


class GemmaForCausalLM(LlamaForCausalLM):
    Norm = GemmaRMSNorm

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_positions: int):
        super().__init__(mc, tp, dtype, max_positions)
        self.local_rotary = self.rotary  # the sliding layers' rope: Gemma 3's has its own base
        if mc.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                mc.head_dim, max_positions, mc.local_rope_theta, None
            )
        self.sliding = [w is not None for w in mc.layer_windows] or [False] * mc.num_layers

    def _make_layer(self, layer_id: int) -> nn.Module:
        sandwich = self.config.architecture != "GemmaForCausalLM"  # Gemma 2 and 3
        return GemmaDecoderLayer(self.config, self.tp, self.dtype, layer_id, sandwich)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, of every token or of the given rows (as Llama's)."""
        t = input_ids.shape[0]
        keep = None
        if rows is not None and len(rows) != t:
            keep = torch.tensor(rows, dtype=torch.int64, device=input_ids.device)
        hidden = self._decode_in_one_call(
            input_ids, positions, attn, rows if keep is not None else None
        )
        if hidden is not None:
            return hidden
        fused = self.fused_cpu_ops  # the layers' attention rotates with its own tables
        ropes = {False: self.rotary.for_step(positions, self.dtype, fused=fused)}
        ropes[True] = (
            ropes[False]
            if self.local_rotary is self.rotary
            else self.local_rotary.for_step(positions, self.dtype, fused=fused)
        )
        x = self.embed(input_ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes[self.sliding[i]], attn, keep if i == last else None)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # transformers rounds sqrt(hidden) to the model's dtype before it scales the embedding
        return self.embed_tokens(input_ids) * torch.tensor(
            self.config.hidden_size**0.5, dtype=self.dtype
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _load_one(self, name: str, w: torch.Tensor) -> str | None:
        if _VISION.fullmatch(name):
            return None
        tower = _TEXT_TOWER.fullmatch(name)
        return super()._load_one(tower.group(1) if tower else name, w)

    def linear_slots(self, name: str) -> list[Slot] | None:
        """Llama's, under the text tower's names too (Gemma 3's multimodal checkpoints)."""
        tower = _TEXT_TOWER.fullmatch(name)
        return super().linear_slots(tower.group(1) if tower else name)

    def use_cpu_kernels(self) -> None:
        """Relay's GEMM kernels; for a float32 model also its CPU norm (1 + w folded), q/k norm,
        rotary (each layer its tables) and GeGLU kernels, which the one-call decode runs too. A
        bfloat16 model keeps torch's: its norms scale in float32 before they round, as
        transformers' do, where the kernels would multiply by a rounded 1 + w."""
        self._use_gemm_kernels()
        self.fused_cpu_ops = (
            self.dtype == torch.float32
            and cpu_kernels.available()
            and self.rotary.covers_head
            and self.local_rotary.covers_head
        )
        if not self.fused_cpu_ops:
            return
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.use_kernel()
        for layer, sliding in zip(self.layers, self.sliding):
            layer.mlp.fused = True
            layer.self_attn.rotary = self.local_rotary if sliding else self.rotary

    def use_prompt_layers(self, attn: AttentionBackend) -> bool:
        """Never: the one-call prompt step computes Llama's layers (bfloat16), not Gemma's."""
        return False
