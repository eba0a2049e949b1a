"""Unit tests for relay.execution.sampler (Sampler, seeded_uniform) and relay.step.SamplingSpec.

Everything runs on CPU on tiny vocabularies. Statistical checks draw from fixed seeds, so
they are deterministic: the bounds are loose enough to hold for any reasonable sampler and
tight enough to catch a wrong distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from relay.execution.sampler import Sampler, SampleResult, seeded_uniform
from relay.sampling_params import SamplingParams
from relay.step import SamplingSpec

V = 8
# Distinct values (no ties), both signs, so penalties on positive and negative logits show.
BASE = [2.0, 1.5, -1.0, 0.5, 3.0, -0.5, 1.0, 0.2]
# A distribution with no cumulative sum landing exactly on the p values used below.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
PERM = [3, 0, 6, 1, 7, 2, 5, 4]  # token PERM[i] gets PROBS[i]: filters must not depend on id order


def permuted_logits() -> torch.Tensor:
    row = torch.empty(V)
    for rank, tok in enumerate(PERM):
        row[tok] = math.log(PROBS[rank])
    return row


def prob_of(tok: int) -> float:
    return PROBS[PERM.index(tok)]


def spec(
    sid: int, stop: list[int] | None = None, prompt: list[int] | None = None, **kw
) -> SamplingSpec:
    return SamplingSpec(sid, SamplingParams(**kw), list(stop or []), list(prompt or []))


def make(specs: list[SamplingSpec], seed: int = 0, vocab: int = V) -> Sampler:
    s = Sampler(vocab, torch.device("cpu"), seed=seed)
    s.update([], specs)
    return s


def sample(
    s: Sampler, rows: list[list[float]] | torch.Tensor, sids: list[int], lens: list[int]
) -> SampleResult:
    logits = (
        rows.clone() if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.float32)
    )
    return s.sample(logits, sids, lens)


def draw_many(
    logits_row: torch.Tensor, n: int, base_seed: int = 1000, position: int = 0, **kw
) -> list[int]:
    """n draws from one logits row: n requests with distinct fixed seeds in one batch."""
    s = make([spec(i, seed=base_seed + i, **kw) for i in range(n)])
    return sample(s, logits_row.expand(n, -1), list(range(n)), [position] * n).token_ids


def freqs(tokens: list[int], vocab: int = V) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(vocab)]


def assert_matches(tokens: list[int], expected: list[float]) -> None:
    """Per-token frequency within 4.5 sigma (+0.005) of the expected probability, and a
    chi-square over the tokens with non-negligible mass."""
    n = len(tokens)
    got = freqs(tokens, len(expected))
    for t, (f, p) in enumerate(zip(got, expected)):
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(f - p) <= 4.5 * sigma + 0.005, (t, f, p)
    cells = [(got[t] * n, p * n) for t, p in enumerate(expected) if p * n >= 5]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < 3 * len(cells) + 15, (chi2, got, expected)


# ---- seeded_uniform / SamplingSpec -------------------------------------------------------------
def test_seeded_uniform_is_a_fixed_uniform_in_unit_interval():
    vals = [seeded_uniform(7, n) for n in range(20000)]
    assert vals == [seeded_uniform(7, n) for n in range(20000)]
    assert all(0.0 <= v < 1.0 for v in vals)
    assert abs(sum(vals) / len(vals) - 0.5) < 0.01
    # Ten equal bins roughly equally full.
    bins = [0] * 10
    for v in vals:
        bins[int(v * 10)] += 1
    assert all(1800 < b < 2200 for b in bins), bins
    assert len(set(vals)) == len(vals)
    other = [seeded_uniform(8, n) for n in range(20000)]
    assert sum(a == b for a, b in zip(vals, other)) == 0
    # Any 64-bit seed, negative included, works.
    for seed in (0, -1, -(2**63), 2**63 - 1, 2**64 + 5):
        assert 0.0 <= seeded_uniform(seed, 3) < 1.0


def test_sampling_spec_defaults_are_not_shared():
    a = SamplingSpec(1, SamplingParams(), [2])
    b = SamplingSpec(2, SamplingParams(), [2])
    a.prompt_ids.append(5)
    assert b.prompt_ids == [] and a.stop_token_ids == [2]


# ---- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.3, top_k=1)])
def test_greedy_rows_take_argmax_whatever_else_is_in_the_batch(kw):
    g = torch.Generator().manual_seed(0)
    n = 12
    logits = torch.randn(n, 50, generator=g) * 3
    greedy_rows = {0, 3, 4, 9}
    specs = []
    for i in range(n):
        if i in greedy_rows:
            specs.append(spec(i, **kw))
        else:  # sampled rows of every flavour around the greedy ones
            specs.append(
                spec(
                    i,
                    temperature=1.5,
                    top_p=0.9 if i % 2 else 1.0,
                    top_k=5 if i % 3 == 0 else -1,
                    min_p=0.05 if i % 4 == 1 else 0.0,
                    seed=i if i % 2 else None,
                )
            )
    s = make(specs, vocab=50)
    alone = make([spec(i, **kw) for i in greedy_rows], vocab=50)
    want = logits.argmax(-1).tolist()
    for step in range(5):
        out = sample(s, logits, list(range(n)), [step] * n).token_ids
        rows = sorted(greedy_rows)
        solo = sample(alone, logits[rows], rows, [step] * len(rows)).token_ids
        assert [out[i] for i in rows] == [want[i] for i in rows] == solo


def test_greedy_does_not_consume_the_runner_rng():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    a = make([spec(1, temperature=1.0), spec(2, temperature=0.0)], seed=5)
    b = make([spec(1, temperature=1.0)], seed=5)
    got_a = [sample(a, logits, [1, 2], [n, n]).token_ids[0] for n in range(100)]
    got_b = [sample(b, logits[:1], [1], [n]).token_ids[0] for n in range(100)]
    assert got_a == got_b


# ---- penalties -------------------------------------------------------------------------------------
def reference_logits(
    base: list[float], out: list[int], prompt: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    """The hand computation: HF repetition penalty over prompt + output, then OpenAI
    frequency/presence penalties over output tokens only."""
    seen = set(prompt) | set(out)
    row = []
    for t, x in enumerate(base):
        if t in seen and rep != 1.0:
            x = x / rep if x > 0 else x * rep
        c = out.count(t)
        x -= freq * c + pres * (c > 0)
        row.append(x)
    return row


def log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


@pytest.mark.parametrize(
    "rep,freq,pres,prompt",
    [
        (1.0, 0.6, 0.0, []),
        (1.0, 0.0, 1.1, []),
        (1.0, 0.4, 0.3, [4, 0]),  # prompt tokens must NOT count for frequency/presence
        (2.0, 0.0, 0.0, [1, 2]),  # 1 is positive (divided), 2 negative (multiplied)
        (1.7, 0.25, 0.5, [4, 5, 5]),
        (0.5, 0.0, 0.0, [2, 3]),  # rep < 1 rewards seen tokens
        (1.0, -0.5, 0.0, []),  # negative frequency penalty rewards repeats
    ],
)
def test_penalties_match_hand_computation_over_steps(rep, freq, pres, prompt):
    kw = dict(
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        logprobs=True,
        top_logprobs=V,
    )
    s = make([spec(7, prompt=prompt, temperature=0.0, **kw)])
    out: list[int] = []
    for step in range(12):
        want_row = reference_logits(BASE, out, prompt, rep, freq, pres)
        res = sample(s, [BASE], [7], [step])
        tok = res.token_ids[0]
        assert tok == max(range(V), key=want_row.__getitem__), (step, out)
        # The full penalised distribution, read back through top_logprobs (all V tokens).
        ids, lps = res.top_logprobs[0]
        want_lp = log_softmax(want_row)
        assert sorted(ids) == list(range(V))
        for t, lp in zip(ids, lps):
            assert lp == pytest.approx(want_lp[t], abs=1e-5)
        assert res.logprobs[0] == pytest.approx(want_lp[tok], abs=1e-5)
        out.append(tok)
    if freq > 0 or pres > 0:
        assert len(set(out)) > 1  # the penalty actually moved the argmax


def test_penalty_sequence_explicit():
    # Hand-traced, frequency 0.6 + presence 0.35 on BASE:
    # step0: argmax 4 (3.0); step1: 4 -> 3.0-0.6-0.35=2.05 > 2.0 -> 4;
    # step2: 4 -> 3.0-1.2-0.35=1.45 -> 0 (2.0); step3: 0 -> 1.05, best is 1 (1.5) -> 1;
    # step4: 1 -> 0.55, best 4 (1.45) -> 4; step5: 4 -> 0.85, best 0 (1.05) -> 0.
    s = make([spec(1, temperature=0.0, frequency_penalty=0.6, presence_penalty=0.35)])
    got = [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(6)]
    assert got == [4, 4, 0, 1, 4, 0]


def test_a_spec_sent_again_restarts_the_penalties_from_the_output_it_carries():
    """After a retraction the scheduler sends the spec again with the output the request
    restarts from: the sampler's counts are those, not the tokens it sampled before (a step's
    token dropped with the retraction included), so the sequence goes on as in
    test_penalty_sequence_explicit."""
    kw = dict(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.35, repetition_penalty=1.5)
    fresh = make([spec(1, **kw)])
    want = [sample(fresh, [BASE], [1], [n]).token_ids[0] for n in range(6)]
    s = make([spec(1, **kw)])
    other = [BASE[-1]] + BASE[:-1]
    for n in range(3):
        sample(s, [other], [1], [n])  # tokens that are not the output after all
    s.update([], [SamplingSpec(1, SamplingParams(**kw), [], [], want[:2])])
    assert [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(2, 6)] == want[2:]


def test_repetition_penalty_is_not_compounded():
    # HF semantics: a seen token's logit is divided once, however often it appears.
    s = make([spec(1, temperature=0.0, repetition_penalty=2.0, prompt=[1, 2])])
    got = [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(6)]
    # 4 (3.0) -> seen: 1.5; 0 (2.0) -> seen: 1.0; then 4 at 1.5 beats 0 at 1.0 and 1 at 0.75 forever.
    assert got == [4, 0, 4, 4, 4, 4]


def test_penalty_counts_come_from_sampled_tokens_of_random_rows():
    """Counts accumulate from the sampler's own (random) choices; logprobs follow them."""
    s = make(
        [
            spec(
                3,
                temperature=0.8,
                seed=11,
                frequency_penalty=0.7,
                presence_penalty=0.2,
                repetition_penalty=1.3,
                prompt=[0, 6],
                logprobs=True,
                top_logprobs=V,
            ),
            spec(4, temperature=1.0, seed=12),
        ]
    )  # an unpenalised neighbour
    out: list[int] = []
    for step in range(30):
        res = sample(s, [BASE, BASE], [3, 4], [step, step])
        ids, lps = res.top_logprobs[0]
        want = log_softmax(reference_logits(BASE, out, [0, 6], 1.3, 0.7, 0.2))
        for t, lp in zip(ids, lps):
            assert lp == pytest.approx(want[t], abs=1e-5)
        # The neighbour's logprobs (it asked for none, but logprobs are computed for all rows) are unpenalised.
        assert res.logprobs[1] == pytest.approx(log_softmax(BASE)[res.token_ids[1]], abs=1e-5)
        assert res.top_logprobs[1] is None
        out.append(res.token_ids[0])
    assert len(set(out)) >= 3


