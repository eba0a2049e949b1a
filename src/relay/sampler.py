"""Batched sampling: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

The sampler lives with the model runner (on the leader rank) and keeps each request's
sampling state keyed by the scheduler's request handle (sid): its parameters, and for
penalised requests the counts of tokens generated so far. Every step samples all requests
in one pass of tensor ops; per-request work is limited to building small index lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from relay.batch import SamplingSpec

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) fixed by (seed, position): the same seed gives the same output
    whatever else is in the batch (splitmix64 of the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass
class _State:
    spec: SamplingSpec
    counts: torch.Tensor | None = None  # [vocab] output-token counts (frequency/presence)
    seen: torch.Tensor | None = None  # [vocab] bool: prompt or output token (repetition)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]] | None] | None = None


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
            if p.frequency_penalty or p.presence_penalty:
                st.counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            if p.repetition_penalty != 1.0:
                st.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                if spec.prompt_ids:
                    st.seen[torch.tensor(spec.prompt_ids, device=self.device)] = True
            self.states[spec.sid] = st

    def sample(self, logits: torch.Tensor, sids: list[int], output_lens: list[int]) -> SampleResult:
        """logits: [rows, vocab] float32, one row per sid; returns one token per row."""
        states = [self.states[sid] for sid in sids]
        params = [st.spec.params for st in states]
        logits = self._apply_penalties(logits, states)
        self._mask_early_stops(logits, states, output_lens)
        tokens = self._choose(logits, params, output_lens)
        result = SampleResult(tokens.tolist())  # the step's one device -> host copy of tokens
        if any(p.logprobs for p in params):
            self._add_logprobs(result, logits, params, tokens)
        self._record(states, result.token_ids)
        return result

    # ---- logit processing -----------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, states: list[_State]) -> torch.Tensor:
        """Penalised logits (a copy: the caller's tensor is left alone)."""
        rows = [i for i, st in enumerate(states) if st.counts is not None or st.seen is not None]
        early = any(st.spec.params.min_new_tokens for st in states)
        if rows or early:
            logits = logits.clone()
        for i in rows:  # penalised requests are rare; one small op chain each
            st, p, row = states[i], states[i].spec.params, logits[i]
            if st.seen is not None:
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(st.seen, penalised, row))
            if st.counts is not None:
                row -= p.frequency_penalty * st.counts + p.presence_penalty * (st.counts > 0)
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, states: list[_State], output_lens: list[int]) -> None:
        """Stop tokens get -inf until a request has min_new_tokens (one indexed write per step)."""
        rows, cols = [], []
        for i, st in enumerate(states):
            if output_lens[i] < st.spec.params.min_new_tokens:
                rows += [i] * len(st.spec.stop_token_ids)
                cols += st.spec.stop_token_ids
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device, non_blocking=True)
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
            tokens[rows] = self._sample_rows(logits[rows], [params[i] for i in rand_rows],
                                             [output_lens[i] for i in rand_rows])
        return tokens

    def _sample_rows(self, logits: torch.Tensor, params: list, output_lens: list[int]) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        # Per-row knobs travel to the device in one copy: temperature, top-k, top-p, min-p, u.
        fresh = iter(torch.rand(sum(p.seed is None for p in params), generator=self.rng,
                                dtype=torch.float64).tolist())  # seeded rows leave the runner RNG alone
        knobs = torch.tensor([[p.temperature, p.top_k if p.top_k > 0 else vocab,
                               p.top_p if p.top_p < 1.0 else 2.0,  # 1.0 keeps all, even past rounding
                               p.min_p, seeded_uniform(p.seed, k) if p.seed is not None else next(fresh)]
                              for p, k in zip(params, output_lens)], dtype=torch.float64)
        knobs = knobs.to(dev, non_blocking=True)
        temps, ks, ps, min_ps, u = (knobs[:, j:j + 1] for j in range(5))
        probs = torch.softmax(logits / temps.float(), dim=-1)
        needs_sort = any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params)
        if needs_sort:
            probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = (ranks >= ks) | (probs.cumsum(-1) - probs > ps)  # keeps the top token always
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            floor = min_ps.float() * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        cdf = probs.double().cumsum(-1)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
        # Never land on a zeroed (filtered) token through floating-point edge cases.
        idx = torch.where(probs.gather(1, idx) > 0, idx, probs.argmax(-1, keepdim=True))
        return (order.gather(1, idx) if needs_sort else idx).squeeze(1)

    # ---- outputs ----------------------------------------------------------------------------
    def _add_logprobs(self, result: SampleResult, logits: torch.Tensor, params: list,
                      tokens: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        result.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        n = max(p.top_logprobs for p in params)
        if n == 0:
            return
        vals, ids = logprobs.topk(n, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        result.top_logprobs = [[ids[i][:p.top_logprobs], vals[i][:p.top_logprobs]] if p.top_logprobs else None
                               for i, p in enumerate(params)]

    def _record(self, states: list[_State], tokens: list[int]) -> None:
        for st, tok in zip(states, tokens):
            if st.counts is not None:
                st.counts[tok] += 1
            if st.seen is not None:
                st.seen[tok] = True
