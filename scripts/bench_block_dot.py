#!/usr/bin/env python3
"""Block GEMMs with float32 activations vs int8 block activations (--block-activations), per shape and
row count, at one instruction-set level, on one thread: the default model's GEMM shapes (qkv 960 x 576,
gate_up 3072 x 576, its Q8_0 LM head 49152 x 576) filled with random GGUF-quantized weights.

    python scripts/bench_block_dot.py --level avx2
    python scripts/bench_block_dot.py --level amx --rows 1,8,32

--gemv: batch-1 GEMVs of a 2B-class model's shapes ([1 x 2048] x [8192 x 2048]^T, [1 x 8192] x
[2048 x 8192]^T) per kernel form - Q8_0's, Q6_K's (int8 quants, scales per 16), Q5_K's (a minimum
per 32), Q4_K's (4-bit, a minimum per 32), a Q4_K_M fused q/k/v's (scales and minima per 16) -
the k-quants' each with float32 d and m ("f32 scales") and with the file's compact scales
(KSCALES_FLAG, "compact") - as microseconds per GEMV and GB/s of the bytes it reads (quants and
scales), float32 and int8 activations, each call on the next of enough copies of the weight that
they come from memory, not the last-level cache:

    python scripts/bench_block_dot.py --gemv --level avx512
    python scripts/bench_block_dot.py --gemv --forms Q4_K,Q6_K
    python scripts/bench_block_dot.py --gemv --forms Q4_K --shapes 6144x4096,28672x4096 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "src")]  # this checkout's relay, not an installed one

from relay.execution.gguf_blocks import DECODERS, common_form, decode_rows, pack_rows  # noqa: E402
from relay.execution.kernels import cpu, cpu_gemm  # noqa: E402
from relay.execution.weight_blocks import BlockWeight, recover  # noqa: E402

SHAPES = [("q4_1", 960, 576), ("q4_1", 3072, 576), ("q8_0", 49152, 576)]


def weight(n: int, k: int, kind: str) -> torch.Tensor:
    """A random [n, k] weight quantized to Q4_1 or Q8_0 as ggml does, dequantized as gguf-py does."""
    b = (np.random.default_rng(0).standard_normal((n * k // 32, 32)) * 0.05).astype(np.float32)
    if kind == "q4_1":
        lo, d = b.min(1), (b.max(1) - b.min(1)) / 15
        q = np.minimum(15, ((b - lo[:, None]) / d[:, None] + 0.5).astype(np.int8)).astype(
            np.float32
        )
        w = (
            d.astype(np.float16).astype(np.float32)[:, None] * q
            + lo.astype(np.float16).astype(np.float32)[:, None]
        )
    else:
        d = np.abs(b).max(1) / 127
        w = d.astype(np.float16).astype(np.float32)[:, None] * np.round(b / d[:, None]).astype(
            np.float32
        )
    return torch.from_numpy(w.reshape(n, k))


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        times.append((time.perf_counter() - t0) / 5 * 1e3)
    return statistics.median(times)


GEMV_SHAPES = [(8192, 2048), (2048, 8192)]
# form name -> the GGUF types whose rows it holds (fused in this order, near-equal parts)
GEMV_FORMS = {"Q8_0": [8], "Q6_K": [14], "Q5_K": [13], "Q4_K": [12], "Q4_K+Q6_K": [12, 12, 14]}


def raw_rows(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw GGUF blocks of a type (small float16 scales: weights ~0.05)."""
    per, size, _ = DECODERS[qtype]
    b = rng.integers(0, 256, (rows * k // per, size), dtype=np.uint8)
    at = {8: slice(0, 2), 14: slice(208, 210), 13: slice(0, 4), 12: slice(0, 4)}[qtype]
    b[:, at] = (
        rng.uniform(1e-5, 5e-5, (b.shape[0], (at.stop - at.start) // 2))
        .astype(np.float16)
        .view(np.uint8)
    )
    if qtype == 8:  # a Q8_0 quant is never -128
        b[:, 2:] = np.maximum(b[:, 2:].view(np.int8), -127).view(np.uint8)
    return b.reshape(rows, -1)


def gemv_weight(form: str, n: int, k: int, seed: int, compact: bool = False) -> BlockWeight:
    rng = np.random.default_rng(seed)
    types = GEMV_FORMS[form]
    sizes = [n // len(types)] * (len(types) - 1)
    sizes.append(n - sum(sizes))
    parts = [decode_rows(raw_rows(t, r, k, rng), t, k) for t, r in zip(types, sizes)]
    rows = common_form(parts)
    has_m = rows.bits == 4 or bool((rows.m != 0).any())  # pack()'s choice, for both forms
    return pack_rows(rows, n, k, has_m, compact)


def read_bytes(w: BlockWeight) -> int:
    """What one GEMV reads of w: its quants, d, and m where the form has one (or the records)."""
    return sum(t.numel() * t.element_size() for t in (w.q, w.d, w.m))


def gemv_table(
    reps: int, rounds: int, llc_bytes: int, threads: int, forms: list[str], shapes: list
) -> None:
    """Each (shape, form, activations) timed in `rounds` rounds taken in turn (a loaded host's
    drift spread over all), each round `reps` x 5 calls; GB/s at the median and best call time.
    On one thread the time is the calling thread's CPU time (the kernel runs on it alone): on a
    shared host wall time also counts the turns other processes take on the core."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    calls, sizes = {}, {}
    for n, k in shapes:
        x = torch.randn(1, k)
        for form, compact in (
            (f, c) for f in forms for c in ((False, True) if "_K" in f else (False,))
        ):
            first = gemv_weight(form, n, k, 0, compact)
            copies = max(2, -(-3 * llc_bytes // read_bytes(first)))  # 3x the LLC: from memory
            exact = [first] + [gemv_weight(form, n, k, i, compact) for i in range(1, copies)]
            form = f"{form} {'compact' if compact else 'f32 scales'}"
            sizes[n, k, form] = (first.kernel_bits, read_bytes(first))
            for act, ws in (("float32", exact), ("int8", [w.to_dot() for w in exact])):
                at = [0]

                def call(ws=ws, at=at, x=x) -> None:
                    cpu_gemm.gemm_blocks(x, ws[at[0] % len(ws)])
                    at[0] += 1

                for _ in range(len(ws)):
                    call()  # warm: every copy once
                calls[n, k, form, act] = (call, [])
    for _ in range(rounds):
        for call, times in calls.values():
            for _ in range(reps):
                t0 = clock()
                for _ in range(5):
                    call()
                times.append((clock() - t0) / 5)
    print(
        "| weight | form | kernel_bits | bits / weight | float32 x us | float32 x GB/s"
        " | int8 x us | int8 x GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (n, k, form), (bits, size) in sizes.items():
        cells = []
        for act in ("float32", "int8"):
            times = calls[n, k, form, act][1]
            med = statistics.median(times)
            cells.append(f"{med * 1e6:.0f} (best {min(times) * 1e6:.0f})")
            cells.append(f"{size / med / 1e9:.1f} (best {size / min(times) / 1e9:.1f})")
        print(
            f"| {n} x {k} | {form} | {hex(bits)} | {8 * size / (n * k):.2f} | {' | '.join(cells)} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--level", default=None, help="instruction-set level (default: this CPU's)")
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--gemv", action="store_true", help="batch-1 GEMVs per form, in GB/s")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="--gemv: rounds over every case in turn")
    ap.add_argument("--llc-mb", type=int, default=32, help="last-level cache to stream past")
    ap.add_argument("--forms", default=",".join(GEMV_FORMS), help="--gemv: which forms")
    ap.add_argument(
        "--shapes",
        default=",".join(f"{n}x{k}" for n, k in GEMV_SHAPES),
        help="--gemv: N x K weights, e.g. an 8B's 6144x4096,28672x4096,4096x14336",
    )
    args = ap.parse_args()
    cpu.use(cpu.build_level(args.level)) if args.level else cpu.load()
    torch.set_num_threads(args.threads)
    if args.gemv:
        clock = "CPU time of the calling thread" if args.threads == 1 else "wall time"
        print(
            f"level {args.level or 'native'}, {args.threads} thread(s); GB/s at the median (best)"
            f" call of {args.rounds} rounds x {args.reps} x 5, by {clock}"
        )
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        gemv_table(
            args.reps, args.rounds, args.llc_mb << 20, args.threads, args.forms.split(","), shapes
        )
        return
    print(f"level {args.level or 'native'}, 1 thread; ms, median of {args.reps} x 5 calls")
    print("| weight | rows | float | int8 | float / int8 |\n|---|---|---|---|---|")
    for kind, n, k in SHAPES:
        exact = recover(weight(n, k, kind))
        dot = exact.to_dot()
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            f = median_ms(lambda: cpu_gemm.gemm_blocks(x, exact), args.reps)
            d = median_ms(lambda: cpu_gemm.gemm_blocks(x, dot), args.reps)
            print(f"| {kind} {n} x {k} | {rows} | {f:.3f} | {d:.3f} | {f / d:.2f}x |")


if __name__ == "__main__":
    main()
