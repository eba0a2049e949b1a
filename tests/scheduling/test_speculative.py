"""Speculative decoding: n-gram proposals, verification (exact greedy; rejection sampling
that keeps the target's distribution), the scheduler's bookkeeping, and end to end through
the Engine on tiny random models and the default model."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from relay import Engine, SamplingParams
from relay.config import EngineConfig
from relay.execution.sampler import Sampler
from relay.scheduling.request import Req
from relay.scheduling.scheduler import Scheduler
from relay.scheduling.speculative import NgramIndex
from relay.step import BatchOutput, SamplingSpec


# ---- n-gram proposals -------------------------------------------------------------------
def index_of(tokens: list[int], lo: int = 1, hi: int = 8) -> NgramIndex:
    idx = NgramIndex(lo, hi)
    idx.extend(tokens)
    return idx


def test_ngram_continues_the_longest_earlier_match():
    # "5 6 7" occurred twice: after "1 5 6 7" came 8 9, after "2 5 6 7" came 3 4; the
    # sequence ends in "2 5 6 7", so the longer match wins.
    idx = index_of([2, 5, 6, 7, 3, 4, 0, 1, 5, 6, 7, 8, 9, 0, 2, 5, 6, 7])
    assert idx.propose(2) == [3, 4]
    assert idx.propose(10) == [3, 4, 0, 1, 5, 6, 7, 8, 9, 0]
    assert idx.propose(16)[10:] == [2, 5, 6, 7, 3, 4]  # past the end: the copy reads itself


def test_ngram_prefers_the_most_recent_of_equal_matches_and_grows_incrementally():
    idx = index_of([4, 1, 4, 2, 4])
    assert idx.propose(1) == [2]
    idx.extend([3, 4])
    assert idx.propose(1) == [3]


def test_ngram_continues_a_repeating_pattern_past_the_end_of_the_sequence():
    assert index_of([7, 7, 7, 7]).propose(4) == [7, 7, 7, 7]
    assert index_of([3, 1, 2, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]


def test_ngram_proposes_nothing_without_a_match_of_min_window():
    assert index_of(list(range(50))).propose(4) == []
    idx = index_of([1, 2, 9, 2], lo=2)
    assert idx.propose(4) == []  # "9 2" never occurred before: one-token matches don't count
    assert index_of([1, 2, 3, 1, 2], lo=2).propose(4) == [3, 1, 2, 3]


# ---- verification -----------------------------------------------------------------------
def sampler_with(params: SamplingParams, vocab: int, sid: int = 0) -> Sampler:
    s = Sampler(vocab, torch.device("cpu"), seed=0)
    s.update([], [SamplingSpec(sid, params, [])])
    return s


def one_hot_logits(tokens: list[int], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_verify_keeps_the_agreeing_proposals_and_adds_the_targets_token():
    s = sampler_with(SamplingParams(temperature=0), 16)
    logits = one_hot_logits([3, 4, 9, 1], 16)  # the target's argmax after 0, 1, 2, 3 proposals
    assert s.verify(logits, [0], [0], [[3, 4, 5]]) == [[3, 4, 9]]
    assert s.verify(logits, [0], [0], [[3, 4, 9]]) == [[3, 4, 9, 1]]  # all kept, plus a bonus
    assert s.verify(logits[:2], [0], [0], [[7]]) == [[3]]


def test_verify_applies_penalties_to_each_position_with_the_proposals_before_it():
    s = sampler_with(SamplingParams(temperature=0, presence_penalty=2.0), 8)
    logits = torch.tensor([[0.0, 3.0, 2.0, 0, 0, 0, 0, 0]] * 2)
    # Position 1 follows proposal 1: its presence penalty makes 2 the argmax there.
    assert s.verify(logits, [0], [0], [[1]]) == [[1, 2]]


def target_logits(k: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_rejection_sampling_emits_the_targets_distribution(draft):
    """Thousands of verify calls with a draft unlike the target: the first emitted token is
    distributed as the target's first position, and the second (when the first proposal was
    kept) as its second position, after temperature and top-k."""
    vocab, k, trials = 8, 2, 6000
    params = SamplingParams(temperature=0.8, top_k=6)
    s = sampler_with(params, vocab)
    logits = target_logits(k, vocab, seed=1)
    p = s.distributions(logits, [params] * (k + 1))
    q = torch.softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(2)), -1)
    gen = torch.Generator().manual_seed(3)
    firsts, seconds = [], []
    for n in range(trials):
        if draft == "model":
            props = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            out = s.verify(logits, [0], [n], [props], [q])[0]
        else:  # an n-gram proposal is certain: q is one-hot
            props = [n % vocab, (n // vocab) % vocab]
            out = s.verify(logits, [0], [n], [props])[0]
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
    for seen, dist in ((firsts, p[0]), (seconds, p[1])):
        counts = np.bincount(seen, minlength=vocab)
        support = dist > 0
        assert counts[~support.numpy()].sum() == 0, "a token outside top-k was emitted"
        expected = dist[support].double().numpy() * len(seen)
        assert (
            chisquare(counts[support.numpy()], expected * counts.sum() / expected.sum()).pvalue
            > 1e-3
        )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"speculative_algorithm": "eagle"}, "speculative_algorithm must be one of"),
        ({"speculative_algorithm": "standalone", "tp_size": 2}, "runs with tp_size=1 only"),
        ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be >= 1"),
        (
            {
                "speculative_ngram_min_match_window_size": 4,
                "speculative_ngram_max_match_window_size": 2,
            },
            "1 <= min <= max",
        ),
        (
            {"speculative_draft_quantization": "int2"},
            "speculative_draft_quantization must be one of",
        ),
    ],
)
def test_bad_speculative_options_are_refused_with_the_option_named(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


# ---- scheduler bookkeeping ----------------------------------------------------------------
def spec_scheduler(num_pages: int = 64, **kw) -> Scheduler:
    cfg = EngineConfig(
        page_size=4,
        chunked_prefill_size=64,
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=4,
        **kw,
    )
    return Scheduler(cfg, num_pages, context_len=256, eos_token_ids=[99])


def run_step(sched: Scheduler, emit) -> list:
    """One step where the 'runner' emits emit(req_row, proposals) tokens per sampling row."""
    batch = sched.schedule()
    props = batch.row_runs(batch.proposed_ids, batch.spec_lens)
    toks = [emit(i, props[i]) for i, s in enumerate(batch.sample) if s]
    out = BatchOutput(batch.step, [t[0] for t in toks], spec_token_ids=[t[1:] for t in toks])
    return batch, sched.process_output(batch, out)


def test_scheduler_appends_accepted_tokens_and_frees_rejected_proposals_pages():
    sched = spec_scheduler()
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # ends in "1 2 3": proposes 4 5 6 7
    sched.add_request(Req("a", prompt, SamplingParams(temperature=0, max_new_tokens=20)))
    run_step(sched, lambda i, p: [4])  # the prompt
    batch, records = run_step(sched, lambda i, p: p[:1] + [42])  # keep one proposal, then 42
    assert batch.spec_lens == [4] and batch.proposed_ids == [5, 6, 7, 1]
    req = sched.table.reqs["a"]
    assert records[0].token_ids == [5, 42] and req.output_ids == [4, 5, 42]
    assert req.kv_len == req.seq_len - 1
    assert len(req.pages) == -(-req.kv_len // 4), (
        "pages of rejected proposals are given back at once"
    )
    assert sched.stats().spec["spec_accepted_tokens"] == 1
    sched.check()


def test_a_stop_token_among_accepted_tokens_ends_the_request_there():
    sched = spec_scheduler()
    sched.add_request(Req("a", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_new_tokens=20)))
    run_step(sched, lambda i, p: [3])
    _, records = run_step(sched, lambda i, p: [p[0], 99, 7])  # 99 is EOS
    assert records[0].token_ids == [1, 99] and records[0].finish_reason == "stop"
    assert records[0].completion_tokens == 3
    assert not sched.table.running and sched.stats().kv_locked_tokens == 0
    sched.check()


def test_speculation_never_overshoots_max_new_tokens_and_stops_above_the_batch_limit():
    sched = spec_scheduler(speculative_disable_by_batch_size=1)
    sched.add_request(Req("a", [5, 6, 5, 6, 5], SamplingParams(temperature=0, max_new_tokens=3)))
    run_step(sched, lambda i, p: [6])
    batch, records = run_step(sched, lambda i, p: p + [0])
    assert batch.spec_lens == [1], "one output token left after the next: propose one"
    assert records[0].finish_reason == "length" and len(records[0].token_ids) == 2
    for rid in "bc":
        sched.add_request(
            Req(rid, [5, 6, 5, 6, 5], SamplingParams(temperature=0, max_new_tokens=8))
        )
    run_step(sched, lambda i, p: [6])
    batch, _ = run_step(sched, lambda i, p: [6])
    assert not batch.spec_lens, "two running requests exceed speculative_disable_by_batch_size=1"


def test_speculation_only_takes_the_budget_prompts_leave():
    sched = spec_scheduler()  # a 64-token step budget
    sched.add_request(Req("a", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_new_tokens=20)))
    run_step(sched, lambda i, p: [3])
    sched.add_request(
        Req("b", list(range(10, 73)), SamplingParams(temperature=0, max_new_tokens=4))
    )
    batch, _ = run_step(sched, lambda i, p: [1])  # a's decode and 63 of b's 63 prompt tokens
    assert batch.extend_lens == [1, 63] and not any(batch.spec_lens), "the prompt comes first"
    batch, _ = run_step(sched, lambda i, p: [1] + p)
    assert batch.spec_lens and batch.spec_lens[0] > 0, "with no prompt work, a speculates again"
    sched.check()


# ---- end to end (Engine) ------------------------------------------------------------------
def mixed_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        motif = [rng.randrange(2, vocab - 2) for _ in range(rng.randrange(3, 9))]
        body = [rng.randrange(2, vocab - 2) for _ in range(rng.randrange(4, 60))]
        prompts.append(body + motif * (1 + i % 4))  # repeats: something for n-gram to find
    return prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


SPEC_ALL = {"speculative_disable_by_batch_size": 64}  # speculate at every batch size here


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("algorithm", ["ngram", "standalone"])
def test_greedy_output_is_unchanged_by_speculation(tiny_model_dir, arch, algorithm):
    path = tiny_model_dir(arch)
    prompts = mixed_prompts(1024, 16)
    plain = Engine(path, dtype="float32").generate(prompts, greedy(24))
    engine = Engine(path, dtype="float32", speculative_algorithm=algorithm, **SPEC_ALL)
    spec = engine.generate(prompts, greedy(24))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.completion_tokens for o in spec] == [24] * 16
    stats = engine.scheduler.stats()
    assert stats.spec["spec_verify_rows"] > 0
    assert stats.kv_locked_tokens == 0
    engine.check()
    single = engine.generate(prompts[:1], greedy(24))  # alone in its batch
    assert single[0].token_ids == plain[0].token_ids


def test_a_draft_identical_to_the_target_is_always_accepted(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = Engine(
        path,
        dtype="float32",
        speculative_algorithm="standalone",
        speculative_draft_model_path=path,
        speculative_draft_quantization="none",
        **SPEC_ALL,
    )
    engine.generate(mixed_prompts(1024, 4), greedy(20))
    spec = engine.scheduler.stats().spec
    assert spec["spec_proposed_tokens"] > 0
    assert spec["spec_accepted_tokens"] == spec["spec_proposed_tokens"]


def test_retraction_mid_speculation_recomputes_the_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = mixed_prompts(1024, 12, seed=3)
    plain = Engine(path, dtype="float32").generate(prompts, greedy(40))
    tight = Engine(
        path, dtype="float32", kv_cache_gb=0.00025, speculative_algorithm="ngram", **SPEC_ALL
    )
    spec = tight.generate(prompts, greedy(40))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert tight.scheduler.stats().num_retractions_total > 0
    tight.check()


def test_no_kv_leaks_after_many_requests_with_aborts_and_stops(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = Engine(path, dtype="float32", speculative_algorithm="ngram", **SPEC_ALL)
    sched, rng = engine.scheduler, random.Random(5)
    prompts = mixed_prompts(1024, 200, seed=7)
    for i, p in enumerate(prompts):
        stop = [p[-1]] if i % 3 == 0 else []  # the motif's last token: often among accepted ones
        sched.add_request(
            Req(
                f"r{i}",
                p,
                SamplingParams(
                    temperature=0 if i % 2 else 0.7,
                    seed=i,
                    max_new_tokens=rng.randrange(1, 30),
                    stop_token_ids=stop,
                ),
            )
        )
    while sched.has_work:
        batch = sched.schedule()
        sched.process_output(batch, engine.runner.forward(batch))
        for rid in list(sched.table.reqs):
            if rng.random() < 0.01:
                sched.abort(rid)
    assert sched.stats().spec["spec_verify_rows"] > 0
    assert sched.stats().kv_locked_tokens == 0
    sched.check()


def test_default_model_greedy_output_is_unchanged_by_a_quantized_self_draft(default_model_dir):
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3, 4, 5,", "Once upon a time"]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    # float block products: a verify step's rows then multiply as exactly as a decode step's (int8
    # block activations round x, so a last-bit difference between the attention paths can turn a token)
    plain = Engine(default_model_dir, dtype="float32", block_activations="float").generate(
        prompts, params
    )
    engine = Engine(
        default_model_dir,
        dtype="float32",
        speculative_algorithm="standalone",  # int4 self-draft
        block_activations="float",
    )
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.scheduler.stats().spec["spec_acceptance_rate"] > 0.5


def test_stop_strings_end_speculating_requests_and_free_their_kv(default_model_dir):
    engine = Engine(default_model_dir, speculative_algorithm="ngram")
    prompts = ["red green blue red green blue red green blue red", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1,"]
    free = engine.generate(prompts, greedy(30))
    stop = engine.tokenizer.decode(
        free[0].token_ids[2:4]
    )  # text from the middle of the first output
    outs = engine.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=[stop])
    )
    assert outs[0].finish_reason == "stop" and stop not in outs[0].text
    assert engine.scheduler.stats().spec["spec_verify_rows"] > 0
    assert engine.scheduler.stats().kv_locked_tokens == 0
    engine.check()


def test_sampled_output_with_a_different_draft_keeps_the_targets_distribution(tiny_model_dir):
    """The second output token of 800 sampled requests, with and without a draft model that
    differs from the target: the same distribution (a chi-square test of homogeneity)."""
    target, other = tiny_model_dir("llama"), tiny_model_dir("qwen2")
    prompt = mixed_prompts(1024, 1, seed=11)[0]
    params = [
        SamplingParams(temperature=1.5, max_new_tokens=3, ignore_eos=True, seed=s)
        for s in range(800)
    ]
    runs = []
    for kw in (
        {},
        {
            "speculative_algorithm": "standalone",
            "speculative_draft_model_path": other,
            "speculative_draft_quantization": "none",
            "speculative_num_draft_tokens": 2,
            "speculative_disable_by_batch_size": 4096,
        },
    ):
        engine = Engine(target, dtype="float32", max_running_requests=4096, **kw)
        runs.append([o.token_ids[1] for o in engine.generate([prompt] * len(params), params)])
    top = [t for t, _ in Counter(runs[0]).most_common(8)]
    table = [
        [sum(t == x for t in run) for x in top] + [sum(t not in top for t in run)] for run in runs
    ]
    assert chi2_contingency(np.array(table) + 1).pvalue > 1e-3
