"""Tensor-parallel group: the collectives the model layers use, and how heads are split.

One `TPGroup` object is passed to every layer (no module-level state), so the same model code
runs with tp_size 1 (every collective a no-op), NCCL on CUDA, and on CPU a shared memory
segment between the ranks of one machine (ShmGroup) for the per-step collectives, gloo for the
rest and across machines.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from relay.execution.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)


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
        raise ValueError(
            f"tp_size {tp_size} does not fit {num_heads} heads / {num_kv_heads} kv heads"
        )
    return HeadShard(q_start, q_count, q_start // group, 1)


class _ShmState(ctypes.Structure):  # csrc/shm_collective.c's ShmGroup
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("size", ctypes.c_int64),
        ("slot_bytes", ctypes.c_int64),
        ("gen", ctypes.c_uint64),
        ("timeout_s", ctypes.c_double),
        ("spins", ctypes.c_int64),
    ]


class ShmGroup:
    """The CPU ranks of one machine, exchanging through a shared memory segment
    (csrc/shm_collective.c): a collective costs a copy and a wait of microseconds where gloo over
    loopback took ~0.3-0.4 ms, 60 times a step. Every rank must make the same calls in the
    same order, as with any collective."""

    SLOT_BYTES = 4 << 20  # a rank's part of one exchange; larger collectives go in pieces
    # Pauses a waiting rank spins before it yields its core. With a core each, the peer is usually
    # microseconds away; with more ranks than cores the peer may be waiting for this very core
    # (--tp 3 on 2 cores: 112 tok/s at concurrency 1 yielding at once, 60 after 4,096 pauses).
    SPINS_OWN_CORE, SPINS_SHARED_CORES = 4096, 16

    def __init__(
        self, lib: ctypes.CDLL, segment: mmap.mmap, rank: int, size: int, timeout_s: float
    ):
        self._lib, self._segment = lib, segment
        base = ctypes.addressof(ctypes.c_char.from_buffer(segment))
        spins = (
            self.SPINS_OWN_CORE if size <= len(os.sched_getaffinity(0)) else self.SPINS_SHARED_CORES
        )
        self.state = _ShmState(base, rank, size, self.SLOT_BYTES, 0, timeout_s, spins)
        self.ptr = ctypes.addressof(self.state)  # what the one-call decoder steps take

    @classmethod
    def open(cls, path: str, rank: int, size: int, timeout_s: float) -> ShmGroup | None:
        """Rank 0 creates the segment at path (a name no one else uses; removed again once every
        rank has mapped it, so nothing is left behind), the others map it. Collective over the
        gloo group: None on every rank unless every rank has the kernels and the segment's
        memory could be had (a small /dev/shm, as containers have, refuses it here rather than
        killing a rank with SIGBUS on its first touch)."""
        lib = cpu_kernels.load()
        if not _everyone(lib is not None):
            return None
        nbytes = lib.relay_shm_segment_bytes(size, cls.SLOT_BYTES)
        fd = -1
        if rank == 0:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.posix_fallocate(fd, 0, nbytes)  # zeros: every arrival counter at 0
            except OSError as e:
                logger.warning(
                    "no shared memory segment for the tensor-parallel ranks at %s (%s)", path, e
                )
                if fd >= 0:
                    os.close(fd)
                    os.unlink(path)
                fd = -1
        if not _everyone(rank != 0 or fd >= 0):
            return None
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        segment = mmap.mmap(fd, nbytes)
        os.close(fd)
        dist.barrier()
        if rank == 0:
            os.unlink(path)
        return cls(lib, segment, rank, size, timeout_s)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place where x is contiguous (returned either way)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"shared-memory all_reduce takes float32 or bfloat16, not {x.dtype}")
        x = x if x.is_contiguous() else x.contiguous()
        self._check(
            self._lib.relay_shm_all_reduce(
                self.ptr, x.data_ptr(), x.numel(), int(x.dtype == torch.bfloat16)
            )
        )
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x (the same shape and dtype on every rank)."""
        x = x.contiguous()
        out = x.new_empty(self.state.size, *x.shape)
        self._check(
            self._lib.relay_shm_all_gather(
                self.ptr, x.data_ptr(), x.numel() * x.element_size(), out.data_ptr()
            )
        )
        return out

    def _check(self, verdict: int) -> None:
        """csrc/shm_collective.c's verdict: 1 done, 0 a timeout, -1 ranks that disagree."""
        if verdict == 0:
            raise RuntimeError(
                f"tensor-parallel rank {self.state.rank}: a peer rank did not join a collective "
                f"in {self.state.timeout_s:.0f} s"
            )
        if verdict != 1:
            raise RuntimeError(
                f"tensor-parallel rank {self.state.rank}: the ranks called different collectives "
                "(byte counts differ); they are out of step"
            )


