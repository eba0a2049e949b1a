"""Relay's C kernels for CPUs, compiled on first use for this CPU and loaded with ctypes.

The sources sit in csrc/; the shared library goes to the cache folder under a name derived
from the sources, the compiler flags and this CPU's feature flags (it is built for this CPU's
instruction-set level, relay.execution.kernels.isa, so a cache shared between machines never hands one CPU
another's binary). Without a C compiler (or with RELAY_CPU_KERNELS=0) callers keep their
pure-torch paths. `warm_up()` builds it ahead of the first request.

This module builds, loads and binds the library; the calls into it are wrapped by concept:
cpu_attention (decode and prompt-chunk attention), cpu_gemm (the GEMMs), cpu_ops (RMSNorm,
rotary, SiLU-and-mul, grammar bitmasks) and cpu_layers (whole decoder layers in one call).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from relay.cache_dir import cache_dir
from relay.execution.kernels import isa
from relay.execution.kernels.isa import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = sorted(glob.glob(os.path.join(_CSRC, "*.c")))
_HEADERS = sorted(glob.glob(os.path.join(_CSRC, "*.h")))
_lib: ctypes.CDLL | None = None
_tried = False


def compiler() -> str | None:
    """The C compiler the library is built with ($CC, else gcc or cc), or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def library_path(level: str | None = None) -> str:
    """Where the library for an instruction-set level (default: this process's) is cached: named by
    its sources, compiler flags and this CPU's feature flags."""
    level = level or isa.level()
    h = hashlib.sha256(" ".join(_flags(level)).encode() + cpu_flags().encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    return os.path.join(cache_dir(), "kernels", f"relay_cpu-{level}-{h.hexdigest()[:16]}.so")


def _flags(level: str) -> list[str]:
    return ["-O3", *isa.compile_flags(level), "-fopenmp", "-fPIC", "-std=c11"]


def build(level: str | None = None) -> str:
    """The library built for an instruction-set level (default: the one this process runs at)."""
    level = level or isa.level()
    out = library_path(level)
    if os.path.exists(out):
        return out
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
        objects = _compile_each(cc, _flags(level), tmp)
        linked = os.path.join(tmp, "relay_cpu.so")
        _run([cc, "-shared", "-fopenmp", *objects, "-o", linked, "-lm"])
        os.replace(linked, out)  # atomic: concurrent builders never load a half-written file
    return out


def _compile_each(cc: str, flags: list[str], tmp: str) -> list[str]:
    """Each source compiled on its own core: one compiler call over all of them took ~33 s on a
    2-core Zen 4, most of it in two files; side by side the build is about the largest file's."""
    largest_first = sorted(_SOURCES, key=os.path.getsize, reverse=True)
    objects = [os.path.join(tmp, os.path.basename(src) + ".o") for src in largest_first]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        jobs = [
            pool.submit(_run, [cc, *flags, "-c", src, "-o", obj])
            for src, obj in zip(largest_first, objects)
        ]
        for job in jobs:
            job.result()
    return objects


def _run(command: list[str]) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(command)} failed: {e.stderr.strip()[-2000:]}") from None


