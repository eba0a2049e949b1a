"""The `flashinfer` backend: FlashInfer's paged prefill and decode kernels (CUDA only).

flashinfer is imported when this backend is constructed, never at module import, so the
CSR metadata helpers below run (and are tested) on a machine without it.

Written against the flashinfer 0.2.x / 0.3.x Python API, whose calls used here agree:
  BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
      .plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            num_qo_heads, num_kv_heads, head_dim(_qk), page_size, *, causal, sm_scale,
            q_data_type, kv_data_type, non_blocking)   # head_dim was renamed head_dim_qk in
                                                       # 0.2.x; both are passed positionally
      .run(q, (k_cache, v_cache))
  BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph=,
            use_tensor_cores=, paged_kv_indptr_buffer=, paged_kv_indices_buffer=,
            paged_kv_last_page_len_buffer=)
      .plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
            *, q_data_type, kv_data_type, sm_scale, non_blocking)
      .run(q, (k_cache, v_cache))
(0.1.x named plan/run begin_forward/forward and took causal at run time; it is not supported.)

The cache is the "NHD" layout: each layer's [num_pages * page_size, kv_heads, head_dim]
buffer viewed as [num_pages, page_size, kv_heads, head_dim]. Page tables become CSR:
kv_indptr [B+1], kv_indices (the pages each request uses), kv_last_page_len [B] in [1, page_size].
Mixed batches (decode + prefill chunks) go through the prefill wrapper (a decoding request
is a 1-token extend; flashinfer's causal mask is aligned to the end of the kv sequence).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

from relay.execution.attention.base import AttentionBackend, StepMeta, register_backend

WORKSPACE_BYTES = (
    256 << 20
)  # flashinfer's float workspace (split-kv partials), shared by all wrappers


def page_csr(
    page_tables: list[list[int]], seq_lens: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr [B+1], kv_indices [nnz], kv_last_page_len [B]) as int32 CPU tensors.

    Request i uses the first ceil(seq_lens[i] / page_size) pages of its page table."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    if seq.size and seq.min() < 1:
        raise ValueError("every request needs at least one token for paged attention")
    npages = (seq + page_size - 1) // page_size
    for i, (pt, n) in enumerate(zip(page_tables, npages)):
        if len(pt) < n:
            raise ValueError(
                f"request {i} has {seq[i]} tokens but only {len(pt)} pages of {page_size}"
            )
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(npages, out=indptr[1:])
    indices = np.fromiter(
        itertools.chain.from_iterable(pt[:n] for pt, n in zip(page_tables, npages.tolist())),
        dtype=np.int32,
        count=int(indptr[-1]),
    )
    last = (seq - (npages - 1) * page_size).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)


def qo_indptr(extend_lens: list[int]) -> torch.Tensor:
    """[B+1] int32 CPU: where each request's new tokens start in the flattened batch."""
    out = np.zeros(len(extend_lens) + 1, dtype=np.int32)
    np.cumsum(np.asarray(extend_lens, dtype=np.int64), out=out[1:])
    return torch.from_numpy(out)


@register_backend("flashinfer")
class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True
    kv_layout = "NHD"
    requires_cuda = True  # a CPU test with a stand-in flashinfer module clears it

    def __init__(self, kv, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, **masks):
        super().__init__(kv, num_heads, num_kv_heads, head_dim, scale, **masks)  # refuses masks
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(
                "attention backend 'flashinfer' needs the flashinfer package "
                "(pip install flashinfer-python); or use --attention-backend triton"
            ) from e
        self.fi = flashinfer
        self.device = kv.k[0].device
        self.dtype = kv.k[0].dtype
        if self.device.type != "cuda" and self.requires_cuda:
            raise ValueError("the flashinfer backend needs a CUDA device")
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flashinfer runs float16/bfloat16, not {self.dtype}; use --attention-backend triton"
            )
        ps = kv.page_size
        self.caches = [
            (k.view(-1, ps, num_kv_heads, head_dim), v.view(-1, ps, num_kv_heads, head_dim))
            for k, v in zip(kv.k, kv.v)
        ]
        # Tensor-core decode pays off for larger GQA groups (as in SGLang's heuristic).
        self.use_tensor_cores = num_heads // num_kv_heads >= 4
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # RELAY_FLASHINFER_PREFILL_BACKEND=fa2 skips Hopper's fa3 kernels (a shorter JIT compile).
        prefill_kw = {}
        if os.environ.get("RELAY_FLASHINFER_PREFILL_BACKEND"):
            prefill_kw["backend"] = os.environ["RELAY_FLASHINFER_PREFILL_BACKEND"]
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", **prefill_kw
        )
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.active = None
        self.out_slots: torch.Tensor | None = None
        self._graph: dict | None = None

    # ---- planning ----------------------------------------------------------------------
    def _plan_decode(self, wrapper, meta: StepMeta) -> None:
        indptr, indices, last = page_csr(meta.page_tables, meta.seq_lens, self.kv.page_size)
        wrapper.plan(
            indptr,
            indices,
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.kv.page_size,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=self.scale,
            non_blocking=True,
        )

    def plan(self, meta: StepMeta) -> None:
        self.out_slots = meta.out_slots
        if meta.is_decode:
            self._plan_decode(self.decode_wrapper, meta)
            self.active = self.decode_wrapper
            return
        indptr, indices, last = page_csr(meta.page_tables, meta.seq_lens, self.kv.page_size)
        self.prefill_wrapper.plan(
            qo_indptr(meta.extend_lens),
            indptr,
            indices,
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.kv.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
        )
        self.active = self.prefill_wrapper

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        dev = self.device
        self._graph = {
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "indices": torch.zeros(
                max_bs * max(1, max_pages_per_req), dtype=torch.int32, device=dev
            ),
            "last_page_len": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "wrappers": {},
        }

    def plan_cuda_graph(self, bs: int, meta: StepMeta) -> None:
        g = self._graph
        if g is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        wrapper = g["wrappers"].get(bs)
        if wrapper is None:  # one wrapper per captured batch size, all over the same buffers
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=g["indptr"][: bs + 1],
                paged_kv_indices_buffer=g["indices"],
                paged_kv_last_page_len_buffer=g["last_page_len"][:bs],
            )
            g["wrappers"][bs] = wrapper
        self._plan_decode(wrapper, meta)
        self.active = wrapper
        self.out_slots = meta.out_slots

    # ---- the layer call ------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        self.kv.write(layer, self.out_slots, k, v)
        out = self.active.run(q.contiguous(), self.caches[layer])
        return out.view(q.shape[0], -1)