def _everyone(flag: bool) -> bool:
    """Whether flag holds on every rank of the gloo group."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _shm_path(init_method: str) -> str:
    """Where one server's segment goes: RAM (/dev/shm) where the machine has it, under a name
    taken from the server's private IPC directory (which holds the file:// rendezvous)."""
    ipc_dir = os.path.dirname(init_method[len("file://") :])
    name = f"{os.path.basename(ipc_dir)}-tp"
    return (
        os.path.join("/dev/shm", name) if os.path.isdir("/dev/shm") else os.path.join(ipc_dir, name)
    )


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, shm: ShmGroup | None = None):
        self.rank = rank
        self.size = size
        self.shm = shm  # CPU ranks of one machine: the per-step collectives go through it

    @classmethod
    def init(
        cls,
        rank: int,
        size: int,
        init_method: str,
        device: torch.device,
        timeout: float | None = None,
    ) -> TPGroup:
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
                raise RuntimeError(
                    f"TP rank {rank} wants {device} but only {torch.cuda.device_count()} "
                    f"GPUs are visible; lower --tp or check CUDA_VISIBLE_DEVICES"
                )
            torch.cuda.set_device(device)
        if size > 1:
            if init_method.startswith("file://"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
            if device.type == "cuda":
                dist.init_process_group(
                    "nccl",
                    init_method=init_method,
                    rank=rank,
                    world_size=size,
                    device_id=device,
                    **kw,
                )
            else:
                dist.init_process_group(
                    "gloo", init_method=init_method, rank=rank, world_size=size, **kw
                )
                if init_method.startswith("file://"):  # one machine
                    shm = ShmGroup.open(_shm_path(init_method), rank, size, timeout or 1800.0)
                    logger.info(
                        "tensor-parallel collectives: %s", "shared memory" if shm else "gloo"
                    )
                    return cls(rank, size, shm)
        return cls(rank, size)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def collectives_in_c(self) -> bool:
        """Whether a one-call C step can make this rank's collectives itself: one rank (none to
        make), or CPU ranks of one machine on shared memory."""
        return self.size == 1 or self.shm is not None

    @property
    def c_group(self) -> int | None:
        """What a one-call C step all-reduces through (ShmGroup.ptr), or None: one rank."""
        return None if self.shm is None else self.shm.ptr

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_true(self, flag: bool) -> bool:
        """Whether flag holds on every rank of a CPU group: for choices that must be the same on
        all of them (a path whose collectives differ from another's)."""
        if self.size == 1:
            return flag
        if self.shm is not None:
            return bool(self.shm.all_gather(torch.tensor([int(flag)])).min())
        return _everyone(flag)

    def broadcast_ints(self, values: list[int], device: torch.device) -> list[int]:
        """The leader's values on every rank (each passes a list of the same length)."""
        if self.size == 1 or not values:
            return values
        if self.shm is not None:
            return self.shm.all_gather(torch.tensor(values, dtype=torch.int64))[0].tolist()
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's x (shape [..., sizes[rank]]) along the last dim."""
        if self.size == 1:
            return x
        # Both transports gather equal shapes: pad to the widest shard, cut each back to its size.
        width = max(sizes)
        padded = (
            x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        ).contiguous()
        if self.shm is not None:
            gathered = self.shm.all_gather(padded)
        else:
            gathered = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(gathered, padded)
        return torch.cat([g[..., :n] for g, n in zip(gathered, sizes)], dim=-1)
