"""Multi-head latent attention (DeepSeek V2/V3), over a KV pool that holds the latent.

transformers' DeepseekV2/V3Attention, per token: q (one projection, or low-rank through
q_a_proj, q_a_layernorm, q_b_proj) split per head into qk_nope_head_dim unrotated and
qk_rope_head_dim rotated features; kv_a_proj_with_mqa gives a kv_lora_rank latent c (then
normed by kv_a_layernorm) and k_pe, one rotated key part shared by every head; kv_b_proj
expands c into each head's unrotated key k_nope = W_UK c and value v = W_UV c. Scores are
q_nope.k_nope + q_pe.k_pe, scaled by ModelConfig.attention_scale (YaRN's mscale squared).

What is cached is [c, k_pe] (kv_lora_rank + qk_rope_head_dim features a token a layer), one
"kv head" wide (ModelConfig.latent_kv). Attention runs on it as it is, absorbed:
q_nope.(W_UK c) = (W_UK^T q_nope).c, so each head's query becomes [W_UK^T q_nope, q_pe] and the
keys are the cached rows themselves; the values are too (their first kv_lora_rank features:
the backend attends [c, k_pe] as values, and the rope part of its output is dropped), and W_UV
is applied to each head's attended latent after. This is one path for every step (prompt
chunks, decode, prefix-cache hits, speculative verification) through the existing paged
backends, the C decode and prompt-chunk kernels included (one kv head, num_heads a group);
expanding keys and values per step from the latent instead would read and multiply every
cached token by kv_b_proj at every decode step (context x kv_lora_rank x heads x
(nope + v) multiply-adds a layer, where absorbed decode attends a context x (rank + rope)
matrix once per head). Prompt chunks pay for the absorption (scores over rank + rope features
instead of nope + rope); on CPU the simpler single path was chosen over a second, expanded,
prefill path.

Rotary: the rope features of q and k rotate by Relay's tables (neox layout, YaRN's attention
factor in them). Where the checkpoint interleaves them (pairs (x0, x1), (x2, x3), ...: V2
always, V3 with rope_interleave), their weight rows are reordered at load to evens then odds:
neox's pairs (i, i + d/2) are then DeepSeek's pairs, and the rotated features come out in
transformers V3's order (V2 keeps its interleaved order; a dot product does not see the
difference beyond the order of its sums).

Tensor parallelism: q and kv_b_proj split by heads, o_proj row-parallel; kv_a_proj and the
latent are replicated, every rank caching the whole latent (the simplest correct split).
"""

from __future__ import annotations

import torch
from torch import nn

from relay.config import ModelConfig
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup, head_partition
from relay.execution.layers import Linear, RMSNorm, StepRope, apply_rotary

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV2RMSNorm's default epsilon,
# not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., d, *] of interleaved pairs (0, 1), (2, 3), ... reordered to 0, 2, 4, ..., 1, 3,
    5, ...: neox's rotate_half layout with the same pairs."""
    d = rows.shape[-2]
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]).to(rows.device)
    return rows.index_select(rows.dim() - 2, order)


class MlaAttention(nn.Module):
    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.shard = head_partition(mc.num_heads, 1, tp.size, tp.rank)
        self.num_heads = h = self.shard.q_count
        self.nope, self.rope, self.rank = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.kv_lora_rank
        self.v_dim, self.interleaved = mc.v_head_dim, mc.rope_interleave
        q_width, bias = h * (self.nope + self.rope), mc.attention_bias
        if mc.q_lora_rank is None:
            self.q_proj = Linear(mc.hidden_size, q_width, False, dtype)
        else:
            self.q_a_proj = Linear(mc.hidden_size, mc.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(mc.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(mc.q_lora_rank, q_width, False, dtype)
        self.kv_a_proj_with_mqa = Linear(mc.hidden_size, self.rank + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        # kv_b_proj as two per-head matrices: W_UK [nope, rank] folds into the queries, W_UV
        # [v_dim, rank] into the outputs
        self.w_uk = _weight(h, self.nope, self.rank, dtype=dtype)
        self.w_uv = _weight(h, self.v_dim, self.rank, dtype=dtype)
        self.o_proj = Linear(h * self.v_dim, mc.hidden_size, bias, dtype, tp)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        attn: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj(attention) of every row, or of the rows in keep only (every row's latent still
        goes into the cache): Llama's Attention's protocol."""
        t, h, r = x.shape[0], self.num_heads, self.rank
        q = self.queries(x).view(t, h, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(latent[:, :r])
        # the heads' rope parts and the shared key's, rotated in one pass
        pe = torch.cat([q[:, :, self.nope :], latent[:, None, r:]], dim=1)
        pe = apply_rotary(pe, rope.cos, rope.sin)
        q_latent = torch.bmm(q[:, :, : self.nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        kv = torch.cat([c, pe[:, h]], dim=-1).unsqueeze(1)  # [t, 1, rank + rope]: what is cached
        out = attn.forward(torch.cat([q_latent, pe[:, :h]], dim=-1), kv, kv, self.layer_id)
        out = out.view(t, h, r + self.rope)
        if keep is not None:
            out = out[keep]
            if not out.shape[0]:  # no row's output is read: its latent was all it had to give
                return out.new_empty(0, self.o_proj.weight.shape[0])
        # each head's attended latent through its W_UV: [heads, rows, v_dim]
        values = torch.bmm(out[:, :, :r].transpose(0, 1), self.w_uv.transpose(1, 2))
        return self.o_proj(values.transpose(0, 1).reshape(out.shape[0], h * self.v_dim))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    # ---- checkpoint loading -------------------------------------------------------------
    def load(self, part: str, w: torch.Tensor) -> str | list[str]:
        """Copy this rank's slice of checkpoint tensor self_attn.<part> in (rope rows reordered
        where interleaved); the parameter name(s) it went to."""
        name, kind = part.rsplit(".", 1)
        sh = self.shard
        heads = slice(sh.q_start, sh.q_start + sh.q_count)
        if name in ("q_proj", "q_b_proj"):
            per_head = w.reshape(-1, self.nope + self.rope, w.shape[-1])[heads]
            rows = torch.cat(
                [per_head[:, : self.nope], self._rope_rows(per_head[:, self.nope :])], 1
            )
            getattr(self, name).weight.copy_(rows.reshape(-1, w.shape[-1]))
            return part
        if name == "kv_a_proj_with_mqa":  # [latent rows; k_pe rows] (a bias likewise)
            rows = w if w.dim() == 2 else w[:, None]
            rows = torch.cat([rows[: self.rank], self._rope_rows(rows[self.rank :])])
            getattr(self.kv_a_proj_with_mqa, kind).copy_(rows.view_as(w))
            return part
        if name == "kv_b_proj":  # per head: nope rows of W_UK, then v_dim rows of W_UV
            per_head = w.reshape(-1, self.nope + self.v_dim, self.rank)[heads]
            self.w_uk.copy_(per_head[:, : self.nope])
            self.w_uv.copy_(per_head[:, self.nope :])
            return ["w_uk", "w_uv"]
        if name == "o_proj" and kind == "weight":  # this rank's heads' input columns
            cols = slice(sh.q_start * self.v_dim, (sh.q_start + sh.q_count) * self.v_dim)
            self.o_proj.weight.copy_(w[:, cols])
            return part
        # the norms, q_a_proj, and o_proj's bias (every rank adds all of it, once, after the sum)
        getattr(self.get_submodule(name), kind).copy_(w)
        return part

    def _rope_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return deinterleave(rows) if self.interleaved else rows


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
