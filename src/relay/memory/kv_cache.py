"""The paged KV pool's tensors (model-runner side) and how many pages a budget buys."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Without --kv-cache-gb / --mem-fraction-static, a CPU runner takes this share of the
# memory still available after the weights (other processes and the OS keep the rest).
DEFAULT_CPU_MEM_FRACTION = 0.3
DEFAULT_CPU_KV_CAP_GB = 4.0


class KVCache:
    """Per-layer K and V buffers. A token's slot is page * page_size + offset; page 0 is
    scratch (never allocated).

    Layout "NHD": [num_pages * page_size, kv_heads, head_dim] (what paged GPU kernels read).
    Layout "HND": [kv_heads, num_pages * page_size, head_dim]: gathering a batch's slots
    then yields [kv_heads, tokens, head_dim], which batched matmuls take without a copy.

    values_are_keys: one buffer per layer, v the same tensors as k (multi-head latent attention
    caches a latent that is both: ModelConfig.latent_kv).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: str = "NHD",
        values_are_keys: bool = False,
    ):
        if layout not in ("NHD", "HND"):
            raise ValueError(f"unknown KV layout {layout!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self._slot_dim = 0 if layout == "NHD" else 1
        slots = num_pages * page_size
        shape = (slots, kv_heads, head_dim) if layout == "NHD" else (kv_heads, slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values_are_keys = values_are_keys
        self.v = (
            self.k
            if values_are_keys
            else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] for the given slots."""
        if self._slot_dim:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        if k.dtype != self.k[layer].dtype:
            k, v = k.to(self.k[layer].dtype), v.to(self.k[layer].dtype)
        self.k[layer].index_copy_(self._slot_dim, slots, k)
        if not self.values_are_keys:  # (v is k)
            self.v[layer].index_copy_(self._slot_dim, slots, v)


DEFAULT_CUDA_MEM_FRACTION = 0.85


def num_pages_for_budget(
    bytes_per_token: int,
    page_size: int,
    kv_cache_gb: float | None,
    mem_fraction: float | None,
    device: torch.device,
    free_bytes: int | None = None,
) -> int:
    """Pages that fit the KV budget: an explicit size, else a fraction of free memory.

    On CUDA, `free_bytes` is the free GPU memory measured by the caller after the weights are
    loaded and one warm-up forward ran (the runner passes it; see cuda_free_bytes); without
    it, the free memory now. It is ignored on CPU."""
    if kv_cache_gb is not None:
        budget = kv_cache_gb * (1 << 30)
    elif device.type == "cuda":
        free = free_bytes if free_bytes is not None else torch.cuda.mem_get_info(device)[0]
        budget = free * (mem_fraction if mem_fraction is not None else DEFAULT_CUDA_MEM_FRACTION)
    else:
        import psutil  # only the CPU branch needs it (GPU machines may lack it)

        avail = psutil.virtual_memory().available
        if mem_fraction is not None:
            budget = avail * mem_fraction
        else:
            budget = min(avail * DEFAULT_CPU_MEM_FRACTION, DEFAULT_CPU_KV_CAP_GB * (1 << 30))
    pages = int(budget // (bytes_per_token * page_size))
    logger.info(
        "KV pool: %d pages x %d tokens (%.2f GiB)",
        pages,
        page_size,
        pages * page_size * bytes_per_token / (1 << 30),
    )
    return pages


def cuda_free_bytes(device: torch.device) -> int:
    """GPU memory still free for the KV pool: what the driver reports free. Blocks that the
    caching allocator holds but has not handed out (e.g. left by a warm-up forward) are not
    counted: they stay with torch for the activations of later steps."""
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
