#!/usr/bin/env python3
"""Peak KV pages one long greedy generation holds on a model whose every layer slides.

Builds a tiny random-weight Mistral (2 layers, hidden 64) with the given sliding window, runs one
request through the offline Engine and reads the allocator before every step: the pages neither
free nor evictable in the prefix cache are the ones the request holds. Prints their peak and
their count at the end with the pages of its whole sequence (what a request holds when nothing
behind the window is given back), the decode rate, the CPU's ISA level and the load average.

    python -m scripts.window_pages                          # 4,000 tokens, window 256, page 16
    python -m scripts.window_pages --tokens 8000 --window 512 --page-size 32

It only reads the scheduler's allocator and prefix cache, which every version of Relay has: from
the repository root, PYTHONPATH=<a checkout>/src picks the version measured.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def build_model(path: str, window: int, context: int) -> str:
    from transformers import MistralConfig

    from scripts.random_model import save_random_model

    config = MistralConfig(
        vocab_size=512,  # within any tokenizer save_random_model writes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=context,
        sliding_window=window,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return save_random_model(path, config)


def measure(tokens: int, window: int, page_size: int, prompt_len: int, no_cache: bool) -> dict:
    from relay import Engine, SamplingParams
    from relay.execution.kernels import isa

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, window, prompt_len + tokens + 64)
        engine = Engine(
            path,
            dtype="float32",
            page_size=page_size,
            kv_cache_gb=0.05,
            disable_radix_cache=no_cache,
        )
        sched, forward = engine.scheduler, engine.runner.forward
        held: list[int] = []

        def watched(batch):
            alloc = sched.kv.allocator
            held.append(alloc.capacity - alloc.num_free - sched.kv.cache.evictable_pages)
            return forward(batch)

        engine.runner.forward = watched
        prompt = [(7 * i) % 500 + 3 for i in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        (out,) = engine.generate([prompt], params)
        seconds = time.perf_counter() - start
        engine.check()
    sequence = prompt_len + len(out.token_ids)
    return {
        "tokens": len(out.token_ids),
        "window": window,
        "page_size": page_size,
        "prefix_cache": not no_cache,
        "peak_held_pages": max(held),
        "held_pages_at_the_end": held[-1],
        "sequence_pages": -(-sequence // page_size),
        "tokens_per_s": round(len(out.token_ids) / seconds, 1),
        "isa": isa.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="without the prefix cache (whose share of the first window a request locks)",
    )
    args = ap.parse_args()
    result = measure(
        args.tokens, args.window, args.page_size, args.prompt_len, args.disable_radix_cache
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
