#!/usr/bin/env python3
"""Sliding-window attention on CPU, before and after Relay's C kernels took windows (issue 37).

1. One layer's decode attention through the CPU attention backend: B requests of L tokens (pages
   shuffled over the pool, as a pool that has served a while leaves them), a window of W:
     torch   the backend's torch path, masking the window in Python (what a windowed model ran before)
     C full  the C kernel over the whole context (what attending it costs without skipping)
     C win   the C kernel with the window: only the pages in it are read
2. A Gemma-3-shaped random model (five sliding layers to one global, window W, head_dim 256, one kv
   head): a decode step of B requests at L tokens, and a prompt chunk of --prefill tokens over
   --prefill-over cached ones, attention on the torch path (before) and in the C kernels (after),
   through the real ModelRunner.

    python scripts/bench_window_attention.py                       # B=8 L=8192 W=512
    python scripts/bench_window_attention.py --batch 1 --context 4096 --skip-model

Medians of wall time (ms); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src"), os.path.join(ROOT, "scripts")]

import torch  # noqa: E402

from relay.execution.attention.base import StepMeta  # noqa: E402
from relay.execution.attention.torch_native import TorchNativeBackend  # noqa: E402
from relay.memory.kv_cache import KVCache  # noqa: E402

PS = 16


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def attention_only(args, dtype: torch.dtype) -> None:
    b, length, w = args.batch, args.context, args.window
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    pages_each = -(-length // PS)
    kv = KVCache(1, 1 + b * pages_each, PS, hkv, d, dtype, torch.device("cpu"), layout="HND")
    kv.k[0].normal_()
    kv.v[0].normal_()
    pages = list(range(1, 1 + b * pages_each))
    random.Random(0).shuffle(pages)
    tables = [pages[i * pages_each : (i + 1) * pages_each] for i in range(b)]
    slots = torch.tensor([t[(length - 1) // PS] * PS + (length - 1) % PS for t in tables])
    meta = StepMeta([length - 1] * b, [1] * b, tables, torch.full((b,), length - 1), slots)
    q, k, v = (torch.randn(b, n, d).to(dtype) for n in (h, hkv, hkv))
    results = {}
    for name, window, kernel in (("torch", w, False), ("C full", None, True), ("C win", w, True)):
        backend = TorchNativeBackend(
            kv=kv,
            num_heads=h,
            num_kv_heads=hkv,
            head_dim=d,
            scale=d**-0.5,
            windows=[window] if window else None,
        )
        if not kernel:
            backend.kernel = None
        elif backend.kernel is None:
            sys.exit("Relay's C kernels did not build here")

        def step(backend=backend):
            backend.plan(
                meta
            )  # (per step, as the runner does: the torch path builds its masks here)
            backend.forward(q, k, v, 0)

        results[name] = median_ms(step, args.reps)
    print(
        f"| {dtype_name(dtype)} | B={b} L={length} H={h}/{hkv} D={d} W={w} | "
        + " | ".join(f"{results[n]:.2f}" for n in ("torch", "C full", "C win"))
        + f" | {results['torch'] / results['C win']:.1f}x | {results['C full'] / results['C win']:.1f}x |"
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gemma3_model(path: str, window: int) -> None:
    from random_model import save_random_model
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=32768,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    save_random_model(path, cfg)


def model_step(args) -> None:
    from profile_step import Steps, prefill_chunk

    from relay.config import EngineConfig, ModelConfig
    from relay.execution.model_runner import ModelRunner
    from relay.step import BatchInput

    with tempfile.TemporaryDirectory() as path:
        gemma3_model(path, args.window)
        mc = ModelConfig.from_dir(path)
        runner = ModelRunner(
            EngineConfig(dtype=args.model_dtype, kv_cache_gb=2.0, context_length=32768), path, mc
        )
        kernel = runner.attn.kernel
        assert kernel is not None, "the C kernels take the model's windows now"
        for b in [int(x) for x in args.model_batch.split(",")]:
            steps = Steps(runner, b, args.context, steps=4 * args.reps + 8)
            times = {}
            for name, lib in (("torch attention", None), ("C kernels", kernel)):
                runner.attn.kernel = lib
                times[name] = median_ms(steps.decode, args.reps)
            runner.attn.kernel = kernel
            runner.forward(
                BatchInput(0, [], [], [], [], [], [], [], [], released_sids=list(range(b)))
            )
            report(f"decode b={b}, context {args.context}", runner, args, times)
        chunk = prefill_chunk(runner, args.prefill, args.prefill_over)
        times = {}
        for name, lib in (("torch attention", None), ("C kernels", kernel)):
            runner.attn.kernel = lib
            times[name] = median_ms(chunk, max(3, args.reps // 3))
        runner.attn.kernel = kernel
        report(f"prompt chunk {args.prefill} over {args.prefill_over}", runner, args, times)


def report(step: str, runner, args, times: dict[str, float]) -> None:
    print(
        f"| Gemma-3-shaped, {runner.dtype}, {step}, window {args.window} | "
        f"{times['torch attention']:.1f} | {times['C kernels']:.1f} | "
        f"{times['torch attention'] / times['C kernels']:.1f}x |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--model-batch", default="1,8")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--prefill-over", type=int, default=4096)
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}")
    print(
        "\n| dtype | shape | torch ms | C full ms | C win ms | torch / C win | C full / C win |"
        "\n|---|---|---|---|---|---|---|"
    )
    for name in args.dtypes.split(","):
        attention_only(args, getattr(torch, name))
    if not args.skip_model:
        print("\n| step | torch attention ms | C kernels ms | speed-up |\n|---|---|---|---|")
        model_step(args)


if __name__ == "__main__":
    main()
