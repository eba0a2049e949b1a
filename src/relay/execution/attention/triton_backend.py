"""Relay's own Triton attention backend over the paged KV cache (the `triton` backend).

Per step it plans the batch (decode requests and prompt chunks apart, their int32 metadata in
one host-to-device copy), or for a CUDA graph fills static tensors; per layer it launches the
kernels of relay.execution.attention.triton_kernels (the KV layout and the algorithms are
described there) with tile sizes chosen for the device. K/V of the step are written into the
cache with index_copy_ before attention (graph-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from relay.execution.attention.base import AttentionBackend, StepMeta, register_backend
from relay.execution.attention.triton_kernels import decode_stage1, decode_stage2, extend_kernel

MAX_SPLITS = 16  # upper bound of decode KV splits (stage 2 reduces over this many, masked)
LOG2E = 1.4426950408889634


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_num_splits(
    batch_size: int,
    num_kv_heads: int,
    num_sms: int,
    max_seq_len: int | None = None,
    min_tokens_per_split: int = 256,
) -> int:
    """KV splits per (request, kv head): enough programs to fill the GPU twice over, at most
    MAX_SPLITS, a power of two. Without max_seq_len (CUDA graphs) it depends on the batch only."""
    want = -(-2 * num_sms // max(1, batch_size * num_kv_heads))
    if max_seq_len is not None:
        want = min(want, -(-max_seq_len // min_tokens_per_split))
    want = max(1, min(MAX_SPLITS, want))
    return 1 << (want - 1).bit_length() if want & (want - 1) else want


def launch_config(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """Tile sizes and launch options. On GPU: 64-wide tiles (32 past head_dim 128), 4 warps,
    2 pipeline stages (1 in fp32, whose tiles are twice the bytes). Under the interpreter:
    16-wide tiles, which run faster there."""
    if not on_gpu:
        return dict(decode_block_n=16, ext_block_m=16, ext_block_n=16, num_warps=1, num_stages=1)
    big = _next_pow2(head_dim) > 128
    return dict(
        decode_block_n=32 if big else 64,
        ext_block_m=32 if big else 64,
        ext_block_n=32 if big else 64,
        num_warps=4,
        num_stages=1 if dtype == torch.float32 else 2,
    )


@dataclass
class _DecodePlan:
    seq_lens: torch.Tensor  # [n] int32
    q_rows: torch.Tensor  # [n] int32: row of q/out of each decode request
    page_table: torch.Tensor  # [n, width] int32
    mid_o: torch.Tensor  # [n, heads, MAX_SPLITS, head_dim] float32
    mid_lse: torch.Tensor  # [n, heads, MAX_SPLITS] float32
    num_splits: int


@dataclass
class _ExtendPlan:
    prefix_lens: torch.Tensor  # [n] int32
    extend_lens: torch.Tensor  # [n] int32
    q_starts: torch.Tensor  # [n] int32
    page_table: torch.Tensor  # [n, width] int32 (prefix pages)
    max_extend: int


def _table(page_tables: list[list[int]], num_pages: list[int]) -> np.ndarray:
    width = max(1, max(num_pages))
    out = np.zeros((len(page_tables), width), dtype=np.int32)
    for i, (pages, n) in enumerate(zip(page_tables, num_pages)):
        out[i, :n] = pages[:n]
    return out


def _to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """One host->device copy for all of a step's int32 metadata; returns views shaped like the inputs."""
    flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int32, copy=False)
    dev = (
        torch.from_numpy(flat).to(device, non_blocking=True)
        if device.type == "cuda"
        else torch.from_numpy(flat)
    )
    out, pos = [], 0
    for a in arrays:
        out.append(dev[pos : pos + a.size].view(a.shape))
        pos += a.size
    return out


