"""Greedy output equals transformers' `generate`, token for token, in float32.

For the default model (SmolLM2-135M) and tiny random-weight Llama, Llama-3-rope, Qwen2 and
Qwen3 models: a batch of prompts of different lengths; the same batch again, now served
from the prefix cache; and once more with a KV pool so small that requests are retracted
and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from relay import Engine, SamplingParams
from tests.helpers.engine_checks import (
    DEFAULT_MODEL_TEXTS,
    GREEDY,
    NEW_TOKENS,
    check_three_ways,
    random_prompts,
    reference,
)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tiny_model_dir, arch):
    from tests.helpers.tiny_models import TINY_VOCAB

    prompts = random_prompts(TINY_VOCAB, [3, 5, 8, 13, 17, 24, 31, 40, 57, 64])
    # 2 layers x 2 kv heads x head_dim x 2 (k, v) x 4 bytes per token; ~40 pages of 4 tokens.
    head_dim = 32 if arch == "qwen3" else 16
    small = 40 * 4 * (2 * 2 * head_dim * 2 * 4) / (1 << 30)
    check_three_ways(
        tiny_model_dir(arch), prompts, small, page_size=4, chunked_prefill_size=48, kv_cache_gb=0.01
    )


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir):
    from relay.text.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    prompts = [tok.encode(t) for t in DEFAULT_MODEL_TEXTS]
    # SmolLM2: 30 layers x 3 kv heads x 64 x 2 x 4 bytes = 46 KB per token; ~24 pages of 8.
    small = 24 * 8 * 46080 / (1 << 30)
    # --deterministic: float block activations, the checkpoint's exact products (int8 ones, the
    # default from AVX2 up, change outputs slightly:
    # test_default_model_with_int8_block_activations_is_still_the_model)
    check_three_ways(
        default_model_dir,
        prompts,
        small,
        page_size=8,
        chunked_prefill_size=64,
        kv_cache_gb=0.05,
        deterministic=True,
    )


def teacher_forced_agreement(model_dir, dtype, prompts, outs) -> tuple[int, int]:
    """How many of the outputs' tokens transformers (in dtype) predicts as its next token on the
    same sequence, and of how many."""
    from relay.execution.model_files import load_transformers_model

    model = load_transformers_model(model_dir, dtype)
    agree = total = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            seq = torch.tensor([p + o.token_ids[:-1]])
            predicted = model(seq).logits[0, len(p) - 1 :].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(predicted, o.token_ids))
            total += len(o.token_ids)
    return agree, total


@pytest.mark.slow
def test_default_model_with_int8_block_activations_is_still_the_model(default_model_dir):
    """--block-activations int8 rounds every block GEMM's x to 8 bits per block of 32: greedy
    output starts as the float32 model's, its next-token predictions agree with transformers'
    float32 ones on its own output (teacher-forced: a near-tie flipped by the rounding changes the
    rest of a greedy continuation, not the model) and it still answers (perplexity +0.4 %, top-1
    agreement 96 %: scripts/quant_quality.py). Every GEMM is held on the blocks, prompts included,
    whatever the rule for this CPU level says (block_rows.py)."""
    from relay.execution.block_rows import ALL_ROWS
    from relay.text.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    prompts = [tok.encode(t) for t in DEFAULT_MODEL_TEXTS]
    expected = reference(default_model_dir, prompts, NEW_TOKENS)
    engine = Engine(
        default_model_dir,
        dtype="float32",
        block_activations="int8",
        weight_block_rows=ALL_ROWS,
        kv_cache_gb=0.05,
    )
    assert all(m.blocks is not None and m.blocks.dot for m in engine.runner.model.gemm_modules())
    out = engine.generate(prompts, GREEDY)
    assert all(o.token_ids[0] == e[0] for o, e in zip(out, expected))
    agree, total = teacher_forced_agreement(default_model_dir, torch.float32, prompts, out)
    assert agree / total >= 0.9, f"{agree}/{total} next-token predictions agree with transformers"
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = engine.generate([chat], SamplingParams(max_new_tokens=12, temperature=0))[0].text
    assert "Paris" in answer


@pytest.mark.slow
def test_default_model_in_bfloat16_predicts_what_transformers_does(default_model_dir):
    """bfloat16 is the default on CPUs with bf16 dot products and takes Relay's own kernels
    (fused norms, rotary, small-batch GEMM, prompt and decode attention). Exactness is checked in
    float32; here: teacher-forced next-token predictions agree with transformers in bfloat16
    (which rounds differently: near-ties may flip), batched and alone, and the answers are sensible."""

    from relay.text.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    prompts = [tok.encode(t) for t in DEFAULT_MODEL_TEXTS]
    engine = Engine(default_model_dir, dtype="bfloat16", kv_cache_gb=0.2)
    outs = engine.generate(prompts, GREEDY)
    alone = [engine.generate([p], GREEDY)[0] for p in prompts[:3]]
    assert outs[0].text.startswith(" Paris")
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs[:3]] or sum(
        a.token_ids[:4] == o.token_ids[:4] for a, o in zip(alone, outs)
    ) >= 2
    agree, total = teacher_forced_agreement(default_model_dir, torch.bfloat16, prompts, outs)
    assert agree / total >= 0.9, (
        f"{agree}/{total} next-token predictions agree with transformers (bf16)"
    )
    engine.check()


def test_overlap_scheduling_gives_the_same_outputs_as_lockstep(tiny_model_dir):
    """With overlap_min_share=0 the engine builds step N+1 before it processes step N (as the
    server does where overlap pays): greedy and seeded outputs, stops, min_new_tokens, penalties
    and logprobs come out as in lockstep, through retraction in a tight pool too."""
    from relay.step import PENDING_TOKEN
    from tests.helpers.tiny_models import TINY_VOCAB

    prompts = random_prompts(TINY_VOCAB, [3, 9, 17, 30, 44, 57, 64, 12])
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_new_tokens=20),
        SamplingParams(
            temperature=0.0, max_new_tokens=30, stop_token_ids=list(range(2, TINY_VOCAB, 9))
        ),
        SamplingParams(
            temperature=0.0,
            max_new_tokens=12,
            min_new_tokens=12,
            stop_token_ids=list(range(2, TINY_VOCAB, 3)),
        ),
        SamplingParams(
            temperature=0.8,
            seed=3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            repetition_penalty=1.2,
            max_new_tokens=16,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=0.0, max_new_tokens=10, logprobs=True, top_logprobs=2, ignore_eos=True
        ),
        SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True),
    ]
    results = {}
    tight = (
        32 * 4 * (2 * 2 * 16 * 2 * 4) / (1 << 30)
    )  # ~32 pages of 4 tokens: retractions with steps out
    for overlap in (True, False):
        for kv_gb in (0.01, tight):
            engine = Engine(
                tiny_model_dir("llama"),
                dtype="float32",
                page_size=4,
                chunked_prefill_size=48,
                kv_cache_gb=kv_gb,
                disable_overlap_schedule=not overlap,
                overlap_min_share=0.0,
            )
            forward, pending = engine.runner.forward, []
            engine.runner.forward = lambda b: (
                pending.append(b.input_ids.count(PENDING_TOKEN)),
                forward(b),
            )[1]
            outs = engine.generate(prompts, params)
            assert (sum(pending) > 50) == overlap
            engine.check()
            assert (engine.scheduler.stats().num_retractions_total > 0) == (kv_gb == tight)
            results[overlap, kv_gb] = outs
    first = next(iter(results.values()))
    for key, outs in results.items():
        for i, (got, want) in enumerate(zip(outs, first)):
            what = f"request {i} with (overlap, kv_cache_gb) = {key}"
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), what
            # Logprobs differ in the last float bits between batch shapes.
            assert (
                got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
                if want.logprobs
                else not got.logprobs
            )
    assert any(o.finish_reason == "stop" for o in first) and any(
        len(o.token_ids) == 12 for o in first
    )
    assert len(first[5].logprobs) == 10