def test_penalties_do_not_leak_between_rows():
    s = make([spec(1, temperature=0.0, frequency_penalty=2.0), spec(2, temperature=0.0)])
    for n in range(5):
        res = sample(s, [BASE, BASE], [1, 2], [n, n])
        assert res.token_ids[1] == 4
    assert res.token_ids[0] != 4


# ---- min_new_tokens ----------------------------------------------------------------------------
def test_min_new_tokens_masks_stop_ids_greedy():
    row = [0.0] * V
    row[7], row[5], row[2] = 10.0, 9.0, 1.0  # stops dominate
    s = make(
        [spec(1, stop=[7, 5], temperature=0.0, min_new_tokens=3, logprobs=True, top_logprobs=3)]
    )
    got = []
    for n in range(5):
        res = sample(s, [row], [1], [n])
        got.append(res.token_ids[0])
        if n < 3:
            assert 7 not in res.top_logprobs[0][0] and 5 not in res.top_logprobs[0][0]
    assert got == [2, 2, 2, 7, 7]


def test_min_new_tokens_masks_stop_ids_sampled():
    row = torch.zeros(V)
    row[7], row[5] = 3.0, 3.0  # each stop ~ 44% when allowed
    n = 600
    for pos, allowed in [(0, False), (3, False), (4, True), (9, True)]:
        s = make(
            [spec(i, stop=[7, 5], seed=50 + i, temperature=1.0, min_new_tokens=4) for i in range(n)]
        )
        toks = sample(s, row.expand(n, -1), list(range(n)), [pos] * n).token_ids
        hits = sum(t in (5, 7) for t in toks)
        if allowed:
            assert hits > n // 2
        else:
            assert hits == 0


