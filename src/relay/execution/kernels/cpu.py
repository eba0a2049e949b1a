"""Relay's C kernels for CPUs, compiled on first use for this CPU and loaded with ctypes.

The sources sit in csrc/; the shared library goes to the cache folder under a name derived
from the sources, the compiler flags and this CPU's feature flags (it is built for this CPU's
instruction-set level, relay.execution.kernels.isa, so a cache shared between machines never hands one CPU
another's binary). Without a C compiler (or with RELAY_CPU_KERNELS=0) callers keep their
pure-torch paths. `warm_up()` builds it ahead of the first request.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from relay.execution.kernels import isa
from relay.execution.kernels.isa import cpu_flags
from relay.execution.model_files import cache_dir

if TYPE_CHECKING:
    from relay.execution.weight_blocks import BlockWeight

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = sorted(glob.glob(os.path.join(_CSRC, "*.c")))
_HEADERS = sorted(glob.glob(os.path.join(_CSRC, "*.h")))
_lib: ctypes.CDLL | None = None
_tried = False


def compiler() -> str | None:
    """The C compiler the library is built with ($CC, else gcc or cc), or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(level: str | None = None) -> str:
    """The library built for an instruction-set level (default: the one this process runs at)."""
    level = level or isa.level()
    flags = ["-O3", *isa.compile_flags(level), "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    h = hashlib.sha256(" ".join(flags).encode() + cpu_flags().encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    out = os.path.join(cache_dir(), "kernels", f"relay_cpu-{level}-{h.hexdigest()[:16]}.so")
    if os.path.exists(out):
        return out
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, *_SOURCES, "-o", tmp, "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {_SOURCES} failed: {e.stderr.strip()[-2000:]}") from None
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
    return bind(_build(level))


def bind(path: str) -> ctypes.CDLL:
    """The kernel library at path with its functions' signatures declared (load() binds this
    checkout's build; benchmarks bind another build to compare the two in one process)."""
    lib = ctypes.CDLL(path)
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.decode_attention.argtypes = [
        p,
        i64,
        p,
        i64,
        p,
        i64,
        p,
        p,
        p,
        p,
        p,
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        i32,
        i32,
        i64,
        p,
        p,
        p,
    ]
    lib.decode_attention.restype = None
    lib.extend_attention.argtypes = [
        p,
        i64,
        p,
        p,
        p,
        i64,
        p,
        p,
        p,
        i64,
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        i32,
        i32,
    ]
    lib.extend_attention.restype = i32
    lib.relay_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
    lib.relay_rope.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i32]
    lib.relay_silu_mul.argtypes = [p, p, i64, i64, i32]
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

# Tokens per decode-attention work item: long requests split so every thread gets work; short
# ones stay whole (a split costs a merge).
DECODE_CHUNK = 512
MAX_GROUP = 16  # query heads per kv head the kernel takes (csrc/decode_attention.c)


# csrc/gemm_bf16.c takes up to 8 rows; above 3 oneDNN's blocked GEMM is faster on a Zen 4 (the
# kernel turns compute-bound), below it streams the weights at 1.6-2x oneDNN's speed.
GEMM_BF16_MAX_ROWS = 3


