#!/usr/bin/env python3
"""Block GEMMs with float32 activations vs int8 block activations (--block-activations), per shape and
row count, at one instruction-set level, on one thread: the default model's GEMM shapes (qkv 960 x 576,
gate_up 3072 x 576, its Q8_0 LM head 49152 x 576) filled with random GGUF-quantized weights.

    python scripts/bench_block_dot.py --level avx2
    python scripts/bench_block_dot.py --level amx --rows 1,8,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]

from relay.execution.kernels import cpu, cpu_gemm  # noqa: E402
from relay.execution.weight_blocks import recover  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--level", default=None, help="instruction-set level (default: this CPU's)")
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    cpu.use(cpu.build_level(args.level)) if args.level else cpu.load()
    torch.set_num_threads(1)
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