def test_min_new_tokens_only_masks_listed_ids_and_only_that_row():
    row = [0.0] * V
    row[7] = 10.0
    s = make(
        [
            spec(1, stop=[5], temperature=0.0, min_new_tokens=5),  # 7 is not one of its stop ids
            spec(2, stop=[7], temperature=0.0, min_new_tokens=5),
            spec(3, stop=[7], temperature=0.0, min_new_tokens=0),
        ]
    )
    assert sample(s, [row, row, row], [1, 2, 3], [0, 0, 0]).token_ids == [7, 0, 7]


# ---- seeds and the runner RNG -------------------------------------------------------------------
def _flat_logits(n_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(n_rows, V, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_seeded_rows_are_reproducible_across_batch_composition():
    row = _flat_logits(1, 0)[0]
    positions = list(range(0, 120, 3))
    alone = make([spec(42, seed=1234, temperature=0.9, top_p=0.95)])
    ref = [sample(alone, row[None], [42], [p]).token_ids[0] for p in positions]

    others = _flat_logits(6, 1)
    s = make(
        [
            spec(42, seed=1234, temperature=0.9, top_p=0.95),
            spec(1, temperature=1.0),
            spec(2, temperature=0.0),
            spec(3, seed=99, temperature=2.0, top_k=3),
            spec(4, temperature=0.7, min_p=0.1),
            spec(5, temperature=1.0, frequency_penalty=1.0),
        ],
        seed=77,
    )
    got = []
    for j, p in enumerate(positions):
        # Reorder the batch each step and vary which neighbours are present.
        rows = [1, 2, 3, 4, 5][: 1 + j % 5]
        order = rows[: j % len(rows)] + [42] + rows[j % len(rows) :]
        batch = torch.stack([row if sid == 42 else others[sid] for sid in order])
        lens = [p if sid == 42 else (j * 7 + sid) % 50 for sid in order]
        res = sample(s, batch, order, lens)
        got.append(res.token_ids[order.index(42)])
    assert got == ref
    assert len(set(ref)) > 3  # not trivially constant


def test_seeded_rows_depend_on_position_not_call_count():
    row = _flat_logits(1, 3)[0]
    a = make([spec(1, seed=5, temperature=1.0)])
    b = make([spec(1, seed=5, temperature=1.0)])
    seq = [sample(a, row[None], [1], [p]).token_ids[0] for p in range(40)]
    # b samples the same positions in reverse order, with extra calls in between.
    rev = {}
    for p in reversed(range(40)):
        sample(b, row[None], [1], [1000 + p])
        rev[p] = sample(b, row[None], [1], [p]).token_ids[0]
    assert seq == [rev[p] for p in range(40)]


def test_different_seeds_differ():
    row = torch.zeros(V)  # uniform: two independent streams agree ~1/8 of the time
    a = make([spec(1, seed=1, temperature=1.0)])
    b = make([spec(1, seed=2, temperature=1.0)])
    pos = list(range(400))
    sa = [sample(a, row[None], [1], [p]).token_ids[0] for p in pos]
    sb = [sample(b, row[None], [1], [p]).token_ids[0] for p in pos]
    agree = sum(x == y for x, y in zip(sa, sb)) / len(pos)
    assert 0.05 < agree < 0.25
    assert_matches(sa, [1 / V] * V)


def test_same_seed_same_position_same_token_in_one_batch():
    row = _flat_logits(1, 4)[0]
    s = make(
        [
            spec(1, seed=9, temperature=1.0),
            spec(2, seed=9, temperature=1.0),
            spec(3, seed=10, temperature=1.0),
        ]
    )
    same = 0
    for p in range(50):
        t = sample(s, row.expand(3, -1), [1, 2, 3], [p, p, p]).token_ids
        assert t[0] == t[1]
        same += t[0] == t[2]
    assert same < 40


def test_unseeded_rows_use_the_runner_rng():
    row = torch.zeros(V)

    def stream(runner_seed: int, with_neighbours: bool) -> list[int]:
        specs = [spec(1, temperature=1.0)]
        if with_neighbours:  # seeded and greedy rows must not draw from the runner RNG
            specs += [spec(2, seed=3, temperature=1.0), spec(3, temperature=0.0)]
        s = make(specs, seed=runner_seed)
        sids = [s_.sid for s_ in specs]
        return [
            sample(s, row.expand(len(sids), -1), sids, [p] * len(sids)).token_ids[0]
            for p in range(80)
        ]

    torch.manual_seed(123)
    a = stream(0, False)
    torch.manual_seed(456)  # the global torch RNG plays no part
    assert stream(0, False) == a
    assert stream(0, True) == a
    b = stream(1, False)
    assert sum(x == y for x, y in zip(a, b)) < 30  # ~10 expected
    # Unseeded rows do not repeat with position the way a seeded row does: two unseeded
    # rows at the same position in one batch draw different numbers.
    s = make([spec(1, temperature=1.0), spec(2, temperature=1.0)], seed=0)
    same = sum(
        len(set(sample(s, row.expand(2, -1), [1, 2], [0, 0]).token_ids)) == 1 for _ in range(80)
    )
    assert same < 30  # ~10 expected


# ---- filters ----------------------------------------------------------------------------------
N_DRAWS = 4000


def renormalised(keep: set[int]) -> list[float]:
    total = sum(prob_of(t) for t in keep)
    return [prob_of(t) / total if t in keep else 0.0 for t in range(V)]


def top(n: int) -> set[int]:
    return set(PERM[:n])


@pytest.mark.parametrize(
    "kw,keep",
    [
        (dict(top_k=3), top(3)),
        (dict(top_k=1, temperature=1.0), top(1)),
        (dict(top_p=0.7), top(3)),  # 0.4, 0.65 < 0.7 <= 0.80: three tokens
        (dict(top_p=0.3), top(1)),  # the top token alone already covers p
        (dict(top_p=0.93), top(5)),  # 0.90 < 0.93 <= 0.95
        (dict(top_p=0.97), top(6)),  # 0.95 < 0.97 <= 0.98
        (dict(min_p=0.2), top(4)),  # floor 0.08
        (dict(min_p=0.5), top(2)),  # floor 0.2
        (dict(top_k=5, top_p=0.7), top(3)),
        (dict(top_k=2, top_p=0.9), top(2)),
        (dict(top_p=0.88, min_p=0.3), top(3)),  # top-p keeps 4, floor 0.12 drops the 0.1
        (dict(top_k=6, top_p=0.99, min_p=0.09), top(5)),  # floor 0.036
    ],
)
def test_filters_keep_exactly_the_expected_tokens(kw, keep):
    toks = draw_many(permuted_logits(), N_DRAWS, **kw)
    assert set(toks) == keep  # nothing outside, and every kept token actually shows up
    assert_matches(toks, renormalised(keep))


@pytest.mark.parametrize(
    "kw", [dict(), dict(top_p=1.0, top_k=-1), dict(top_k=0), dict(top_k=V), dict(min_p=0.0)]
)
def test_disabled_filters_keep_the_full_distribution(kw):
    toks = draw_many(permuted_logits(), N_DRAWS, **kw)
    assert set(toks) == set(range(V))
    assert_matches(toks, [prob_of(t) for t in range(V)])


def test_top_p_one_keeps_a_long_tail():
    # Many tiny tokens after a dominant one: top_p=1.0 must keep the whole tail however the
    # float32 cumulative sum rounds.
    vocab = 3000
    row = torch.full((vocab,), -4.0)
    row[0] = 6.0
    n = 3000
    s = make([spec(i, seed=i, temperature=1.0, top_p=1.0) for i in range(n)], vocab=vocab)
    toks = sample(s, row.expand(n, -1), list(range(n)), [0] * n).token_ids
    p_tail = 1 - torch.softmax(row, -1)[0].item()
    tail = sum(t != 0 for t in toks) / n
    assert abs(tail - p_tail) < 4.5 * math.sqrt(p_tail * (1 - p_tail) / n) + 0.005
    assert max(toks) > vocab // 2  # the far tail is reachable


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 1.8])
def test_sampling_frequencies_match_softmax_over_temperature(temperature):
    row = torch.tensor(BASE)
    toks = draw_many(row, N_DRAWS, temperature=temperature)
    assert_matches(toks, torch.softmax(row / temperature, -1).tolist())


