"""Attention in plain torch ops over the paged KV cache: the CPU backend and the reference.

The KV cache is laid out [kv_heads, slots, head_dim] ("HND"). Decoding requests are
attended together: one index_select gathers their keys into [kv_heads, batch * max_len,
head_dim], which batched matmuls read as [kv_heads * batch] matrices with no further copy;
the query heads that share a kv head are the rows of one matrix, so keys are never
repeated for GQA. (Advanced indexing and a [batch, len, heads] layout cost 2.5x more here,
and bf16 SDPA is 3-5x slower for single-token queries.) Prompt chunks go through SDPA one
request at a time, reading the cache as a view when the request's pages are consecutive.

Models whose attention is masked beyond causal (per-layer sliding windows: Mistral, Mixtral,
Phi-3, Gemma 2/3, gpt-oss; soft-capped scores: Gemma 2; attention sinks: gpt-oss) attend here and
only here: every path a request takes (decode rows, prompt chunks, chunks after a prefix-cache hit,
speculative verification) masks each layer's keys to its window, caps the scores and adds the
sinks to the softmax. On CPU Relay's C attention kernels (decode, prompt chunks, shared-prefix
cascade) take each layer's window, the cap and the sinks as arguments, skipping the pages before a
window; the torch code below (and attention/scores.py) applies them where the kernels do not run
(no C compiler, a shape they refuse, GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from relay.execution.attention import scores as scores_beyond
from relay.execution.attention.base import AttentionBackend, StepMeta, register_backend
from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import cpu_attention, cpu_layers


@dataclass
class _Prefill:
    row: int  # first query row in the step's flattened tokens
    num_new: int
    keys: slice | torch.Tensor  # the request's KV slots, as a slice when consecutive
    masks: dict[
        int | None, torch.Tensor | None
    ]  # window -> [num_new, seq_len] bool, None = plain causal from 0


def page_slots(page_tables: list[list[int]], lengths: list[int], page_size: int) -> np.ndarray:
    """[num_reqs, max_len] KV slot of each token; slot 0 (scratch) past each length."""
    width = max(len(p) for p in page_tables)
    table = np.zeros((len(page_tables), width), dtype=np.int64)
    for i, pages in enumerate(page_tables):
        table[i, : len(pages)] = pages
    slots = (table[:, :, None] * page_size + np.arange(page_size)).reshape(len(page_tables), -1)
    max_len = max(lengths)
    slots = slots[:, :max_len]
    slots[np.arange(max_len)[None, :] >= np.asarray(lengths)[:, None]] = 0
    return slots


def decode_mask(lens: list[int], width: int, window: int | None, device) -> torch.Tensor | None:
    """[1, batch, 1, width] float: -inf where a decoding request's query may not look (its
    padding past its length; keys at or before length - 1 - window), None where it sees all."""
    cols, ends = np.arange(width)[None, :], np.asarray(lens)[:, None]
    hidden = cols >= ends
    if window is not None:
        hidden |= cols < ends - window
    if not hidden.any():
        return None
    mask = torch.zeros(hidden.shape, dtype=torch.float32)
    mask[torch.from_numpy(hidden)] = float("-inf")
    return mask.to(device)[None, :, None, :]


def prefill_mask(
    prefix: int, n: int, seq_len: int, window: int | None, device
) -> torch.Tensor | None:
    """[n, seq_len] bool: which keys each of a chunk's n queries (positions prefix..) attends;
    None for plain causal attention from position 0."""
    if not prefix and window is None:
        return None
    q_pos = torch.arange(prefix, prefix + n, device=device)[:, None]
    keys = torch.arange(seq_len, device=device)[None, :]
    mask = keys <= q_pos
    return mask if window is None else mask & (keys > q_pos - window)


@register_backend("torch")
class TorchNativeBackend(AttentionBackend):
    kv_layout = "HND"
    masks_scores = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # On CPU, decode attention runs in Relay's C kernel when it builds: it reads each
        # cached key/value once instead of gathering a padded copy first (3x less traffic),
        # and only the keys in each layer's window.
        self.kernel = None
        self.has_decode, self.dec_rows, self.ext_plan = False, None, None  # set by plan()
        if (
            self.kv.k[0].device.type == "cpu"
            and self.kv.k[0].dtype in (torch.float32, torch.bfloat16)
            and self.num_heads // self.num_kv_heads <= cpu_attention.MAX_GROUP
        ):
            self.kernel = cpu_kernels.load()
        # Cascade attention over shared prefixes, where the kernel has it for this cache.
        kv_dtype = self.kv.k[0].dtype
        self.share_prefixes = self.kernel is not None and cpu_attention.tiled_attention_available(
            kv_dtype, kv_dtype, self.head_dim
        )

    def plan(self, meta: StepMeta) -> None:
        device = self.kv.k[0].device
        self.out_slots = meta.out_slots
        seq_lens = meta.seq_lens
        dec = [i for i, e in enumerate(meta.extend_lens) if e == 1]
        starts = np.concatenate([[0], np.cumsum(meta.extend_lens)[:-1]]).tolist()
        self.dec_rows = None
        self.has_decode = bool(dec)
        if dec:
            all_decode = len(dec) == len(meta.extend_lens)
            self.dec_rows = (
                None if all_decode else torch.tensor([starts[i] for i in dec], device=device)
            )
            lens = [seq_lens[i] for i in dec]
            if self.kernel is not None:
                self.dec_plan = cpu_attention.DecodePlan(
                    [meta.page_tables[i] for i in dec],
                    lens,
                    self.kv.page_size,
                    share=self.share_prefixes,
                )
                return self._plan_prefills(meta, starts, seq_lens, device)
            slots = page_slots([meta.page_tables[i] for i in dec], lens, self.kv.page_size)
            self.dec_shape = slots.shape
            self.dec_slots = torch.from_numpy(slots.reshape(-1)).to(device)
            self.dec_masks = {
                w: decode_mask(lens, slots.shape[1], w, device) for w in self._distinct_windows()
            }
        self._plan_prefills(meta, starts, seq_lens, device)

    def _distinct_windows(self) -> set[int | None]:
        return set(self.windows) | {None}

    def _window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def _plan_prefills(
        self, meta: StepMeta, starts: list[int], seq_lens: list[int], device
    ) -> None:
        chunks = [i for i, e in enumerate(meta.extend_lens) if e > 1]
        # Prompt chunks go to Relay's C kernel where it takes them (reading the cache in place);
        # the SDPA plan below is the fallback.
        self.ext_plan = None
        if chunks and self.kernel is not None:
            self.ext_plan = cpu_attention.ExtendPlan(
                [meta.page_tables[i] for i in chunks],
                [meta.prefix_lens[i] for i in chunks],
                [meta.extend_lens[i] for i in chunks],
                [starts[i] for i in chunks],
            )
        self.prefills = [
            self._plan_prefill(meta, i, starts[i], seq_lens[i], device) for i in chunks
        ]

    def _plan_prefill(self, meta: StepMeta, i: int, row: int, seq_len: int, device) -> _Prefill:
        pages = meta.page_tables[i]
        ps = self.kv.page_size
        if pages == list(range(pages[0], pages[0] + len(pages))):
            keys: slice | torch.Tensor = slice(pages[0] * ps, pages[0] * ps + seq_len)
        else:
            keys = torch.from_numpy(page_slots([pages], [seq_len], ps)[0]).to(device)
        n, prefix = meta.extend_lens[i], meta.prefix_lens[i]
        masks = {w: prefill_mask(prefix, n, seq_len, w, device) for w in self._distinct_windows()}
        return _Prefill(row, n, keys, masks)

    @property
    def decode_kernel_plan(self) -> cpu_attention.DecodePlan | None:
        if self.has_decode and self.dec_rows is None and self.kernel is not None:
            return self.dec_plan
        return None

    @property
    def prompt_kernel_plan(self) -> cpu_layers.PromptPlan | None:
        if self.ext_plan is None:  # (only planned with the kernel)
            return None
        if not self.has_decode:
            return cpu_layers.PromptPlan(self.out_slots, self.ext_plan)
        return cpu_layers.PromptPlan(self.out_slots, self.ext_plan, self.dec_rows, self.dec_plan)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sinks: the layer's float32 [num_heads] attention sinks (gpt-oss), or None."""
        if self.decode_kernel_plan is not None:
            # A pure decode step: the C kernel writes the new keys and values itself.
            return cpu_attention.decode_attention(
                self.kernel,
                self.dec_plan,
                q,
                self.kv.k[layer],
                self.kv.v[layer],
                self.kv.page_size,
                self.scale,
                k,
                v,
                self._window(layer),
                self.softcap,
                sinks,
            ).view(q.shape[0], -1)
        self.kv.write(layer, self.out_slots, k, v)
        if self.has_decode and self.dec_rows is None:  # a pure decode step
            return self._decode(q, layer, sinks).view(q.shape[0], -1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.has_decode:
            out[self.dec_rows] = self._decode(q[self.dec_rows], layer, sinks)
        if self.ext_plan is None or not cpu_attention.extend_attention(
            self.kernel,
            self.ext_plan,
            q,
            self.kv.k[layer],
            self.kv.v[layer],
            out,
            self.kv.page_size,
            self.scale,
            self._window(layer),
            self.softcap,
            sinks,
        ):
            for p in self.prefills:
                out[p.row : p.row + p.num_new] = self._prefill(
                    q[p.row : p.row + p.num_new], p, layer, sinks
                )
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, layer: int, sinks: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            wide = q.dtype not in (torch.float32, torch.bfloat16)
            out = cpu_attention.decode_attention(
                self.kernel,
                self.dec_plan,
                q.float() if wide else q,
                self.kv.k[layer],
                self.kv.v[layer],
                self.kv.page_size,
                self.scale,
                window=self._window(layer),
                softcap=self.softcap,
                sinks=sinks,
            )
            return out.to(q.dtype) if wide else out
        b, max_len = self.dec_shape
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        keys = (
            self.kv.k[layer].index_select(1, self.dec_slots).view(hkv * b, max_len, d).to(q.dtype)
        )
        values = (
            self.kv.v[layer].index_select(1, self.dec_slots).view(hkv * b, max_len, d).to(q.dtype)
        )
        qg = q.view(b, hkv, group, d).transpose(0, 1).reshape(hkv * b, group, d)
        scores = scores_beyond.capped(
            torch.bmm(qg, keys.transpose(1, 2)).float() * self.scale, self.softcap
        ).view(hkv, b, group, max_len)
        mask = self.dec_masks[self._window(layer)]
        if mask is not None:
            scores = scores + mask
        row_sinks = None if sinks is None else sinks.view(hkv, 1, group, 1)
        probs = scores_beyond.softmax(scores, row_sinks).to(q.dtype).view(hkv * b, group, max_len)
        out = torch.bmm(probs, values).view(hkv, b, group, d)
        return out.transpose(0, 1).reshape(b, self.num_heads, d)

    def _prefill(
        self, q: torch.Tensor, p: _Prefill, layer: int, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(p.keys, slice):
            keys, values = self.kv.k[layer][:, p.keys], self.kv.v[layer][:, p.keys]
        else:
            keys, values = (
                self.kv.k[layer].index_select(1, p.keys),
                self.kv.v[layer].index_select(1, p.keys),
            )
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # no-ops unless the KV dtype differs
        mask = p.masks[self._window(layer)]
        if self.softcap is not None or sinks is not None:  # SDPA can do neither
            return scores_beyond.scored_prefill(
                q, keys, values, mask, self.scale, self.softcap, sinks
            )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)