def tiled_attention_available(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels that take many query rows per tile of keys run with these query and
    cache dtypes here: extend_attention (prompt chunks) and decode_attention's cascade (a group's
    shared prefix attended once for all of it). float32, or bfloat16 widened, at every level (head_dim
    a multiple of 16 with AVX-512, of 8 below); bfloat16 queries over a bfloat16 cache on VDPBF16PS
    with AVX512-BF16 (head_dim a multiple of 32)."""
    lib = load()
    return lib is not None and bool(
        lib.relay_tiled_attention_available(
            int(q_dtype == torch.bfloat16), int(kv_dtype == torch.bfloat16), head_dim
        )
    )


def gemm_bf16_available() -> bool:
    lib = load()
    return lib is not None and bool(lib.relay_gemm_bf16_available())


def available() -> bool:
    return load() is not None


@dataclass
class Bf16Panels:
    """A bfloat16 [N, K] weight repacked for csrc/gemm_bf16.c's relay_gemm_bf16_panels: panels of
    `panel` output features (N padded with zero rows), each [K / 2, panel] pairs of weights."""

    data: torch.Tensor  # int32 [panels, K / 2, panel]: feature n's weights 2p (low half), 2p + 1
    out_features: int
    in_features: int


def amx_available() -> bool:
    """Whether the panels' GEMMs run on AMX tiles here (csrc/gemm_amx.c): the library was built
    for the amx level and Linux granted the tile state."""
    lib = load()
    return lib is not None and bool(lib.relay_gemm_amx_available())


def panels_preferred() -> bool:
    """Whether a bfloat16 model's batched GEMMs run on Bf16Panels here rather than on oneDNN's
    prepacked weights (and then a step's layers run in one C call): where the CPU has AVX512-BF16,
    the panels on VDPBF16PS, unless it has AMX too, where they run on tiles (the panels are AMX's
    B operand as they stand: csrc/gemm_amx.c) if Linux granted the tile state. With AVX512-BF16
    alone oneDNN reaches ~60 % of the VDPBF16PS peak at 32 rows and the panels ~85 % (Zen 4,
    docs/benchmarks.md); with AMX and the tiles refused, oneDNN's tile GEMMs (560 GFLOP/s at 32
    rows on a 2-core Xeon, ../shared/FACTS.md) beat any VDPBF16PS kernel."""
    if not gemm_bf16_available():
        return False
    return amx_available() or not isa.at_least("amx")


def pack_panels(w: torch.Tensor) -> Bf16Panels | None:
    """w [N, K] bfloat16 as Bf16Panels, or None where K is odd or the kernel is not built here."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or k % 2 or not gemm_bf16_available():
        return None
    panel = _lib.relay_gemm_bf16_panel_features()
    padded = torch.zeros(-(-n // panel) * panel, k, dtype=torch.bfloat16)
    padded[:n] = w
    pairs = padded.view(-1, panel, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Bf16Panels(pairs.view(torch.int32).view(-1, k // 2, panel), n, k)


def gemm_panels(
    x: torch.Tensor,
    w: Bf16Panels,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] bfloat16 or float32 (rounded to bfloat16) times w (+ bias, bfloat16) -> [M, N] in
    out_dtype (bfloat16 or float32)."""
    if x.stride(-1) != 1 or (x.dtype == torch.bfloat16 and x.stride(0) % 2):
        x = x.contiguous()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=out_dtype)
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
    if not _lib.relay_gemm_bf16_panels(
        x.data_ptr(),
        x.stride(0),
        int(x.dtype == torch.float32),
        w.data.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        int(out_dtype == torch.float32),
        m,
        w.out_features,
        w.in_features,
    ):
        raise RuntimeError(f"relay_gemm_bf16_panels refused x {tuple(x.shape)} {x.dtype}")
    return y


def gemm_bf16(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] bf16 (M <= GEMM_BF16_MAX_ROWS), w [N, K] bf16 contiguous -> [M, N] in out_dtype
    (bfloat16 or float32). Only where gemm_bf16_available()."""
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    _lib.relay_gemm_bf16(
        x.data_ptr(),
        w.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        int(out_dtype == torch.float32),
    )
    return y


def gemm_blocks_available() -> bool:
    lib = load()
    return lib is not None and bool(lib.relay_gemm_blocks_available())


def gemm_blocks(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """x [M, K] float32 times a weight kept in GGUF blocks (relay.execution.weight_blocks) -> [M, N] float32.
    Only where gemm_blocks_available()."""
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    _lib.relay_gemm_blocks(
        w.kernel_bits,
        w.q.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        m,
        w.out_features,
        w.in_features,
        int(w.round_bf16),
    )
    return y


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """logits [*, vocab] float32 (rows contiguous): -inf where masks [n, words] int32 (one row of
    bits per entry of rows, int64) disallow a token. Only where load() found the library."""
    _lib.relay_apply_bitmask(
        logits.data_ptr(),
        logits.stride(0),
        rows.data_ptr(),
        masks.data_ptr(),
        rows.numel(),
        masks.shape[1],
        logits.shape[1],
    )


def int8_matmul(
    x: torch.Tensor,
    qt: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times an int8 weight qt [K, N] with float32 scales w_scale [N]
    per output: x quantized to int8 per row, multiplied in int8 (torch._int_mm, int32 sums), scaled
    back (+ bias) into out_dtype."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    x_scale = torch.empty(m, dtype=torch.float32)
    _lib.relay_quantize_rows(x.data_ptr(), m, k, _bf16(x), q.data_ptr(), x_scale.data_ptr())
    acc = torch._int_mm(q, qt)
    y = torch.empty(m, qt.shape[1], dtype=out_dtype)
    _lib.relay_dequantize_rows(
        acc.data_ptr(),
        m,
        qt.shape[1],
        x_scale.data_ptr(),
        w_scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        0 if bias is None else _bf16(bias),
        y.data_ptr(),
        _bf16(y),
    )
    return y


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x) * weight, or with a residual: residual += x in place, then its rms_norm, written
    over x (which the caller no longer needs). x, residual [T, H] contiguous, float32 or bfloat16."""
    out = x if residual is not None else torch.empty_like(x)
    _lib.relay_rms_norm(
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        _bf16(x),
    )
    return out


def rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_q: int,
    num_k: int,
    head_dim: int,
) -> None:
    """Rotate the q and k heads at the start of each qkv row in place (neox style); cos/sin are the
    float32 [positions, head_dim] tables of RotaryEmbedding, positions int64 [T]."""
    _lib.relay_rope(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        qkv.shape[0],
        qkv.stride(0),
        num_q,
        num_k,
        head_dim,
        _bf16(qkv),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [T, 2 * I] gate_up (gate first)."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    _lib.relay_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, _bf16(gate_up))
    return out


# Requests that share at least this many leading tokens' pages attend them together (cascade).
MIN_SHARED_TOKENS = 64


def padded_tables(page_tables: list[list[int]]) -> np.ndarray:
    """The requests' page tables as one int32 [requests, longest] array, zero-padded (the kernels
    read a table only up to its request's length)."""
    tables = np.zeros((len(page_tables), max(len(t) for t in page_tables)), dtype=np.int32)
    for i, t in enumerate(page_tables):
        tables[i, : len(t)] = t
    return tables


class DecodePlan:
    """What every layer's decode attention call of one step shares (built once per step).

    share: find requests whose first pages are the same (a cached shared prefix), for the
    kernel to attend those keys once for all of them (where tiled_attention_available)."""

    def __init__(
        self,
        page_tables: list[list[int]],
        lens: list[int],
        page_size: int = 16,
        share: bool = False,
    ):
        tables = padded_tables(page_tables)
        self.tables = torch.from_numpy(tables)
        self.lens = torch.tensor(lens, dtype=torch.int64)
        # Requests that share their first page (a prefix) side by side: one thread then finds
        # that prefix's KV in its cache for the next one, and a group is a run of this order.
        order = np.argsort(tables[:, 0], kind="stable")
        self.order = torch.from_numpy(order.astype(np.int64))
        groups = _shared_groups(tables[order], np.asarray(lens)[order], page_size) if share else []
        self.num_groups = len(groups)
        self.groups = (
            torch.tensor(groups, dtype=torch.int64).T.contiguous()
            if groups
            else torch.zeros(3, 1, dtype=torch.int64)
        )


def _shared_groups(
    tables: np.ndarray, lens: np.ndarray, page_size: int
) -> list[tuple[int, int, int]]:
    """(first rank, size, shared tokens) of each run of requests (in this order) that share at
    least MIN_SHARED_TOKENS leading tokens' pages; each keeps at least its newest token its own."""
    groups = []
    start = 0
    for end in range(1, len(tables) + 1):
        if end < len(tables) and tables[end, 0] == tables[start, 0]:
            continue
        if end - start >= 2:
            run = tables[start:end]
            differs = (run != run[0]).any(axis=0)
            common = int(np.argmax(differs)) if differs.any() else run.shape[1]
            keys = min(
                common * page_size, (int(lens[start:end].min()) - 1) // page_size * page_size
            )
            if keys >= MIN_SHARED_TOKENS:
                groups.append((start, end - start, keys))
        start = end
    return groups


def decode_attention(
    lib: ctypes.CDLL,
    plan: DecodePlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_size: int,
    scale: float,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] (rows may be strided: a view into qkv), float32 or bfloat16; k/v caches
    [HKV, S, D] float32 or bfloat16. new_k/new_v [B, HKV, D] (views into qkv, in q's dtype): the new
    token's keys and values, written into the cache at each request's last position first.
    Returns [B, H, D] in q's dtype."""
    b, h, d = q.shape
    hkv, s, _ = k.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype)
    write = new_k is not None
    if write:
        new_k, new_v = (
            t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (new_k, new_v)
        )
    lib.decode_attention(
        q.data_ptr(),
        q.stride(0),
        new_k.data_ptr() if write else 0,
        new_k.stride(0) if write else 0,
        new_v.data_ptr() if write else 0,
        new_v.stride(0) if write else 0,
        k.data_ptr(),
        v.data_ptr(),
        plan.tables.data_ptr(),
        plan.lens.data_ptr(),
        plan.order.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        s,
        plan.tables.shape[1],
        page_size,
        DECODE_CHUNK,
        scale,
        int(q.dtype == torch.bfloat16),
        int(k.dtype == torch.bfloat16),
        plan.num_groups
        if plan.num_groups and tiled_attention_available(q.dtype, k.dtype, d)
        else 0,
        plan.groups[0].data_ptr(),
        plan.groups[1].data_ptr(),
        plan.groups[2].data_ptr(),
    )
    return out


class ExtendPlan:
    """What every layer's prompt-chunk attention call of one step shares: the requests with more
    than one new token, their page tables, and where their tokens sit among the step's rows."""

    def __init__(
        self,
        page_tables: list[list[int]],
        prefix_lens: list[int],
        extend_lens: list[int],
        q_starts: list[int],
    ):
        self.tables = torch.from_numpy(padded_tables(page_tables))
        self.prefix_lens = torch.tensor(prefix_lens, dtype=torch.int64)
        self.extend_lens = torch.tensor(extend_lens, dtype=torch.int64)
        self.q_starts = torch.tensor(q_starts, dtype=torch.int64)


def extend_attention(
    lib: ctypes.CDLL,
    plan: ExtendPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
    scale: float,
) -> bool:
    """Attention of each planned request's new tokens (rows of q [T, H, D], strided rows allowed)
    over its cached prefix and themselves, written into out [T, H, D] (contiguous, q's dtype);
    their keys and values must be in the cache already. False if this shape is not supported."""
    t, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    hkv, s, _ = k.shape
    return bool(
        lib.extend_attention(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            v.data_ptr(),
            plan.tables.data_ptr(),
            plan.tables.shape[1],
            plan.q_starts.data_ptr(),
            plan.prefix_lens.data_ptr(),
            plan.extend_lens.data_ptr(),
            len(plan.q_starts),
            out.data_ptr(),
            h,
            hkv,
            d,
            s,
            page_size,
            scale,
            int(q.dtype == torch.bfloat16),
            int(k.dtype == torch.bfloat16),
        )
    )