def test_filters_apply_to_temperature_scaled_probabilities():
    # At T=3 the distribution flattens, so top_p=0.7 needs more tokens than at T=1.
    row = permuted_logits()
    p = torch.softmax(row / 3.0, -1)
    order = p.argsort(descending=True).tolist()
    cum, keep = 0.0, set()
    for t in order:
        keep.add(t)
        cum += p[t].item()
        if cum >= 0.7:
            break
    assert len(keep) > 3
    toks = draw_many(row, N_DRAWS, temperature=3.0, top_p=0.7)
    assert set(toks) == keep
    want = [p[t].item() / sum(p[k].item() for k in keep) if t in keep else 0.0 for t in range(V)]
    assert_matches(toks, want)


def test_mixed_filters_in_one_batch_stay_per_row():
    row = permuted_logits()
    kinds = [dict(top_k=2), dict(), dict(min_p=0.5), dict(top_p=0.7), dict(temperature=0.0)]
    n_each = 800
    specs, sids = [], []
    for i in range(n_each * len(kinds)):
        specs.append(spec(i, seed=7000 + i, **kinds[i % len(kinds)]))
        sids.append(i)
    s = make(specs)
    toks = sample(s, row.expand(len(sids), -1), sids, [0] * len(sids)).token_ids
    by_kind = [toks[k :: len(kinds)] for k in range(len(kinds))]
    assert set(by_kind[0]) == top(2)
    assert set(by_kind[1]) == set(range(V))
    assert set(by_kind[2]) == top(2)
    assert set(by_kind[3]) == top(3)
    assert set(by_kind[4]) == top(1)
    assert_matches(by_kind[3], renormalised(top(3)))


