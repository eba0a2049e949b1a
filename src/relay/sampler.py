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
        result = SampleResult(self._choose(logits, params, output_lens))
        if any(p.logprobs for p in params):
            self._add_logprobs(result, logits, params)
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
        for i, st in enumerate(states):
            if output_lens[i] < st.spec.params.min_new_tokens and st.spec.stop_token_ids:
                logits[i, st.spec.stop_token_ids] = float("-inf")

    # ---- choosing tokens ------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, params: list, output_lens: list[int]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, p in enumerate(params) if not p.greedy]
        if rand_rows:
            rows = torch.tensor(rand_rows, device=logits.device)
            picked = self._sample_rows(logits[rows], [params[i] for i in rand_rows],
                                       [output_lens[i] for i in rand_rows])
            tokens[rows] = picked
        return tokens.tolist()

    def _sample_rows(self, logits: torch.Tensor, params: list, output_lens: list[int]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        probs = torch.softmax(logits / temps, dim=-1)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        needs_sort = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
        if needs_sort:
            probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[1], device=dev).unsqueeze(0)
            ks = torch.tensor([k if k > 0 else probs.shape[1] for k in top_k], device=dev).unsqueeze(1)
            # top_p 1.0 must keep everything even where the cumulative sum rounds past 1.
            ps = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], device=dev).unsqueeze(1)
            drop = (ranks >= ks) | (probs.cumsum(-1) - probs > ps)  # keeps the top token always
            probs = probs.masked_fill(drop, 0.0)
        if any(m > 0 for m in min_p):
            floor = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        u = torch.tensor([seeded_uniform(p.seed, n) if p.seed is not None
                          else torch.rand(1, generator=self.rng).item()
                          for p, n in zip(params, output_lens)], dtype=torch.float64)
        cdf = probs.double().cumsum(-1)
        target = (u.to(dev).unsqueeze(1) * cdf[:, -1:])
        idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
        # Never land on a zeroed (filtered) token through floating-point edge cases.
        idx = torch.where(probs.gather(1, idx) > 0, idx, probs.argmax(-1, keepdim=True))
        return (order.gather(1, idx) if needs_sort else idx).squeeze(1)

    # ---- outputs ----------------------------------------------------------------------------
    def _add_logprobs(self, result: SampleResult, logits: torch.Tensor, params: list) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.tensor(result.token_ids, device=logits.device).unsqueeze(1)
        result.logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
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
