"""Phi-3, Phi-3.5-mini and Phi-4-mini (Phi3ForCausalLM): Llama's decoder layers, with q/k/v and
gate/up already fused in the checkpoint, LongRoPE (relay.execution.rope) and, in Phi-4-mini, a rope over
part of each head (partial_rotary_factor 0.75).

The fused checkpoint tensors are split here into the q, k, v, gate and up parts that Llama's loader
takes: it copies each tensor-parallel rank's heads and MLP columns into the rank's own fused
layers, so a rank never holds another's slice of qkv_proj (a fused [q; k; v] weight cut in equal
row blocks would give rank 0 all of q and rank 1 k and v)."""

from __future__ import annotations

import re

import torch

from relay.execution.models.llama import LlamaForCausalLM

_FUSED = re.compile(r"(?:model\.)?layers\.(\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")


class Phi3ForCausalLM(LlamaForCausalLM):
    def _load_one(self, name: str, w: torch.Tensor) -> str | None:
        m = _FUSED.fullmatch(name)
        if m is None:
            return super()._load_one(name, w)
        layer, part = m.group(1), m.group(2)
        if part == "self_attn.qkv_proj":
            d, mc = self.config.head_dim, self.config
            pieces = zip(
                ("q_proj", "k_proj", "v_proj"),
                w.split([mc.num_heads * d, mc.num_kv_heads * d, mc.num_kv_heads * d]),
            )
            names = {
                super(Phi3ForCausalLM, self)._load_one(f"layers.{layer}.self_attn.{p}.weight", t)
                for p, t in pieces
            }
        else:
            gate, up = w.chunk(2)  # gate first, as Phi3MLP splits it
            names = {
                super(Phi3ForCausalLM, self)._load_one(f"layers.{layer}.mlp.{p}.weight", t)
                for p, t in (("gate_proj", gate), ("up_proj", up))
            }
        (target,) = names
        return target
