"""The paged KV pool's tensors (model-runner side) and how many pages a budget buys."""
from __future__ import annotations

import logging

import psutil
import torch

logger = logging.getLogger(__name__)

# Without --kv-cache-gb / --mem-fraction-static, a CPU runner takes this share of the
# memory still available after the weights (other processes and the OS keep the rest).
DEFAULT_CPU_MEM_FRACTION = 0.3
DEFAULT_CPU_KV_CAP_GB = 4.0


class KVCache:
    """Per-layer K and V buffers of shape [num_pages * page_size, kv_heads, head_dim].

    A token's slot is page * page_size + offset; page 0 is scratch (never allocated)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages * page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


def num_pages_for_budget(bytes_per_token: int, page_size: int, kv_cache_gb: float | None,
                         mem_fraction: float | None, device: torch.device) -> int:
    """Pages that fit the KV budget: an explicit size, else a fraction of free memory."""
    if kv_cache_gb is not None:
        budget = kv_cache_gb * (1 << 30)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * (mem_fraction if mem_fraction is not None else 0.85)
    else:
        avail = psutil.virtual_memory().available
        if mem_fraction is not None:
            budget = avail * mem_fraction
        else:
            budget = min(avail * DEFAULT_CPU_MEM_FRACTION, DEFAULT_CPU_KV_CAP_GB * (1 << 30))
    pages = int(budget // (bytes_per_token * page_size))
    logger.info("KV pool: %d pages x %d tokens (%.2f GiB)", pages, page_size,
                pages * page_size * bytes_per_token / (1 << 30))
    return pages
