"""The offline Engine against transformers' greedy `generate`, token for token, in float32: the
reference, seeded prompts, and the three-way check (prompt chunks, the prefix cache, a pool small
enough to retract) the model tests share."""

from __future__ import annotations

import random

import torch

from relay import Engine, SamplingParams

NEW_TOKENS = 16


def reference(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from relay.execution.model_files import load_transformers_model

    model = load_transformers_model(model_dir, torch.float32)
    model.generation_config.eos_token_id = None  # compare full-length outputs
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            outs.append(out[0, len(p) :].tolist())
    return outs


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, vocab - 2) for _ in range(24)]
    prompts = []
    for i, n in enumerate(lengths):
        body = [rng.randrange(2, vocab - 2) for _ in range(n)]
        prompts.append(shared[: n // 2] + body[n // 2 :] if i % 2 else body)  # some share a prefix
    return prompts


DEFAULT_MODEL_TEXTS = [
    "The capital of France is",
    "Write a poem about the sea.",
    "1, 2, 3, 4,",
    "def fib(n):",
    "Once upon a time in a land far away, there lived a",
    "Q: What is 2+2?\nA:",
    "The quick brown fox",
    "In 1492, Columbus sailed the ocean blue. He was looking for a route to",
    "List three colors: red, green, and",
]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def check_three_ways(
    model_dir: str,
    prompts: list[list[int]],
    small_kv_gb: float,
    retracts: bool = True,
    **engine_kw,
) -> None:
    """Greedy output equals transformers' (prompt chunks), again from the prefix cache, and in a
    small pool, which must force retraction unless `retracts` is False (requests that give back
    pages behind a sliding window wait for room instead: tests/scheduling/test_sliding_window_kv.py forces
    it there)."""
    expected = reference(model_dir, prompts, NEW_TOKENS)
    engine = Engine(model_dir, dtype="float32", **engine_kw)
    first = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == expected
    assert all(o.finish_reason == "length" for o in first)

    again = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    page = engine.config.page_size
    for o, p in zip(again, prompts):
        assert 0 < o.cached_tokens < len(p) or len(p) <= page, (
            "second run must hit the prefix cache"
        )
    engine.check()
    assert engine.scheduler.stats().kv_locked_tokens == 0

    tight = Engine(model_dir, dtype="float32", **{**engine_kw, "kv_cache_gb": small_kv_gb})
    squeezed = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in squeezed] == expected
    if retracts:
        assert tight.scheduler.stats().num_retractions_total > 0, "the small pool must preempt"
    tight.check()