def load() -> ctypes.CDLL | None:
    """The kernel library, or None if it cannot be built here (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("RELAY_CPU_KERNELS", "1") == "0":
        return None
    try:
        torch.zeros(1).sum()  # make sure torch's OpenMP runtime is the one our library binds to
        level = isa.level()
        _lib = build_level(level)
        logger.info(
            "CPU kernels built for %s%s",
            level,
            f" (held there by {isa.ENV})" if level != isa.detected_level() else "",
        )
    except (OSError, RuntimeError) as e:
        logger.warning("CPU kernels unavailable (%s); using the torch paths", e)
    return _lib


def build_level(level: str) -> ctypes.CDLL:
    """The kernel library for an instruction-set level at or below this CPU's, built and bound
    (tests run every kernel at every level the machine has; use() swaps it in)."""
    return bind(build(level))


def bind(path: str) -> ctypes.CDLL:
    """The kernel library at path with its functions' signatures declared (load() binds this
    checkout's build; benchmarks bind another build to compare the two in one process)."""
    lib = ctypes.CDLL(path)
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    # fmt: off
    lib.decode_attention.argtypes = [
        p, i64, p, i64, p, i64,  # q, new keys, new values: each with its row stride
        p, p, p, p, p, p,  # k and v caches, page tables, lengths, order, out
        i64, i64, i64, i64, i64, i64, i64, i64,  # B, H, HKV, D, S, table width, page size, chunk
        f32, i32, i32,  # scale, io_bf16, kv_bf16
        i64, f32,  # sliding window (0: none), soft-cap (0: none)
        i64, p, p, p,  # cascade groups: count, first ranks, sizes, shared keys
        p,  # float32 attention sinks per query head (NULL: none)
    ]
    lib.decode_attention.restype = None
    lib.extend_attention.argtypes = [
        p, i64, p, p, p, i64,  # q and its row stride, k and v caches, page tables and their width
        p, p, p, i64, p,  # q starts, prefix lengths, extend lengths, requests, out
        i64, i64, i64, i64, i64, f32, i32, i32,  # H, HKV, D, S, page size, scale, io_bf16, kv_bf16
        i64, f32,  # sliding window (0: none), soft-cap (0: none)
        p,  # float32 attention sinks per query head (NULL: none)
    ]
    # fmt: on
    lib.extend_attention.restype = i32
    lib.relay_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
    lib.relay_rope.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i32]
    lib.relay_silu_mul.argtypes = [p, p, i64, i64, i32]
    lib.relay_gelu_tanh_mul.argtypes = [p, p, i64, i64, i32]
    lib.relay_head_norm.argtypes = [p, p, p, i64, i64, i64, i64, i64, f32, i32]
    lib.relay_gemm_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.relay_gemm_bf16.restype = None
    lib.relay_gemm_bf16_available.restype = i32
    lib.relay_gemm_bf16_panels.argtypes = [p, i64, i32, p, p, p, i64, i32, i64, i64, i64]
    lib.relay_gemm_bf16_panels.restype = i32
    lib.relay_gemm_bf16_panel_features.restype = i32
    lib.relay_gemm_amx_available.restype = i32
    lib.relay_tiled_attention_available.argtypes = [i32, i32, i64]
    lib.relay_tiled_attention_available.restype = i32
    lib.relay_gemm_blocks.argtypes = [i32, p, p, p, p, i64, p, i64, i64, i64, i64, i32]
    lib.relay_gemm_blocks.restype = i32
    lib.relay_gemm_blocks_available.restype = i32
    lib.relay_gemm_widen.argtypes = [p, i64, p, p, i64, i64, i64, i64]
    lib.relay_gemm_widen.restype = i32
    lib.relay_gemm_widen_available.restype = i32
    lib.relay_quantize_rows.argtypes = [p, i64, i64, i32, p, p]
    lib.relay_dequantize_rows.argtypes = [p, i64, i64, p, p, p, i32, p, i32]
    lib.relay_apply_bitmask.argtypes = [p, i64, p, p, i64, i64, i64]
    lib.relay_apply_bitmask.restype = None
    lib.relay_decode_layers.argtypes = [p, i64, p]
    lib.relay_decode_layers.restype = i32
    lib.relay_prompt_layers.argtypes = [p, i64, p]
    lib.relay_prompt_layers.restype = i32
    lib.relay_shm_segment_bytes.argtypes = [i64, i64]
    lib.relay_shm_segment_bytes.restype = i64
    lib.relay_shm_all_reduce.argtypes = [p, p, i64, i32]
    lib.relay_shm_all_reduce.restype = i32
    lib.relay_shm_all_gather.argtypes = [p, p, i64, p]
    lib.relay_shm_all_gather.restype = i32
    return lib


def use(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """Make lib (from bind) the library every kernel call goes to; returns the one it replaces.
    For in-process A/B benchmarks only."""
    global _lib
    old, _lib = _lib, lib
    return old


warm_up = load


def available() -> bool:
    return load() is not None


def bf16_flag(t: torch.Tensor) -> int:
    """The kernels' dtype argument for t's data: 1 for bfloat16, 0 for float32."""
    return int(t.dtype == torch.bfloat16)
