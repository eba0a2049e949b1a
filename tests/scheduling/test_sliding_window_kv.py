"""KV pages behind every layer's sliding window go back to the pool while requests run.

Scheduler tests against scheduler_harness's fake runner (its rows read back only what their queries
attend, so a page given back too early shows up as a wrong history), then the offline Engine on a
tiny random Mistral (every layer slides) and Gemma 3 (one global layer) against transformers'
greedy output token for token. What a request holds is read off the allocator at every step:
pages neither free nor cached-and-evictable are held by the running requests.
"""

from __future__ import annotations

import pytest

from relay import Engine, SamplingParams
from relay.config import ModelConfig
from relay.execution.batch_checks import BatchChecker
from relay.execution.kernels.cpu_attention import DecodePlan
from relay.memory.kv_allocator import FREED_PAGE
from relay.outputs import FinishReason
from relay.step import BatchInput
from tests.helpers.engine_checks import random_prompts, reference
from tests.helpers.model_families import COMMON, tiny_model_maker
from tests.helpers.scheduler_harness import Harness, prompt
from tests.helpers.tiny_models import TINY_VOCAB

WINDOW, PS = 16, 4


def held_pages(sched) -> int:
    """Pages the running requests hold: neither free nor evictable in the prefix cache."""
    return (
        sched.kv.allocator.capacity - sched.kv.allocator.num_free - sched.kv.cache.evictable_pages
    )


def run_watching(h: Harness) -> list[int]:
    """Run the harness to idle; the pages held while each step was built."""
    held = []
    while h.s.has_work or h.inflight:
        assert h.steps < 10_000, "no progress"
        h.step()
        held.append(held_pages(h.s))
    h.assert_idle()
    return held


