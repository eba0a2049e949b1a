"""The BatchInput message for a step the scheduler chose, and the record of it kept until its
output comes back (StepInFlight)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay.scheduling import embedding, prompt_logprobs
from relay.scheduling.kv_manager import KVManager
from relay.scheduling.request import Req
from relay.scheduling.request_table import RequestTable
from relay.scheduling.speculative.planner import SpecPlanner, SpecRow
from relay.scheduling.step_cost import StepCost
from relay.step import BatchInput, SamplingSpec

if TYPE_CHECKING:
    from relay.text.grammar import GrammarBackend

Batch = list[tuple[Req, int]]  # (request, tokens it computes in the step)


@dataclass
class StepInFlight:
    """A step sent to the runner: who is in it, and what the step-time model learns from it."""

    reqs: list[Req]
    started: float
    decode_tokens: int = 0  # including proposals to verify
    prefill_cost: int = 0  # budget units of prompt chunks


class BatchBuilder:
    def __init__(
        self,
        table: RequestTable,
        kv: KVManager,
        cost: StepCost,
        spec: SpecPlanner | None,
        eos_token_ids: frozenset[int],
        long_rope_after: int | None,
        grammars: GrammarBackend | None,
        clock: Callable[[], float],
    ):
        self.table, self.kv, self.cost, self.spec = table, kv, cost, spec
        self.eos_token_ids = eos_token_ids
        self.long_rope_after = long_rope_after
        self.grammars = grammars
        self.clock = clock
        self.inflight: dict[int, StepInFlight] = {}  # by step number, until its output is processed
        self._step = 0
        self.mask_seconds = 0.0  # building grammar masks

    def build(self, batch: Batch, spec_rows: dict[int, SpecRow]) -> BatchInput:
        """The step's message; its requests' KV and pending counts now include it."""
        self._step += 1
        input_ids: list[int] = []
        specs = []
        updates = []
        step = StepInFlight([req for req, _ in batch], self.clock())
        for req, n in batch:
            input_ids.extend(req.input_slice(req.kv_len, req.kv_len + n))
            k = spec_rows[id(req)].k if id(req) in spec_rows else 0
            if req.in_prefill:
                step.prefill_cost += self.cost.cost(req, n)
            else:
                step.decode_tokens += n + k
            updates.append(req.page_update(self.kv.pages_for(req.kv_len + n + k)))
            if not req.spec_sent:
                specs.append(self._sampling_spec(req))
                req.spec_sent = True
        self.inflight[self._step] = step
        out = BatchInput(
            step=self._step,
            sids=[req.sid for req, _ in batch],
            input_ids=input_ids,
            prefix_lens=[req.kv_len for req, _ in batch],
            extend_lens=[n for _, n in batch],
            page_starts=[start for start, _ in updates],
            new_pages=[pages for _, pages in updates],
            sample=[req.kv_len + n == req.seq_len for req, n in batch],
            output_lens=[len(req.output_ids) + req.pending for req, _ in batch],
            new_specs=specs,
            released_sids=self.table.take_released_sids(),
            token_masks=self._token_masks(batch, spec_rows),
            rope_long=[req.long_rope for req, _ in batch]
            if self.long_rope_after is not None
            else [],
            prompt_logprob_spans=self._spans(
                batch, lambda r: r.prompt_logprobs is not None, prompt_logprobs.span
            ),
            embed_spans=self._spans(batch, lambda r: r.pooled is not None, embedding.span),
            **self._spec_fields(batch, spec_rows),
        )
        self._count_in(batch, out.sample)
        return out

    @staticmethod
    def _spans(batch: Batch, wants, span) -> list:
        """span(req, row, n) for the requests that want(req) (their prompt's logprobs, their
        pooling), where this step's chunk has positions to give them."""
        spans = (span(req, row, n) for row, (req, n) in enumerate(batch) if wants(req))
        return [s for s in spans if s is not None]

    def _count_in(self, batch: Batch, sample: list[bool]) -> None:
        """The step's KV counts as its requests' from now; what it samples is pending."""
        speculating = self.spec is not None and self.spec.active(len(self.table.running))
        for (req, n), samples in zip(batch, sample):
            req.kv_len += n
            req.unwritten += n
            req.inflight_steps += 1
            if samples:
                req.pending += 1
                # While speculation is on, a request waits for its token: proposals need it.
                req.chainable = req.constraint is None and not speculating

    def _token_masks(self, batch: Batch, spec_rows: dict[int, SpecRow]) -> dict[int, bytes]:
        """Per constrained row that samples, the bitmask of allowed next tokens; for a row
        verifying proposals, one after each proposal too (k + 1, concatenated)."""
        rows = [
            i
            for i, (req, n) in enumerate(batch)
            if req.constraint is not None and req.kv_len + n == req.seq_len
        ]
        if not rows:
            return {}
        start = time.perf_counter()
        masks = {}
        for i in rows:
            req = batch[i][0]
            row = spec_rows.get(id(req))
            masks[i] = self.grammars.masks(req.constraint, row.proposals if row else [])
        self.mask_seconds += time.perf_counter() - start
        return masks

    def _spec_fields(self, batch: Batch, spec_rows: dict[int, SpecRow]) -> dict:
        if not spec_rows:
            return {}
        rows = [spec_rows.get(id(req)) for req, _ in batch]
        fields = {
            "spec_lens": [row.k if row else 0 for row in rows],
            "proposed_ids": [t for row in rows if row for t in row.proposals],
        }
        if self.spec.algorithm == "standalone":
            fields["catchup_lens"] = [len(row.catchup) if row else 0 for row in rows]
            fields["catchup_ids"] = [t for row in rows if row for t in row.catchup]
            fields["draft_prefix_lens"] = [req.draft_len for req, _ in batch]
        return fields

    def _sampling_spec(self, req: Req) -> SamplingSpec:
        p = req.params
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        prompt = req.prompt_ids if p.repetition_penalty != 1.0 else []
        return SamplingSpec(req.sid, p, stops, prompt, list(req.output_ids) if p.penalised else [])
