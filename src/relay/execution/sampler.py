"""Batched sampling: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

The sampler lives with the model runner (on the leader rank) and keeps each request's
sampling state keyed by the scheduler's request handle (sid): its parameters, and for
penalised requests the counts of tokens generated so far. Every step samples all requests
in one pass of tensor ops; per-request work is limited to building small index lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relay.step import SamplingSpec

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform in [0, 1) fixed by (seed, position, stream): the same seed gives the same
    output whatever else is in the batch (splitmix64 of the triple). Stream 0 chooses tokens;
    speculative decoding draws its accept tests and draft samples from streams 1 and 2."""
    z = (
        seed * 0x9E3779B97F4A7C15
        + (position + 1) * 0xBF58476D1CE4E5B9
        + stream * 0xD6E8FEB86659FD93
    ) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass
class _State:
    spec: SamplingSpec
    counts: torch.Tensor | None = None  # [vocab] output-token counts (frequency/presence)
    seen: torch.Tensor | None = None  # [vocab] bool: prompt or output token (repetition)
    bias_ids: torch.Tensor | None = None  # logit_bias's token ids [n] int64, and their biases [n]
    bias_values: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]] | None] | None = None
    spec_token_ids: list[list[int]] | None = None  # verified tokens after token_ids' (speculation)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.states: dict[int, _State] = {}
        self.rng = torch.Generator(device="cpu").manual_seed(seed)

    def update(self, released: list[int], new_specs: list[SamplingSpec]) -> None:
        for sid in released:
            self.states.pop(sid, None)
        for spec in new_specs:
            st = _State(spec)
            p = spec.params
            out = torch.tensor(spec.output_ids, dtype=torch.int64, device=self.device)
            if p.frequency_penalty or p.presence_penalty:
                st.counts = torch.bincount(out, minlength=self.vocab_size).to(torch.int32)
            if p.repetition_penalty != 1.0:
                st.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                st.seen[
                    torch.tensor(
                        spec.prompt_ids + spec.output_ids, dtype=torch.int64, device=self.device
                    )
                ] = True
            if p.logit_bias:  # built once: a step only concatenates the biased rows' tensors
                st.bias_ids = torch.tensor(
                    list(p.logit_bias), dtype=torch.int64, device=self.device
                )
                st.bias_values = torch.tensor(
                    list(p.logit_bias.values()), dtype=torch.float32, device=self.device
                )
            self.states[spec.sid] = st

    def sample(self, logits: torch.Tensor, sids: list[int], output_lens: list[int]) -> SampleResult:
        """logits: [rows, vocab] float32, one row per sid; returns one token per row."""
        states = [self.states[sid] for sid in sids]
        params = [st.spec.params for st in states]
        logits = self._adjusted(logits, states)
        self._mask_early_stops(logits, states, output_lens)
        tokens = self._choose(logits, params, output_lens)
        result = SampleResult(tokens.tolist())  # the step's one device -> host copy of tokens
        if any(p.logprobs for p in params):
            self._add_logprobs(result, logits, params, tokens)
        self._record(states, result.token_ids)
        return result

    # ---- logit processing -----------------------------------------------------------------
    def _adjusted(
        self, logits: torch.Tensor, states: list[_State], extra: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Logits after the penalties and then logit_bias (a copy where either, or the early-stop
        mask that follows, changes them: the caller's tensor is left alone). extra: per row,
        tokens to count as generated on top of the request's own (proposals ahead of a verified
        row). A grammar's mask, applied by the runner before this, stays -inf whatever the bias:
        as if the bias came first and the mask after it."""
        rows = [i for i, st in enumerate(states) if st.counts is not None or st.seen is not None]
        biased = [i for i, st in enumerate(states) if st.bias_ids is not None]
        early = any(st.spec.params.min_new_tokens for st in states)
        if rows or biased or early:
            logits = logits.clone()
        self._penalise(logits, states, rows, extra)
        if biased:
            _add_bias(logits, [states[i] for i in biased], biased)
        return logits

    def _penalise(
        self,
        logits: torch.Tensor,
        states: list[_State],
        rows: list[int],
        extra: list[list[int]] | None,
    ) -> None:
        for i in rows:  # penalised requests are rare; one small op chain each
            st, p, row = states[i], states[i].spec.params, logits[i]
            ahead = (
                torch.tensor(extra[i], dtype=torch.int64, device=row.device)
                if extra and extra[i]
                else None
            )
            if st.seen is not None:
                seen = st.seen if ahead is None else st.seen.clone().index_fill_(0, ahead, True)
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalised, row))
            if st.counts is not None:
                counts = (
                    st.counts
                    if ahead is None
                    else st.counts.clone().index_add_(
                        0, ahead, torch.ones_like(ahead, dtype=st.counts.dtype)
                    )
                )
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)

    def _mask_early_stops(
        self, logits: torch.Tensor, states: list[_State], output_lens: list[int]
    ) -> None:
        """Stop tokens get -inf until a request has min_new_tokens (one indexed write per step)."""
        rows, cols = [], []
        for i, st in enumerate(states):
            if output_lens[i] < st.spec.params.min_new_tokens:
                rows += [i] * len(st.spec.stop_token_ids)
                cols += st.spec.stop_token_ids
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64).to(
                logits.device, non_blocking=True
            )
            logits[index[0], index[1]] = float("-inf")

    # ---- choosing tokens ------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, params: list, output_lens: list[int]) -> torch.Tensor:
        """One token per row, on the logits' device."""
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rand_rows) == len(params):
            return self._sample_rows(logits, params, output_lens)
        if rand_rows:
            rows = torch.tensor(rand_rows).to(logits.device, non_blocking=True)
            tokens[rows] = self._sample_rows(
                logits[rows], [params[i] for i in rand_rows], [output_lens[i] for i in rand_rows]
            )
        return tokens

    def _sample_rows(
        self, logits: torch.Tensor, params: list, output_lens: list[int]
    ) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        # Per-row knobs travel to the device in one copy: temperature, top-k, top-p, min-p, u.
        fresh = iter(
            torch.rand(
                sum(p.seed is None for p in params), generator=self.rng, dtype=torch.float64
            ).tolist()
        )  # seeded rows leave the runner RNG alone
        u = [
            seeded_uniform(p.seed, k) if p.seed is not None else next(fresh)
            for p, k in zip(params, output_lens)
        ]
        knobs = torch.tensor(
            [_filter_knobs(p, vocab) + [x] for p, x in zip(params, u)], dtype=torch.float64
        )
        knobs = knobs.to(dev, non_blocking=True)
        probs, order = self._filter(logits, params, knobs)
        return _draw(probs, knobs[:, 4:5], order)

    def _filter(
        self, logits: torch.Tensor, params: list, knobs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unnormalised probabilities after temperature, top-k, top-p and min-p; sorted in
        descending order (with the sort's order) when top-k or top-p needed a sort."""
        dev, vocab = logits.device, logits.shape[1]
        temps, ks, ps, min_ps = (knobs[:, j : j + 1] for j in range(4))
        probs = torch.softmax(logits / temps.float(), dim=-1)
        order = None
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = (ranks >= ks) | (probs.cumsum(-1) - probs > ps)  # keeps the top token always
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            floor = min_ps.float() * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs, order

    def distributions(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Each row's sampling distribution [rows, vocab] in token order, normalised: what a
        sampled token is drawn from (speculative decoding compares these of draft and target)."""
        vocab = logits.shape[1]
        knobs = torch.tensor([_filter_knobs(p, vocab) for p in params], dtype=torch.float64).to(
            logits.device
        )
        probs, order = self._filter(logits, params, knobs)
        if order is not None:
            probs = torch.zeros_like(probs).scatter_(1, order, probs)
        return probs / probs.sum(dim=-1, keepdim=True)

    # ---- speculative decoding -------------------------------------------------------------
    def propose(
        self,
        logits: torch.Tensor,
        sids: list[int],
        output_lens: list[int],
        drafted: list[list[int]],
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """A draft model's next proposal per row, chosen as the request's own sampler would
        (penalties counting what the row drafted already), and for sampled requests the
        distribution it was drawn from (None for greedy ones)."""
        states = [self.states[sid] for sid in sids]
        lens = [n + len(d) for n, d in zip(output_lens, drafted)]
        logits = self._adjusted(logits, states, drafted)
        self._mask_early_stops(logits, states, lens)
        tokens = logits.argmax(dim=-1).tolist()
        dists: list[torch.Tensor | None] = [None] * len(sids)
        rows = [i for i, st in enumerate(states) if not st.spec.params.greedy]
        if rows:
            q = self.distributions(logits[rows], [states[i].spec.params for i in rows])
            u = torch.tensor(
                [[self._uniform(states[i].spec.params, lens[i], 2)] for i in rows],
                dtype=torch.float64,
            )
            for i, tok, dist in zip(rows, _draw(q, u.to(q.device)).tolist(), q):
                tokens[i], dists[i] = tok, dist
        return tokens, dists

    def verify(
        self,
        logits: torch.Tensor,
        sids: list[int],
        output_lens: list[int],
        proposals: list[list[int]],
        draft_dists: list[torch.Tensor | None] | None = None,
    ) -> list[list[int]]:
        """Decide which proposals each request keeps; per request the tokens to emit: the kept
        proposals, then one token of the target's own.

        logits: [sum(len(p) + 1), vocab], request i's rows in order, its row j scoring the
        token after its first j proposals. draft_dists[i]: [len(proposals[i]), vocab], the
        distributions proposals were drawn from (None: deterministic proposals, as n-gram's).
        Greedy requests keep proposals while they equal the target's argmax, so the output is
        the one without speculation. Sampled ones use rejection sampling (keep a proposal with
        probability min(1, p/q), else draw from max(0, p - q) renormalised), under which every
        emitted token is distributed as the target's own sampler would draw it."""
        states = [self.states[sid] for sid in sids]
        row_states, ahead, lens, starts = [], [], [], [0]
        for st, n, props in zip(states, output_lens, proposals):
            for j in range(len(props) + 1):
                row_states.append(st)
                ahead.append(props[:j])
                lens.append(n + j)
            starts.append(len(row_states))
        logits = self._adjusted(logits, row_states, ahead)
        self._mask_early_stops(logits, row_states, lens)
        top = logits.argmax(dim=-1).tolist()
        emitted = []
        for i, (st, props) in enumerate(zip(states, proposals)):
            lo, hi = starts[i], starts[i + 1]
            if st.spec.params.greedy:
                a = 0
                while a < len(props) and props[a] == top[lo + a]:
                    a += 1
                out = props[:a] + [top[lo + a]]
            else:
                p = self.distributions(logits[lo:hi], [st.spec.params] * (hi - lo))
                q = draft_dists[i] if draft_dists is not None else None
                out = self._accept(p, q, props, st.spec.params, output_lens[i])
            emitted.append(out)
        for st, out in zip(states, emitted):  # only once every row is decided
            for tok in out:
                self._record([st], [tok])
        return emitted

    def _accept(
        self, p: torch.Tensor, q: torch.Tensor | None, props: list[int], params, n: int
    ) -> list[int]:
        """Rejection sampling of one request's proposals against the target's distributions
        p [k + 1, vocab] (q: the proposals' [k, vocab], None when each proposal was certain)."""
        for j, tok in enumerate(props):
            p_tok = float(p[j, tok])
            q_tok = 1.0 if q is None else float(q[j, tok])
            if self._uniform(params, n + j, 1) * q_tok < p_tok:
                continue
            residual = p[j].clone()
            if q is None:
                residual[tok] = 0.0
            else:
                residual = (residual - q[j]).clamp_min_(0.0)
            if not residual.sum() > 0:  # p == q exactly: nothing to correct towards
                residual = p[j]
            return props[:j] + [self._draw_one(residual, params, n + j)]
        return props + [self._draw_one(p[len(props)], params, n + len(props))]

    def _draw_one(self, dist: torch.Tensor, params, position: int) -> int:
        u = torch.tensor(
            [[self._uniform(params, position, 0)]], dtype=torch.float64, device=dist.device
        )
        return int(_draw(dist.unsqueeze(0), u)[0])

    def _uniform(self, params, position: int, stream: int) -> float:
        if params.seed is not None:
            return seeded_uniform(params.seed, position, stream)
        return float(torch.rand(1, generator=self.rng, dtype=torch.float64))

    # ---- outputs ----------------------------------------------------------------------------
    def _add_logprobs(
        self, result: SampleResult, logits: torch.Tensor, params: list, tokens: torch.Tensor
    ) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        result.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        n = max(p.top_logprobs for p in params)
        if n == 0:
            return
        vals, ids = logprobs.topk(n, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        result.top_logprobs = [
            [ids[i][: p.top_logprobs], vals[i][: p.top_logprobs]] if p.top_logprobs else None
            for i, p in enumerate(params)
        ]

    def _record(self, states: list[_State], tokens: list[int]) -> None:
        for st, tok in zip(states, tokens):
            if st.counts is not None:
                st.counts[tok] += 1
            if st.seen is not None:
                st.seen[tok] = True


def _add_bias(logits: torch.Tensor, states: list[_State], rows: list[int]) -> None:
    """Each biased row's logit_bias added in one indexed accumulate over the batch (-inf + bias
    stays -inf, so a masked token stays masked)."""
    ids = torch.cat([st.bias_ids for st in states])
    values = torch.cat([st.bias_values for st in states]).to(logits.dtype)
    counts = torch.tensor([len(st.bias_ids) for st in states])
    index = torch.repeat_interleave(torch.tensor(rows), counts).to(logits.device, non_blocking=True)
    logits.index_put_((index, ids), values, accumulate=True)


def _filter_knobs(p, vocab: int) -> list[float]:
    """A request's temperature, top-k, top-p and min-p as _filter reads them."""
    return [
        p.temperature,
        p.top_k if p.top_k > 0 else vocab,
        p.top_p if p.top_p < 1.0 else 2.0,  # 1.0 keeps all, even past rounding
        p.min_p,
    ]


def _draw(probs: torch.Tensor, u: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of unnormalised probs by inverse CDF at uniforms u [rows, 1]; through
    order when probs are sorted."""
    vocab = probs.shape[1]
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    # Never land on a zeroed (filtered) token through floating-point edge cases.
    idx = torch.where(probs.gather(1, idx) > 0, idx, probs.argmax(-1, keepdim=True))
    return (order.gather(1, idx) if order is not None else idx).squeeze(1)