@register_backend("triton")
class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, **masks):
        super().__init__(kv, num_heads, num_kv_heads, head_dim, scale, **masks)  # refuses masks
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads"
            )
        self.device = kv.k[0].device
        self.dtype = kv.k[0].dtype
        self.group = num_heads // num_kv_heads
        self.sm_scale_log2 = scale * LOG2E
        self.ieee = self.dtype == torch.float32  # no TF32 shortcuts when the model runs in fp32
        self.block_d = _next_pow2(head_dim)
        self.block_g = max(16, _next_pow2(self.group))
        on_gpu = self.device.type == "cuda"
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        )
        cfg = launch_config(head_dim, self.dtype, on_gpu)
        self.decode_block_n, self.ext_block_m, self.ext_block_n = (
            cfg["decode_block_n"],
            cfg["ext_block_m"],
            cfg["ext_block_n"],
        )
        self.num_warps, self.num_stages = cfg["num_warps"], cfg["num_stages"]
        # Eager decode steps give each split at least this many tokens (tests lower it).
        self.min_tokens_per_split = 256
        self.decode: _DecodePlan | None = None
        self.extend: _ExtendPlan | None = None
        self.out_slots: torch.Tensor | None = None
        self.num_tokens = 0
        self._graph: dict[str, torch.Tensor] | None = None

    # ---- planning ----------------------------------------------------------------------
    def plan(self, meta: StepMeta) -> None:
        ps = self.kv.page_size
        self.out_slots = meta.out_slots
        ext_lens = meta.extend_lens
        self.num_tokens = int(sum(ext_lens))
        starts = np.concatenate([[0], np.cumsum(ext_lens)[:-1]]).astype(np.int32)
        seq_lens = meta.seq_lens
        dec = [i for i, e in enumerate(ext_lens) if e == 1]
        ext = [i for i, e in enumerate(ext_lens) if e > 1]
        arrays: list[np.ndarray] = []
        if dec:
            d_seq = np.asarray([seq_lens[i] for i in dec], dtype=np.int32)
            arrays += [
                d_seq,
                starts[dec],
                _table([meta.page_tables[i] for i in dec], [-(-int(s) // ps) for s in d_seq]),
            ]
        if ext:
            e_prefix = np.asarray([meta.prefix_lens[i] for i in ext], dtype=np.int32)
            arrays += [
                e_prefix,
                np.asarray([ext_lens[i] for i in ext], dtype=np.int32),
                starts[ext],
                _table([meta.page_tables[i] for i in ext], [-(-int(p) // ps) for p in e_prefix]),
            ]
        tensors = _to_device(arrays, self.device)
        self.decode = self.extend = None
        if dec:
            n = len(dec)
            splits = decode_num_splits(
                n, self.num_kv_heads, self.num_sms, int(d_seq.max()), self.min_tokens_per_split
            )
            self.decode = _DecodePlan(
                tensors[0],
                tensors[1],
                tensors[2],
                torch.empty(
                    n,
                    self.num_heads,
                    splits,
                    self.head_dim,
                    dtype=torch.float32,
                    device=self.device,
                ),
                torch.empty(n, self.num_heads, splits, dtype=torch.float32, device=self.device),
                splits,
            )
            tensors = tensors[3:]
        if ext:
            self.extend = _ExtendPlan(
                tensors[0], tensors[1], tensors[2], tensors[3], max(ext_lens[i] for i in ext)
            )

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        dev = self.device
        self._graph = {
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "q_rows": torch.arange(max_bs, dtype=torch.int32, device=dev),
            "page_table": torch.zeros(
                max_bs, max(1, max_pages_per_req), dtype=torch.int32, device=dev
            ),
            "mid_o": torch.empty(
                max_bs, self.num_heads, MAX_SPLITS, self.head_dim, dtype=torch.float32, device=dev
            ),
            "mid_lse": torch.empty(
                max_bs, self.num_heads, MAX_SPLITS, dtype=torch.float32, device=dev
            ),
        }

    def plan_cuda_graph(self, bs: int, meta: StepMeta) -> None:
        g = self._graph
        if g is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        ps = self.kv.page_size
        seq = np.asarray(meta.seq_lens, dtype=np.int32)
        table = _table(meta.page_tables, [-(-int(s) // ps) for s in seq])
        if table.shape[1] > g["page_table"].shape[1]:
            raise ValueError(
                f"a request has {table.shape[1]} pages; the CUDA graph state holds "
                f"{g['page_table'].shape[1]}"
            )
        g["seq_lens"][:bs].copy_(torch.from_numpy(seq), non_blocking=True)
        g["page_table"][:bs, : table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
        self.out_slots = meta.out_slots
        self.num_tokens = bs
        self.extend = None
        self.decode = _DecodePlan(
            g["seq_lens"][:bs],
            g["q_rows"][:bs],
            g["page_table"][:bs],
            g["mid_o"][:bs],
            g["mid_lse"][:bs],
            decode_num_splits(bs, self.num_kv_heads, self.num_sms),
        )

    # ---- the layer call ------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        # The kernels index the last dim with unit stride; other strides are passed in.
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        self.kv.write(layer, self.out_slots, k, v)
        out = q.new_empty(q.shape)
        if self.decode is not None:
            self._run_decode(q, out, layer)
        if self.extend is not None:
            self._run_extend(q, k, v, out, layer)
        return out.view(q.shape[0], -1)

    def _run_decode(self, q: torch.Tensor, out: torch.Tensor, layer: int) -> None:
        d = self.decode
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        n = d.seq_lens.shape[0]
        decode_stage1[(n, self.num_kv_heads, d.num_splits)](
            q,
            kc,
            vc,
            d.page_table,
            d.seq_lens,
            d.q_rows,
            d.mid_o,
            d.mid_lse,
            self.sm_scale_log2,
            d.num_splits,
            q.stride(0),
            q.stride(1),
            kc.stride(0),
            kc.stride(1),
            d.page_table.stride(0),
            d.mid_o.stride(0),
            d.mid_o.stride(1),
            d.mid_o.stride(2),
            d.mid_lse.stride(0),
            d.mid_lse.stride(1),
            PAGE_SIZE=self.kv.page_size,
            GROUP=self.group,
            BLOCK_G=self.block_g,
            HEAD_DIM=self.head_dim,
            BLOCK_D=self.block_d,
            BLOCK_N=self.decode_block_n,
            IEEE=self.ieee,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        decode_stage2[(n, self.num_heads)](
            d.mid_o,
            d.mid_lse,
            d.q_rows,
            out,
            d.num_splits,
            d.mid_o.stride(0),
            d.mid_o.stride(1),
            d.mid_o.stride(2),
            d.mid_lse.stride(0),
            d.mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=self.head_dim,
            BLOCK_D=self.block_d,
            BLOCK_S=MAX_SPLITS,
            num_warps=self.num_warps,
        )

    def _run_extend(self, q, k, v, out, layer: int) -> None:
        e = self.extend
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        n = e.extend_lens.shape[0]
        grid = (n, self.num_heads, -(-e.max_extend // self.ext_block_m))
        extend_kernel[grid](
            q,
            k,
            v,
            kc,
            vc,
            out,
            e.page_table,
            e.prefix_lens,
            e.extend_lens,
            e.q_starts,
            self.sm_scale_log2,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            kc.stride(0),
            kc.stride(1),
            out.stride(0),
            out.stride(1),
            e.page_table.stride(0),
            PAGE_SIZE=self.kv.page_size,
            GROUP=self.group,
            HEAD_DIM=self.head_dim,
            BLOCK_D=self.block_d,
            BLOCK_M=self.ext_block_m,
            BLOCK_N=self.ext_block_n,
            IEEE=self.ieee,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