def test_sampling_never_picks_a_minus_inf_token():
    row = torch.full((V,), float("-inf"))
    row[2], row[6] = 0.0, 0.5
    toks = draw_many(row, 500, temperature=1.5)
    assert set(toks) == {2, 6}
    toks = draw_many(row, 500, temperature=1.5, top_p=0.99, min_p=0.01)
    assert set(toks) == {2, 6}


# ---- logprobs ----------------------------------------------------------------------------------
def test_logprobs_and_top_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=g) * 2
    s = make(
        [
            spec(1, temperature=0.0, logprobs=True, top_logprobs=5),
            spec(2, temperature=0.6, seed=1, logprobs=True, top_logprobs=0),
            spec(3, temperature=1.4, top_k=10, logprobs=False),
            spec(4, temperature=2.0, seed=2, logprobs=True, top_logprobs=2),
        ],
        vocab=40,
    )
    res = sample(s, logits, [1, 2, 3, 4], [0, 0, 0, 0])
    ref = torch.log_softmax(logits, -1)  # before temperature and filters
    assert len(res.token_ids) == len(res.logprobs) == len(res.top_logprobs) == 4
    for i, tok in enumerate(res.token_ids):
        assert res.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert res.top_logprobs[1] is None and res.top_logprobs[2] is None
    for i, k in [(0, 5), (3, 2)]:
        ids, vals = res.top_logprobs[i]
        assert len(ids) == len(vals) == k
        want_vals, want_ids = ref[i].topk(k)
        assert ids == want_ids.tolist()
        assert vals == pytest.approx(want_vals.tolist(), abs=1e-5)
        assert vals == sorted(vals, reverse=True)
    assert res.token_ids[0] == res.top_logprobs[0][0][0]  # greedy picks the top logprob


