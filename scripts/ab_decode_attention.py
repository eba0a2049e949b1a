#!/usr/bin/env python3
"""Decode attention of two builds of Relay's kernel library, one layer, alternating call by call
in one process (medians of thread CPU time: a busy host's waits do not count), on the default
model's shapes: B requests of L tokens, pages of 32 shuffled over the pool (as a pool that has
served a while leaves them), float32 queries over a float32 and a bfloat16 cache.

    python scripts/ab_decode_attention.py OLD.so NEW.so          # B=32 L=600 H=9 HKV=3 D=64
    SAME=1 python scripts/ab_decode_attention.py OLD.so NEW.so   # every request on one request's
                                                                 # pages: the KV in L2, compute alone

Environment: B, L, H, HKV, D, REPS (15), THREADS (1), KV (float32,bfloat16). A library for a level
(e.g. held to AVX2): python -c "from relay.execution.kernels import cpu; print(cpu.build('avx2'))" run
from each checkout (with its src first on PYTHONPATH).
"""

import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from relay.execution.kernels import cpu, cpu_attention  # noqa: E402

PS = 32


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    paths = [os.path.abspath(p) for p in sys.argv[1:3]]
    libs = [cpu.bind(p) for p in paths]
    B, L = int(os.environ.get("B", 32)), int(os.environ.get("L", 600))
    H, HKV, D = (
        int(os.environ.get("H", 9)),
        int(os.environ.get("HKV", 3)),
        int(os.environ.get("D", 64)),
    )
    reps = int(os.environ.get("REPS", 15))
    for kv_name in os.environ.get("KV", "float32,bfloat16").split(","):
        pages_each = -(-L // PS)
        pages = list(range(1, 1 + B * pages_each))
        random.Random(0).shuffle(pages)
        owner = (lambda b: 0) if os.environ.get("SAME") else (lambda b: b)
        tables = [pages[owner(b) * pages_each : (owner(b) + 1) * pages_each] for b in range(B)]
        k = torch.randn(HKV, (1 + B * pages_each) * PS, D).to(getattr(torch, kv_name))
        v = torch.randn_like(k)
        plan = cpu_attention.DecodePlan(tables, [L] * B, PS)
        q = torch.randn(B, H, D)
        outs = [cpu_attention.decode_attention(lib, plan, q, k, v, PS, D**-0.5) for lib in libs]
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        times = [[], []]
        for r in range(reps):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                t0 = time.thread_time()
                cpu_attention.decode_attention(libs[i], plan, q, k, v, PS, D**-0.5)
                times[i].append(time.thread_time() - t0)
        a, b = (statistics.median(t) * 1e3 for t in times)
        print(
            f"B={B} L={L} H={H}/{HKV} D={D} kv={kv_name}{' (same pages)' if os.environ.get('SAME') else ''}: "
            f"{os.path.basename(paths[0])} {a:.3f} ms, {os.path.basename(paths[1])} {b:.3f} ms, "
            f"first/second {a / b:.2f}x (max |diff| {diff:.1e})",
            flush=True,
        )


if __name__ == "__main__":
    main()
