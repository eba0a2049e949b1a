"""A runner's KV pool: how many pages it gets (the same on every TP rank), and the pool's tensors
with an attention backend on them."""

from __future__ import annotations

import logging

import torch

from relay.config import EngineConfig, ModelConfig
from relay.execution.attention import backend_class
from relay.execution.attention.base import StepMeta
from relay.execution.distributed import head_partition
from relay.execution.placement import Placement
from relay.memory.kv_cache import KVCache, cuda_free_bytes, num_pages_for_budget

logger = logging.getLogger(__name__)


def kv_and_attention(
    cfg: EngineConfig, place: Placement, mc: ModelConfig, num_pages: int, context_len: int
):
    """A KV pool of num_pages pages for this model's layers, and an attention backend on it (with
    the model's sliding windows, soft-cap and sinks at this context length)."""
    return _pool(cfg, place, mc, num_pages, place.kv_dtype, context_len)


def _pool(
    cfg: EngineConfig,
    place: Placement,
    mc: ModelConfig,
    num_pages: int,
    kv_dtype: torch.dtype,
    context_len: int,
):
    shard = head_partition(mc.num_heads, mc.num_kv_heads, place.tp.size, place.tp.rank)
    # auto picks the torch backend for latent attention on CUDA too: its one kv head of
    # kv_lora_rank + qk_rope_head_dim features (576 in the releases) was never run on the GPU
    # kernels here
    attn_cls = backend_class(
        cfg.attention_backend,
        place.device,
        place.dtype,
        mc.masks_attention(context_len) or mc.latent_kv,
    )
    kv = KVCache(
        mc.num_layers,
        num_pages,
        cfg.page_size,
        shard.kv_count,
        mc.head_dim,
        kv_dtype,
        place.device,
        layout=attn_cls.kv_layout,
        values_are_keys=mc.latent_kv,
    )
    attn = attn_cls(
        kv=kv,
        num_heads=shard.q_count,
        num_kv_heads=shard.kv_count,
        head_dim=mc.head_dim,
        scale=mc.attention_scale,
        windows=mc.attention_windows(context_len),
        softcap=mc.attn_logit_softcap,
        sinks=mc.attention_sinks,
    )
    return kv, attn


def agree_on_pages(
    cfg: EngineConfig,
    place: Placement,
    mc: ModelConfig,
    draft_mc: ModelConfig | None,
    free_after_warmup,
) -> int:
    """The pages of the KV pool (and of the draft's, which has as many of its own size): what the
    budget holds, the fewest of any TP rank's. free_after_warmup(): the GPU's free bytes once
    the weights are in and a full step ran (asked only on a GPU without --kv-cache-gb)."""
    itemsize, tp = place.kv_dtype.itemsize, place.tp
    bytes_per_token = mc.kv_bytes_per_token(itemsize, tp.size)
    if draft_mc is not None:
        bytes_per_token += draft_mc.kv_bytes_per_token(itemsize, tp.size)
    free = free_after_warmup() if place.device.type == "cuda" and cfg.kv_cache_gb is None else None
    pages = num_pages_for_budget(
        bytes_per_token,
        cfg.page_size,
        cfg.kv_cache_gb,
        cfg.mem_fraction_static,
        place.device,
        free_bytes=free,
    )
    if tp.size > 1:  # every rank must hold the same pages
        t = torch.tensor([pages], dtype=torch.int64, device=place.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        pages = int(t.item())
    if pages < 2:
        raise RuntimeError("the KV budget holds less than 2 pages; raise --kv-cache-gb")
    return pages


@torch.inference_mode()
def free_bytes_after_warmup(
    cfg: EngineConfig, place: Placement, mc: ModelConfig, model: torch.nn.Module, context_len: int
) -> int:
    """Free GPU memory after one forward of a full step (chunked_prefill_size tokens, logits
    and a sampler-sized softmax/sort for up to max_running_requests rows) on a throwaway
    KV cache; the activations' blocks stay cached by torch, outside what the KV pool gets."""
    ps, dev = cfg.page_size, place.device
    n = max(1, min(cfg.chunked_prefill_size, context_len - 1))
    pages = -(-n // ps) + 1
    kv, attn = _pool(cfg, place, mc, pages, place.dtype, context_len)
    meta = StepMeta(
        [0],
        [n],
        [list(range(1, pages))],
        positions=torch.arange(n, device=dev),
        out_slots=torch.arange(ps, ps + n, device=dev),
    )
    attn.plan(meta)
    hidden = model(torch.zeros(n, dtype=torch.int64, device=dev), meta.positions, attn)
    rows = min(n, cfg.max_running_requests)
    logits = model.compute_logits(hidden[:rows])
    torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    del kv, attn, meta, hidden, logits
    free = cuda_free_bytes(dev)
    logger.info("after weights and a warm-up step: %.2f GiB GPU memory free", free / (1 << 30))
    return free
