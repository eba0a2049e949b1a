"""Where and in what a model runner computes: its device, its weights' and KV cache's dtypes, its
CPU threads, and the checks of a config against what this machine can run."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from relay.config import EngineConfig
from relay.execution.distributed import TPGroup
from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import isa
from relay.execution.layers import int4_supported
from relay.execution.thread_backoff import ThreadBackoff, backoff_supported


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """bfloat16 dot-product instructions (AVX512-BF16, or AMX-BF16) at the instruction-set level
    this process runs at (relay.execution.kernels.isa: the CPU's, or lower where RELAY_CPU_ISA holds it)."""
    return isa.at_least("avx512bf16")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs and on CPUs with bf16 dot products (AVX512-BF16 or AMX), where bf16
    GEMMs run 2.3-2.5x fp32's speed (docs/benchmarks.md); float32 on other CPUs, where torch
    emulates bf16 and its GEMMs measured slower than fp32 (~165 vs ~270 GFLOP/s)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    dtype = getattr(torch, name)
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError(
            "float16 has no fast path on CPU (about 100x slower); use bfloat16 or float32"
        )
    return dtype


def available_cores() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


@dataclass(frozen=True)
class Placement:
    """One TP rank's device and dtypes: what every part of its runner is built for."""

    device: torch.device
    dtype: torch.dtype  # the model's weights and activations
    kv_dtype: torch.dtype  # the KV cache's
    tp: TPGroup

    @classmethod
    def choose(cls, cfg: EngineConfig, tp: TPGroup, device: torch.device) -> Placement:
        """The placement cfg asks for on device; ValueError, naming the option, where it cannot run."""
        dtype = pick_dtype(cfg.dtype, device)
        kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else pick_dtype(cfg.kv_cache_dtype, device)
        if kv_dtype != dtype and device.type != "cpu":
            raise ValueError("a kv_cache_dtype other than the model dtype is only supported on CPU")
        check_quantization(cfg.quantization, device)
        return cls(device, dtype, kv_dtype, tp)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """ValueError, saying what to use instead, for a quantization this machine cannot run."""
    if quantization and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only")
    if quantization == "w8a8" and not cpu_kernels.available():
        raise ValueError(
            "quantization='w8a8' needs Relay's CPU kernels (a C compiler; RELAY_CPU_KERNELS not 0)"
        )
    if quantization == "w8a8" and not isa.int8_dot_products():
        raise ValueError(
            f"quantization='w8a8' needs a CPU with VNNI int8 dot products (AVX512-VNNI); this one "
            f"runs at {isa.level()!r}, where int8 GEMMs are slower than float32: use 'int8' "
            f"(weight-only) or no quantization"
        )
    if quantization == "int4" and not int4_supported():
        raise ValueError("quantization='int4' needs torch's CPU int4 kernels (torch >= 2.6)")


def claim_threads(cfg: EngineConfig, place: Placement) -> ThreadBackoff | None:
    """Set this rank's compute threads (on a GPU: its device) and return what the step loop
    calls after every step on CPU to back off from a busy host (None: the thread count stays)."""
    if not place.on_cpu:
        # An index, not "cuda": set_device refuses a device with no index (torch >= 2.11).
        torch.cuda.set_device(torch.device(place.device).index or 0)
        return None
    # Each rank gets its share of the cores: oversubscribing them is ~17x slower.
    threads = cfg.num_threads or max(1, available_cores() // place.tp.size)
    torch.set_num_threads(threads)
    if (
        cfg.num_threads is None
        and not cfg.disable_thread_backoff
        and threads > 1
        and backoff_supported()
    ):
        return ThreadBackoff(threads)
    return None