# ---- the scheduler ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("cache", [True, False])
def test_a_long_decode_holds_about_one_window_of_pages(depth, cache):
    """200 tokens past a 16-token window: once the tree's share (the first window) has fallen
    behind too, the request holds the window's pages and the one it writes into; before that
    at most one window more. A request whose pages never drop would hold 53."""
    h = Harness(page_size=PS, window=WINDOW, depth=depth, disable_cache=not cache)
    h.add("a", prompt(10, 1), max_new_tokens=200, ignore_eos=True)
    held = run_watching(h)
    h.assert_finished_correctly("a")
    per_window = WINDOW // PS
    assert max(held) <= 2 * per_window + 2
    steady = held[3 * WINDOW :]  # two windows past the tree's share
    assert steady and max(steady) <= per_window + 1 + (depth - 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_of_a_prompt_several_windows_long_holds_a_window_and_a_chunk(depth):
    """A 200-token prompt in chunks of 24 with a 16-token window: each chunk needs its own pages
    and the window before it, no more, and the output follows from the whole prompt."""
    h = Harness(page_size=PS, budget=24, window=WINDOW, depth=depth)
    h.add("a", prompt(200, 2), max_new_tokens=8, ignore_eos=True)
    held = run_watching(h)
    h.assert_finished_correctly("a")
    assert max(held) <= (2 * WINDOW + 24) // PS + 2  # the tree's share, the window, a chunk
    assert max(held[2 * WINDOW // 24 + 2 :]) <= (WINDOW + 24) // PS + 2 + (depth - 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_finish_caches_only_the_leading_run_of_held_pages(depth):
    """A request that ran past its window leaves its first window in the tree (what it shared
    while it held it) and nothing after, where it has given pages back; one that never did
    leaves all its whole pages. The next requests start from those prefixes, exactly. Under
    overlap (depth 2) too: a page is not dropped before the step computing it is processed and
    its share reached the tree."""
    h = Harness(page_size=PS, window=WINDOW, budget=256, depth=depth)
    long_prompt, short_prompt = prompt(40, 3), prompt(6, 4)
    h.add("long", long_prompt, max_new_tokens=30, ignore_eos=True)
    h.add("short", short_prompt, max_new_tokens=5, ignore_eos=True)
    run_watching(h)
    assert h.s.kv.cache.cached_pages == WINDOW // PS + (6 + 5 - 1) // PS
    long_seq = long_prompt + h.outputs("long")
    h.add("again", long_seq[:50], max_new_tokens=4, ignore_eos=True)
    h.add("short again", short_prompt + h.outputs("short")[:4], max_new_tokens=4, ignore_eos=True)
    run_watching(h)
    assert h.final["again"].cached_tokens == WINDOW
    assert h.final["short again"].cached_tokens == 8
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


def test_a_request_sharing_a_cached_prefix_keeps_it_cached_and_drops_its_own_pages():
    """The tree's pages a request locks stay in the tree (unlocked once behind its window, so
    evictable, still matched); only its own pages go back to the pool."""
    h = Harness(page_size=PS, window=WINDOW, budget=256)
    base = prompt(12, 5)
    h.add("first", base, max_new_tokens=2, ignore_eos=True)
    run_watching(h)
    cached = h.s.kv.cache.cached_pages
    h.add("second", base + prompt(4, 6), max_new_tokens=60, ignore_eos=True)
    held = run_watching(h)
    assert h.final["second"].cached_tokens == 12
    assert max(held[-20:]) <= WINDOW // PS + 1
    assert h.s.kv.cache.cached_pages >= cached  # the shared prefix is still there
    h.add("third", base + [7], max_new_tokens=2, ignore_eos=True)
    run_watching(h)
    assert h.final["third"].cached_tokens == 12
    for rid in h.reqs:
        h.assert_finished_correctly(rid)


@pytest.mark.parametrize("depth", [1, 2])
def test_abort_mid_generation_returns_every_page(depth):
    h = Harness(page_size=PS, window=WINDOW, depth=depth)
    h.add("a", prompt(30, 7), max_new_tokens=300, ignore_eos=True)
    h.add("b", prompt(9, 8), max_new_tokens=300, ignore_eos=True)
    for _ in range(80):
        h.step()
    assert all(r.dropped_pages > 0 for r in h.s.table.running), "both ran past their windows"
    h.step(abort_mid_step=["a"])
    h.abort("b")
    h.run()  # the steps still out come back; then every page is free or cached (assert_idle)
    assert h.final["a"].finish_reason == h.final["b"].finish_reason == FinishReason.ABORT
    assert held_pages(h.s) == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_a_tight_pool_retracts_and_recomputes_the_same_tokens(depth):
    """Many requests past their windows in a pool too small for them all: retracted ones
    recompute (from their leading run of pages the tree kept) into the tokens a huge pool
    gives, and none touches a page it gave back."""

    def run(num_pages: int) -> Harness:
        h = Harness(num_pages=num_pages, page_size=PS, budget=32, window=WINDOW, depth=depth)
        for i in range(8):  # the longest, 47 + 65 tokens, fits the small pool alone
            h.add(f"r{i}", prompt(5 + 6 * i, 10 + i), max_new_tokens=30 + 5 * i, ignore_eos=True)
        run_watching(h)
        return h

    big, small = run(4096), run(32)
    assert small.s.stats().num_retractions_total > 0, "the small pool should force retraction"
    assert {r: small.outputs(r) for r in small.reqs} == {r: big.outputs(r) for r in big.reqs}
    for rid in small.reqs:
        small.assert_finished_correctly(rid)


def test_without_a_window_a_request_keeps_every_page():
    h = Harness(page_size=PS, window=None, disable_cache=True)
    h.add("a", prompt(10, 1), max_new_tokens=100, ignore_eos=True)
    held = run_watching(h)
    # (read after each step is processed: the last one's finish gives everything back, and the
    # one before held KV for 108 of the 110 tokens)
    assert max(held) == -(-108 // PS)


def test_only_models_whose_every_layer_slides_drop_pages():
    """Mistral slides on every layer; a window as long as the context is none; Gemma 2/3 and
    Qwen2 below max_window_layers keep global layers, which read every key."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    def window(config, context_len: int = 4096) -> int | None:
        return ModelConfig.from_hf_dict(config.to_dict()).kv_window(context_len)

    assert window(MistralConfig(num_hidden_layers=2, sliding_window=256)) == 256
    assert window(MistralConfig(num_hidden_layers=2, sliding_window=256), 256) is None
    assert window(MistralConfig(num_hidden_layers=2, sliding_window=None)) is None
    assert window(Gemma2Config(num_hidden_layers=2, sliding_window=256)) is None
    assert window(Gemma3TextConfig(num_hidden_layers=6, sliding_window=256)) is None
    qwen = dict(use_sliding_window=True, sliding_window=256, num_hidden_layers=3)
    assert window(Qwen2Config(**qwen, max_window_layers=1)) is None
    assert window(Qwen2Config(**qwen, max_window_layers=0)) == 256


def test_the_runner_takes_a_freed_entry_only_behind_the_rows_window():
    """A decode row at position 40 with a 16-token window reads keys 25..40: pages 0-5 (slots
    0..23) are behind it and may be FREED_PAGE; page 6 may not, nor any without a window."""

    def decode_row(table: list[int]) -> BatchInput:
        return BatchInput(1, [7], [3], [40], [1], [0], [table], [True], [0])

    def invalid(table: list[int], window: int | None) -> bool:
        check = BatchChecker(TINY_VOCAB, 64, PS, 512, own_drafter=False, kv_window=window)
        return bool(check.invalid_rows(decode_row(table), {}))

    live = list(range(10, 15))  # pages 6-10: slots 24..43
    assert not invalid([FREED_PAGE] * 6 + live, WINDOW)
    assert not invalid([1, 2, FREED_PAGE, 3, 4, 5] + live, WINDOW)
    assert invalid([FREED_PAGE] * 7 + live[1:], WINDOW)
    assert invalid([FREED_PAGE] * 6 + live, None)


def test_freed_entries_are_no_prefix_two_requests_share():
    """Two requests past their windows both map their first pages to FREED_PAGE: no prefix they
    share, which the C decode kernel's cascade would attend once for both (unmasked)."""
    live_a, live_b, cached = [list(range(n, n + 10)) for n in (10, 20, 40)]
    freed = [FREED_PAGE] * 20
    plan = DecodePlan([freed + live_a, freed + live_b], [480, 480], 16, share=True)
    assert plan.num_groups == 0
    plan = DecodePlan([cached + live_a, cached + live_b], [320, 320], 16, share=True)
    assert plan.num_groups == 1  # (a cached prefix is)


# ---- the engine, on real models ----------------------------------------------------------------


def mistral_config():
    from transformers import MistralConfig

    return MistralConfig(
        **{**COMMON, "sliding_window": WINDOW}, num_hidden_layers=2, tie_word_embeddings=False
    )


def gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{**COMMON, "sliding_window": WINDOW},
        num_hidden_layers=3,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    configs = {"mistral": mistral_config, "gemma3": gemma3_config}
    return tiny_model_maker(tmp_path_factory, default_model_dir, configs)


def generate_watching(
    engine: Engine, prompts: list[list[int]], new_tokens: int
) -> tuple[list, list[int], bool]:
    """Greedy outputs, the pages held at every step the runner ran, and whether the runner's
    page tables ever mapped a page to FREED_PAGE (its attention gathered such entries)."""
    held: list[int] = []
    mapped_freed = []
    forward = engine.runner.forward

    def watched(batch):
        held.append(held_pages(engine.scheduler))
        out = forward(batch)
        tables = engine.runner.requests.page_tables.values()
        mapped_freed.append(any(FREED_PAGE in t for t in tables))
        return out

    engine.runner.forward = watched
    try:
        outs = engine.generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        )
    finally:
        engine.runner.forward = forward
    engine.check()  # the idle accounting balances: every page free or cached, exactly once
    assert engine.scheduler.stats().kv_locked_tokens == 0
    return outs, held, any(mapped_freed)


def engine(path: str, **kw) -> Engine:
    return Engine(path, dtype="float32", page_size=PS, **{"kv_cache_gb": 0.01, **kw})


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_generation_equals_transformers_and_holds_one_window(model_dir, overlap):
    """150 tokens after a 7-token prompt, 16-token window: transformers' tokens, with the
    request holding the window's pages, not the sequence's 40; in lockstep, and with each step
    built while the one before runs (pages dropped behind the one in flight)."""
    path = model_dir("mistral")
    prompts = random_prompts(TINY_VOCAB, [7], seed=11)
    eng = engine(path, overlap_min_share=0.0 if overlap else 0.1)
    outs, held, mapped_freed = generate_watching(eng, prompts, 150)
    assert [o.token_ids for o in outs] == reference(path, prompts, 150)
    assert mapped_freed, "attention ran over page tables with FREED_PAGE entries"
    assert max(held[3 * WINDOW :]) <= WINDOW // PS + 1
    assert max(held) <= 2 * WINDOW // PS + 2


def test_chunked_prefill_of_several_windows_is_exact_and_bounded(model_dir):
    """A 100-token prompt in 12-token chunks, and a second prompt beside it."""
    path = model_dir("mistral")
    prompts = random_prompts(TINY_VOCAB, [100, 37], seed=12)
    outs, held, _ = generate_watching(engine(path, chunked_prefill_size=12), prompts, 40)
    assert [o.token_ids for o in outs] == reference(path, prompts, 40)
    one = (2 * WINDOW + 12) // PS + 2  # a request's: its tree share, the window, a chunk
    assert max(held) <= 2 * one
    assert max(held) < -(-140 // PS)  # less than the long one's whole sequence alone


def test_prefix_cache_hits_after_a_windowed_request_are_exact(model_dir):
    """After a request ran far past its window, a follow-up on its prompt and output, and the
    same prompt again, start from what the tree kept (its first window) and stay exact."""
    path = model_dir("mistral")
    eng = engine(path)
    first = random_prompts(TINY_VOCAB, [9], seed=13)[0]
    (out,), _, _ = generate_watching(eng, [first], 60)
    follow_up = first + out.token_ids[:30] + [5, 6, 7]
    outs, _, _ = generate_watching(eng, [follow_up, first + [8]], 20)
    assert [o.token_ids for o in outs] == reference(path, [follow_up, first + [8]], 20)
    assert [o.cached_tokens for o in outs] == [WINDOW, 8]


def test_retraction_in_a_tight_pool_recomputes_exactly(model_dir):
    """Six requests start at once and grow to a window (and the tree's share) each: more than
    the 24-page pool holds, so some are retracted; they recompute from the prefix the tree kept,
    into transformers' tokens."""
    path = model_dir("mistral")
    prompts = random_prompts(TINY_VOCAB, [6, 8, 9, 10, 11, 12], seed=16)
    pool_gb = 24 * PS * 512 / (1 << 30)  # 2 layers x 2 kv heads x 16 x (k, v) x 4 bytes a token
    eng = engine(path, kv_cache_gb=pool_gb, chunked_prefill_size=128)
    outs, _, _ = generate_watching(eng, prompts, 40)
    assert eng.scheduler.stats().num_retractions_total > 0, "the pool must force retraction"
    assert [o.token_ids for o in outs] == reference(path, prompts, 40)


def test_ngram_speculation_past_the_window_is_exact(model_dir):
    """Verified proposals (rejected ones included) never lose a page the window still reads."""
    path = model_dir("mistral")
    prompts = [p[:5] * 8 for p in random_prompts(TINY_VOCAB, [10, 12], seed=14)]
    eng = engine(path, speculative_algorithm="ngram")
    outs, held, _ = generate_watching(eng, prompts, 80)
    assert [o.token_ids for o in outs] == reference(path, prompts, 80)
    spec = eng.scheduler.spec_stats
    assert 0 < spec.accepted_tokens < spec.proposed_tokens, "some proposals kept, some rejected"
    assert max(held[-20:]) <= 2 * (WINDOW // PS + 1 + 2)  # two requests, a few proposals each


def test_a_model_with_a_global_layer_frees_nothing(model_dir):
    path = model_dir("gemma3")
    prompts = random_prompts(TINY_VOCAB, [7], seed=15)
    eng = engine(path, disable_radix_cache=True)
    assert eng.scheduler.kv.window is None
    outs, held, mapped_freed = generate_watching(eng, prompts, 60)
    assert [o.token_ids for o in outs] == reference(path, prompts, 60)
    assert not mapped_freed
    assert max(held) == -(-(7 + 60 - 1) // PS)  # every page of the sequence, to the end
