"""Phi-3, Phi-3.5-mini and Phi-4-mini (Phi3ForCausalLM): Llama's decoder layers, with q/k/v and
gate/up already fused in the checkpoint, LongRoPE (relay.rope) and, in Phi-4-mini, a rope over
part of each head (partial_rotary_factor 0.75).

The fused checkpoint tensors are placed here as their q, k, v, gate and up parts (linear_slots):
each tensor-parallel rank's heads and MLP features go into the rank's own fused layers, so a rank
never holds another's slice of qkv_proj (a fused [q; k; v] weight cut in equal row blocks would
give rank 0 all of q and rank 1 k and v)."""

from __future__ import annotations

import re

from relay.execution.models.linear_slots import Slot
from relay.execution.models.llama import LlamaForCausalLM

_FUSED = re.compile(r"(?:model\.)?layers\.(\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)")


class Phi3ForCausalLM(LlamaForCausalLM):
    def linear_slots(self, name: str) -> list[Slot] | None:
        """Llama's, and the fused qkv_proj's q, k and v rows (this rank's heads of each) and
        gate_up_proj's gate then up rows (as Phi3MLP splits it: this rank's features of each)."""
        m = _FUSED.fullmatch(name)
        if m is None:
            return super().linear_slots(name)
        i = int(m.group(1))
        if m.group(2) == "self_attn.qkv_proj":
            q_rows = self.config.num_heads * self.config.head_dim
            kv_rows = self.config.num_kv_heads * self.config.head_dim
            firsts = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}
            return [self._qkv_slot(i, which, first) for which, first in firsts.items()]
        mlp = self.layers[i].mlp
        gate, up = mlp.slot("gate_proj"), mlp.slot("up_proj")
        total = self.config.intermediate_size
        up.rows = slice(total + up.rows.start, total + up.rows.stop)
        return [s.under(f"layers.{i}.mlp.") for s in (gate, up)]
