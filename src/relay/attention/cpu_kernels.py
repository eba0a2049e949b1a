"""Relay's C kernels for the CPU backend, compiled on first use and loaded with ctypes.

The C source sits beside this file; the shared library goes to the cache folder under a
name derived from the source and compiler flags, so it is built once per machine. Without
a C compiler (or with RELAY_CPU_KERNELS=0) the backend keeps its pure-torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from relay.model_files import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> str:
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = os.path.join(cache_dir(), "kernels", f"cpu_decode-{digest}.so")
    if os.path.exists(out):
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, _SOURCE, "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {_SOURCE} failed: {e.stderr.strip()[-2000:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


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
        lib = ctypes.CDLL(_build())
    except (OSError, RuntimeError) as e:
        logger.warning("CPU attention kernel unavailable (%s); using the torch path", e)
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for fn in (lib.decode_attention_f32, lib.decode_attention_bf16):
        fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, f32]
        fn.restype = None
    _lib = lib
    return lib


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] float32 contiguous; k/v [HKV, S, D] float32 or bfloat16; slots [B, W] int64;
    lens [B] int64. Returns [B, H, D] float32."""
    b, h, d = q.shape
    hkv, s, _ = k.shape
    out = torch.empty_like(q)
    fn = lib.decode_attention_f32 if k.dtype == torch.float32 else lib.decode_attention_bf16
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), lens.data_ptr(), out.data_ptr(),
       b, h, hkv, d, s, slots.shape[1], scale)
    return out
