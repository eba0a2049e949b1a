#!/usr/bin/env python3
"""Relay's CPU attention kernels alone, on the default model's shapes (9 query heads, 3 kv heads,
head_dim 64, pages of 32 tokens) over 30 layers of distinct KV, float32 (or --dtype bfloat16; --kv-dtype
bfloat16 alone: float queries over a bfloat16 cache):

  decode    B requests of L tokens each, their pages shuffled over the pool (as a pool that has
            served a while leaves them)
  cascade   decode of B requests in groups that share a cached prefix (a system prompt): the
            shared keys are attended once per group, then each request's own
  extend    prompt chunks of R requests, N new tokens each, over a cached prefix of P tokens

Prints the best of --reps calls of all 30 layers, in ms and GFLOP/s (scores and values, 4 flops
per query-key-dim). Run it twice around a kernel change, alternating, on a quiet machine:

  python scripts/bench_attention_cpu.py
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from relay.execution.kernels import cpu, cpu_attention  # noqa: E402

H, HKV, D, PS, LAYERS = 9, 3, 64, 32, 30


def _caches(pages: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(HKV, pages * PS, D, dtype=dtype), torch.randn(HKV, pages * PS, D, dtype=dtype))
        for _ in range(LAYERS)
    ]


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def decode(
    lib, batch: int, length: int, reps: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[float, float]:
    pages_each = -(-length // PS)
    pages = list(range(1, 1 + batch * pages_each))
    random.Random(0).shuffle(pages)
    tables = [pages[b * pages_each : (b + 1) * pages_each] for b in range(batch)]
    kv = _caches(1 + batch * pages_each, kv_dtype)
    plan = cpu_attention.DecodePlan(tables, [length] * batch, PS)
    q = torch.randn(batch, H, D, dtype=dtype)
    s = _best(
        lambda: [cpu_attention.decode_attention(lib, plan, q, k, v, PS, D**-0.5) for k, v in kv],
        reps,
    )
    return s * 1e3, batch * H * length * D * 4 * LAYERS / s / 1e9


def cascade(
    lib,
    batch: int,
    groups: int,
    shared: int,
    own: int,
    reps: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> tuple[float, float]:
    shared_pages, own_pages = shared // PS, -(-own // PS)
    first_own = 1 + groups * shared_pages
    tables = [
        list(
            range(
                1 + (b * groups // batch) * shared_pages,
                1 + (b * groups // batch + 1) * shared_pages,
            )
        )
        + list(range(first_own + b * own_pages, first_own + (b + 1) * own_pages))
        for b in range(batch)
    ]
    kv = _caches(first_own + batch * own_pages, kv_dtype)
    plan = cpu_attention.DecodePlan(tables, [shared + own] * batch, PS, share=True)
    q = torch.randn(batch, H, D, dtype=dtype)
    s = _best(
        lambda: [cpu_attention.decode_attention(lib, plan, q, k, v, PS, D**-0.5) for k, v in kv],
        reps,
    )
    return s * 1e3, batch * H * (shared + own) * D * 4 * LAYERS / s / 1e9


def extend(
    lib, requests: int, prefix: int, new: int, reps: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[float, float]:
    pages = -(-(prefix + new) // PS)
    kv = _caches(1 + requests * pages, kv_dtype)
    tables = [list(range(1 + r * pages, 1 + (r + 1) * pages)) for r in range(requests)]
    plan = cpu_attention.ExtendPlan(
        tables, [prefix] * requests, [new] * requests, [r * new for r in range(requests)]
    )
    q = torch.randn(requests * new, H, D, dtype=dtype)
    out = torch.empty_like(q)
    s = _best(
        lambda: [
            cpu_attention.extend_attention(lib, plan, q, k, v, out, PS, D**-0.5) for k, v in kv
        ],
        reps,
    )
    return s * 1e3, requests * new * H * (prefix + new / 2) * D * 4 * LAYERS / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--kv-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the cache's dtype (default: --dtype's); float32 queries over a bfloat16 cache are "
        "the one-call decode step's (a bfloat16 model with GGUF blocks)",
    )
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu.load()
    if lib is None:
        sys.exit("Relay's CPU kernels are not available here (no C compiler?)")
    dtype = getattr(torch, args.dtype)
    kv_dtype = getattr(torch, args.kv_dtype or args.dtype)
    cases = [
        ("decode: 32 requests x 256 tokens, shuffled pages", decode, (32, 256)),
        ("decode: 8 requests x 1,024 tokens, shuffled pages", decode, (8, 1024)),
        ("cascade: 32 requests, 2 groups x 16, 1,024 shared + 64 own", cascade, (32, 2, 1024, 64)),
        ("cascade: 32 requests, 4 groups x 8, 1,024 shared + 64 own", cascade, (32, 4, 1024, 64)),
        ("extend: 4 x 64 new tokens over a 1,024-token prefix", extend, (4, 1024, 64)),
        ("extend: 1 x 256 new tokens, no prefix", extend, (1, 0, 256)),
    ]
    for name, fn, shape in cases:
        ms, gflops = fn(lib, *shape, args.reps, dtype, kv_dtype)
        print(f"{name:<62} {ms:7.1f} ms  {gflops:5.0f} GFLOP/s")


if __name__ == "__main__":
    main()
