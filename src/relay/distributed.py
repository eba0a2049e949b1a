"""Tensor-parallel group: the collectives the model layers use, and how heads are split.

One `TPGroup` object is passed to every layer (no module-level state), so the same model code
runs with tp_size 1 (every collective a no-op), gloo on CPU and NCCL on CUDA.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: q heads [q_start, q_start+q_count), same for kv."""
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` when `total` items are cut into `parts` contiguous runs,
    the first `total % parts` runs one longer."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def head_partition(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Split heads so each rank's q heads only read its own kv heads.

    With at least as many kv heads as ranks, kv heads are split (unevenly if need be, e.g.
    3 kv heads on 2 ranks -> 2 + 1) and each q head goes with its kv group. With fewer kv
    heads than ranks, q heads are split evenly and each rank keeps the one kv head its q
    heads share (replicated).
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_count = split_evenly(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if num_heads % tp_size:
        raise ValueError(f"{num_heads} attention heads cannot be split over {tp_size} ranks")
    q_count = num_heads // tp_size
    q_start = rank * q_count
    if q_count > group or group % q_count:
        raise ValueError(f"tp_size {tp_size} does not fit {num_heads} heads / {num_kv_heads} kv heads")
    return HeadShard(q_start, q_count, q_start // group, 1)


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1):
        self.rank = rank
        self.size = size

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: torch.device,
             timeout: float | None = None) -> "TPGroup":
        """Join the process group: NCCL on CUDA, gloo on CPU (over loopback for a file://
        rendezvous, i.e. one machine; across machines the launcher names the interface).
        timeout (seconds) bounds the rendezvous and every collective (torch's default: 30 min).

        On CUDA the process binds its GPU first (torch.cuda.set_device) and hands it to
        init_process_group as device_id: NCCL then creates its communicator on that GPU at
        once, rather than lazily on whatever device is current at the first collective
        (cuda:0 for every rank, if nothing set it), and never inside a CUDA graph capture."""
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", rank)
            if device.index >= torch.cuda.device_count():
                raise RuntimeError(f"TP rank {rank} wants {device} but only {torch.cuda.device_count()} "
                                   f"GPUs are visible; lower --tp or check CUDA_VISIBLE_DEVICES")
            torch.cuda.set_device(device)
        if size > 1:
            if init_method.startswith("file://"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
            if device.type == "cuda":
                dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                        device_id=device, **kw)
            else:
                dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, **kw)
        return cls(rank, size)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_ints(self, values: list[int], device: torch.device) -> list[int]:
        """The leader's values on every rank (each passes a list of the same length)."""
        if self.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's x (shape [..., sizes[rank]]) along the last dim."""
        if self.size == 1:
            return x
        parts = [x.new_empty(*x.shape[:-1], n) for n in sizes]
        if len(set(sizes)) == 1:
            dist.all_gather(parts, x.contiguous())
        else:  # gloo's all_gather wants equal shapes: pad to the widest shard
            width = max(sizes)
            padded = x.new_zeros(*x.shape[:-1], width)
            padded[..., :x.shape[-1]] = x
            gathered = [x.new_empty(*x.shape[:-1], width) for _ in sizes]
            dist.all_gather(gathered, padded)
            parts = [g[..., :n] for g, n in zip(gathered, sizes)]
        return torch.cat(parts, dim=-1)