def test_no_logprobs_requested_means_none():
    s = make([spec(1, temperature=0.0), spec(2, temperature=1.0)])
    res = sample(s, [BASE, BASE], [1, 2], [0, 0])
    assert res.logprobs is None and res.top_logprobs is None


def test_logprobs_only_without_top_logprobs():
    s = make([spec(1, temperature=0.0, logprobs=True)])
    res = sample(s, [BASE], [1], [0])
    assert res.top_logprobs is None
    assert res.logprobs[0] == pytest.approx(log_softmax(BASE)[4], abs=1e-6)


def test_logprobs_are_independent_of_temperature():
    for t in (0.3, 1.0, 3.0):
        s = make([spec(1, temperature=t, seed=0, logprobs=True, top_logprobs=V)])
        res = sample(s, [BASE], [1], [0])
        ids, vals = res.top_logprobs[0]
        want = log_softmax(BASE)
        assert vals == pytest.approx([want[i] for i in ids], abs=1e-5)


def test_sample_does_not_change_penalised_rows_of_the_callers_logits():
    logits = torch.tensor([BASE, BASE])
    before = logits.clone()
    s = make([spec(1, temperature=0.0, frequency_penalty=1.0), spec(2, temperature=0.7, seed=3)])
    for n in range(3):
        s.sample(logits, [1, 2], [n, n])
    assert torch.equal(logits, before)


