"""Applying a step's output: sampled tokens appended, requests that end finished (a stop
token, the length, the grammar), accepted proposals counted, new prefixes shared, and the
step's timing handed to the batch-size limits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.outputs import FinishReason, RequestOutput
from relay.scheduling import embedding, prompt_logprobs
from relay.scheduling.adaptive_batching import StepLimits
from relay.scheduling.batch_builder import StepInFlight
from relay.scheduling.kv_manager import KVManager
from relay.scheduling.request import Req, Status
from relay.scheduling.request_table import RequestTable
from relay.scheduling.speculative import SpecStats
from relay.step import BatchInput, BatchOutput

if TYPE_CHECKING:
    from relay.text.grammar import GrammarBackend


class OutputProcessor:
    def __init__(
        self,
        table: RequestTable,
        kv: KVManager,
        limits: StepLimits,
        spec_stats: SpecStats,
        eos_token_ids: frozenset[int],
        context_len: int,
        grammars: GrammarBackend | None,
        clock: Callable[[], float],
    ):
        self.table, self.kv, self.limits, self.spec_stats = table, kv, limits, spec_stats
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.grammars = grammars
        self.clock = clock
        self._last_output_time = 0.0
        self.last_step_seconds = 0.0  # the runner's time for the step processed last
        self.step_seconds = 0.0  # all processed steps' runner time

    def process(
        self, step: StepInFlight, batch: BatchInput, out: BatchOutput
    ) -> list[RequestOutput]:
        """One record per request that produced a token or ended."""
        reqs = step.reqs
        for req in reqs:
            req.inflight_steps -= 1
        now = self.clock()
        # With overlap the runner started this step when the one before it ended.
        duration = self.last_step_seconds = now - max(step.started, self._last_output_time)
        self._last_output_time = now
        if out.error is not None:
            return [
                self.table.finish(r, FinishReason.ABORT, out.error) for r in reqs if not r.finished
            ]
        events: list[RequestOutput] = []
        gaps: dict[
            float, int
        ] = {}  # inter-token gap -> tokens with it (decodes of a step share one)
        ttfts: list[float] = []
        scored = {chunk.row: chunk for chunk in out.prompt_logprobs}
        spans = {span.row: span for span in batch.prompt_logprob_spans}
        sums = {chunk.row: chunk for chunk in out.embed_chunks}
        pool_spans = {span.row: span for span in batch.embed_spans}
        j = 0
        for i, req in enumerate(reqs):
            token = None
            if batch.sample[i]:
                token, j = out.next_token_ids[j], j + 1
            if req.status != Status.RUNNING:
                continue  # aborted or retracted while the step ran
            if i in out.row_errors:  # this request alone failed; the rest of the batch ran
                events.append(self.table.finish(req, FinishReason.ABORT, out.row_errors[i]))
                continue
            req.unwritten -= batch.extend_lens[i]
            if i in scored and i in spans:
                prompt_logprobs.collect(req, spans[i], scored[i], batch.prefix_lens[i])
            if i in sums and i in pool_spans:
                embedding.collect(req, pool_spans[i], sums[i], batch.prefix_lens[i])
            if token is not None:
                req.pending -= 1
                more = out.spec_token_ids[j - 1] if out.spec_token_ids else []
                events.append(self._append_tokens(req, [token, *more], out, j - 1))
                _time_tokens(req, now, len(events[-1].token_ids), gaps, ttfts)
                if batch.spec_lens or batch.catchup_lens:
                    self._after_speculation(req, batch, i, batch.prefix_lens[i], len(more))
            if req.status == Status.RUNNING:
                self.kv.cache_prefix(
                    req
                )  # whole new pages go to the tree: others can share them now
        self.step_seconds += duration
        self.limits.on_step(
            now,
            duration,
            step.decode_tokens,
            step.prefill_cost,
            list(gaps.items()),
            ttfts,
            len(self.table.waiting),
            len(self.table.running),
        )
        return events

    def _after_speculation(
        self, req: Req, batch: BatchInput, i: int, start: int, accepted: int
    ) -> None:
        """Count a verified row; give back the pages of rejected proposals; advance the draft
        model's KV over what it read and what was kept."""
        k = batch.spec_lens[i] if batch.spec_lens else 0
        if k:
            self.spec_stats.record(k, accepted)
            req.spec_proposed += k
            req.spec_accepted += accepted
        if req.status != Status.RUNNING:
            return
        self.kv.trim(req)
        if batch.catchup_lens:
            # The draft read its catch-up tokens; proposing, also the input token and every
            # proposal but the last (through position start + k - 1), valid while kept.
            req.draft_len = (
                min(req.kv_len, start + k) if k else req.draft_len + batch.catchup_lens[i]
            )

    def _append_tokens(
        self, req: Req, tokens: list[int], out: BatchOutput, j: int
    ) -> RequestOutput:
        """Append a step's tokens (several when proposals were accepted) up to the first that
        ends the request; one record of those appended."""
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        record = RequestOutput(
            req.rid, [], prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens
        )
        if not req.output_ids:  # the first record
            record.prompt_logprobs = req.prompt_logprobs
        if req.params.max_new_tokens == 0:  # only the prompt's log-probabilities or embedding
            self._finish_prompt_only(record, req)
            return record
        if (
            req.params.logprobs and out.logprobs is not None
        ):  # such requests never speculate: one token
            req.logprobs.append(out.logprobs[j])
            record.logprobs = [out.logprobs[j]]
            if req.params.top_logprobs and out.top_logprobs is not None:
                req.top_logprobs.append(out.top_logprobs[j])
                record.top_logprobs = [out.top_logprobs[j]]
        for m, token in enumerate(tokens):
            if m:
                req.kv_len += 1  # the token before it was an accepted proposal: its KV is written
            req.output_ids.append(token)
            record.token_ids.append(token)
            reason, stop = self._finish_reason(req, token)
            if req.constraint is not None and reason is None:
                reason, stop = self._grammar_finish(req, token)
            if reason is not None:
                self._finish_record(record, req, reason, stop)
                break
        record.completion_tokens = len(req.output_ids)
        return record

    def _finish_prompt_only(self, record: RequestOutput, req: Req) -> None:
        """Finish a request that asked nothing of the output, with its embedding if it is one."""
        reason = FinishReason.LENGTH
        if req.pooled is not None:
            record.embedding = embedding.finish(req)
            if record.embedding is None:
                req.error = "the embedding lacks the hidden states of some prompt positions"
                reason = FinishReason.ABORT
        self._finish_record(record, req, reason, None)

    def _finish_record(
        self, record: RequestOutput, req: Req, reason: FinishReason, stop: int | str | None
    ) -> None:
        """Finish req, its record saying so."""
        req.matched_stop = stop
        done = self.table.finish(req, reason, req.error, req.error_param)
        record.finish_reason, record.matched_stop, record.queue_time = reason, stop, done.queue_time
        record.error, record.status, record.param = done.error, done.status, done.param

    def _grammar_finish(self, req: Req, token: int) -> tuple[FinishReason | None, int | None]:
        """Advance req's matcher over token: STOP once the grammar is complete."""
        if req.constraint.accept(token):
            return (FinishReason.STOP, None) if req.constraint.terminated else (None, None)
        if self.grammars.allows_nothing(req.constraint):
            # The grammar led to a dead end (its mask allowed no token, so the sampler drew
            # from -inf logits): the request's own grammar is at fault, a 4xx.
            kind = req.constraint.kind
            req.error = (
                f"the {kind} allows no token after {len(req.output_ids) - 1} output tokens: "
                "no output can complete it"
            )
            req.error_param = kind
        else:
            # The sampler only draws allowed tokens; one that is not means the mask and
            # the matcher disagree. End the request rather than emit off-grammar text.
            req.error = f"token {token} does not match the grammar"
        return FinishReason.ABORT, None

    def _finish_reason(self, req: Req, token: int) -> tuple[FinishReason | None, int | None]:
        p, n = req.params, len(req.output_ids)
        if n >= p.min_new_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            return FinishReason.STOP, token
        # The next step needs KV for all seq_len tokens. A request that alone would outgrow
        # the pool ends here, where its record reaches the caller (schedule() has no way to
        # report a finish), and never sits retracted with more KV than the pool holds.
        seen = len(req.prompt_ids) + n  # seq_len also counts tokens later steps still owe
        if (
            n >= p.max_new_tokens
            or seen >= self.context_len
            or self.kv.pages_for(seen) > self.kv.allocator.capacity
        ):
            return FinishReason.LENGTH, None
        return None, None


def _time_tokens(req: Req, now: float, k: int, gaps: dict[float, int], ttfts: list[float]) -> None:
    """A first token's TTFT, or the gap each of k tokens that came out together stands for."""
    if req.last_token_time is None:
        ttfts.append(now - req.arrival_time)
    elif k:
        gap = (now - req.last_token_time) / k
        gaps[gap] = gaps.get(gap, 0) + k
    req.last_token_time = now