# ---- state lifecycle -------------------------------------------------------------------------
def test_released_sids_drop_state():
    s = make([spec(1, temperature=0.0, frequency_penalty=1.0), spec(2, temperature=0.0)])
    s.update([1, 99], [])  # an unknown sid is ignored
    assert 1 not in s.states and 2 in s.states
    with pytest.raises(KeyError):
        sample(s, [BASE], [1], [0])
    assert sample(s, [BASE], [2], [0]).token_ids == [4]


def test_new_spec_for_reused_sid_resets_counts():
    pen = dict(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.35)
    s = make([spec(1, **pen)])
    first = [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(6)]
    assert first == [4, 4, 0, 1, 4, 0]
    # Released and re-admitted in the same update (release runs first).
    s.update([1], [spec(1, **pen)])
    assert [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(6)] == first
    # A new spec without a release also replaces the state.
    s.update([], [spec(1, **pen)])
    assert [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(6)] == first
    # A reused sid without penalties carries no counts from its previous life.
    s.update([1], [spec(1, temperature=0.0)])
    assert s.states[1].counts is None and s.states[1].seen is None
    assert [sample(s, [BASE], [1], [n]).token_ids[0] for n in range(3)] == [4, 4, 4]


def test_repetition_state_reset_on_reuse():
    s = make([spec(1, temperature=0.0, repetition_penalty=2.0, prompt=[4])])
    assert sample(s, [BASE], [1], [0]).token_ids == [0]  # 4 seen in the prompt: 1.5 < 2.0
    s.update([1], [spec(1, temperature=0.0, repetition_penalty=2.0, prompt=[0])])
    assert sample(s, [BASE], [1], [0]).token_ids == [4]


def test_state_allocated_only_for_penalties():
    s = make(
        [
            spec(1),
            spec(2, frequency_penalty=0.1),
            spec(3, presence_penalty=-0.2),
            spec(4, repetition_penalty=1.1, prompt=[3]),
            spec(5, repetition_penalty=1.0, prompt=[3]),
        ]
    )
    st = s.states
    assert st[1].counts is None and st[1].seen is None
    assert st[2].counts is not None and st[2].seen is None
    assert st[3].counts is not None
    assert st[4].seen is not None and st[4].seen.tolist() == [i == 3 for i in range(V)]
    assert st[5].seen is None


# ---- logit_bias --------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_greedy_tokens_per_row():
    """+100 forces a token, -100 on the argmax hands the step to the runner-up; the unbiased row
    in the same batch, and the caller's logits, are untouched."""
    logits = torch.tensor([BASE, BASE, BASE])
    before = logits.clone()
    s = make(
        [
            spec(1, temperature=0.0, logit_bias={2: 100.0}),
            spec(2, temperature=0.0, logit_bias={4: -100.0}),
            spec(3, temperature=0.0),
        ]
    )
    assert s.sample(logits, [1, 2, 3], [0, 0, 0]).token_ids == [2, 0, 4]
    assert torch.equal(logits, before)


def test_logit_bias_shifts_the_sampled_distribution():
    bias = {0: -2.0, 5: 3.0, 7: 1.5}
    biased = torch.tensor(BASE) + torch.tensor([bias.get(t, 0.0) for t in range(V)])
    want = torch.softmax(biased, -1).tolist()
    assert_matches(draw_many(torch.tensor(BASE), 4000, temperature=1.0, logit_bias=bias), want)


def test_logit_bias_cannot_lift_a_masked_token():
    """A grammar's -inf (applied before the sampler) and min_new_tokens' stop mask win over +100."""
    row = list(BASE)
    row[2] = float("-inf")
    s = make(
        [
            spec(1, stop=[3], temperature=0.0, min_new_tokens=2, logit_bias={2: 100.0, 3: 100.0}),
            spec(2, temperature=0.9, seed=5, logit_bias={2: 100.0}),
        ]
    )
    for n in range(20):
        first, second = s.sample(torch.tensor([row, row]), [1, 2], [0, n]).token_ids
        assert first not in (2, 3) and second != 2


def test_logit_bias_logprobs_are_of_the_biased_distribution():
    s = make([spec(1, temperature=0.0, logprobs=True, logit_bias={1: 5.0})])
    res = s.sample(torch.tensor([BASE]), [1], [0])
    biased = torch.tensor(BASE)
    biased[1] += 5.0
    assert res.token_ids == [1]
    assert res.logprobs[0] == pytest.approx(float(torch.log_softmax(biased, -1)[1]), abs=1e-5)


def test_logit_bias_holds_under_speculative_verification_and_drafting():
    """A verified greedy request keeps a proposal only where it equals the biased argmax, so its
    output is the one without speculation; a draft proposes as its sampler would."""
    s = make([spec(1, temperature=0.0, logit_bias={3: 100.0}), spec(2, temperature=0.0)])
    rows = torch.tensor([BASE] * 5)  # request 1 verifies [3, 4], request 2 verifies [4]
    assert s.verify(rows, [1, 2], [0, 0], [[3, 4], [4]]) == [[3, 3], [4, 4]]
    tokens, dists = s.propose(torch.tensor([BASE, BASE]), [1, 2], [0, 0], [[], []])
    assert tokens == [3, 4] and dists == [None, None]


def test_logit_bias_state_only_for_biased_requests():
    s = make([spec(1), spec(2, logit_bias={6: 1.0, 0: -1.0})])
    assert s.states[1].bias_ids is None
    assert s.states[2].bias_ids.tolist() == [6, 0] and s.states[2].bias_values.tolist() == [
        1.0,
        -1.0,
    ]
