"""The model runner: weights, the KV pool's tensors, attention, sampling. One per TP rank.

`forward(BatchInput) -> BatchOutput` is its whole interface. This module coordinates the parts
that each do one job: placement (device, dtypes, threads), model_loading (weights),
kv_setup (the KV pool and its size), startup_timing (the measurements that choose CPU paths),
warm_up, request_state (what it keeps per request between steps), batch_checks (rows that
cannot run), step_inputs (a batch as the model's inputs), cuda_graph (decode graphs) and
step_sampling (logits to a BatchOutput).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from relay.config import EngineConfig, ModelConfig
from relay.execution import hidden_sums
from relay.execution.batch_checks import BatchChecker
from relay.execution.cuda_graph import decode_graphs
from relay.execution.distributed import TPGroup
from relay.execution.draft_check import check_draft_model, draft_model_dir
from relay.execution.draft_model import Drafter
from relay.execution.kv_setup import agree_on_pages, free_bytes_after_warmup, kv_and_attention
from relay.execution.model_loading import ModelLoader, log_memory
from relay.execution.placement import Placement, claim_threads, pick_device
from relay.execution.prompt_logprobs import score, span_rows
from relay.execution.request_state import RequestTables
from relay.execution.sampler import Sampler
from relay.execution.startup_timing import choose_decode_layers
from relay.execution.step_inputs import last_rows, prepare_step, with_proposals
from relay.execution.step_sampling import sample_step
from relay.execution.warm_up import warm_up_steps
from relay.step import BatchInput, BatchOutput, EmbedChunk, PromptLogprobChunk

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: str,
        mc: ModelConfig,
        tp: TPGroup | None = None,
        device: torch.device | None = None,
    ):
        self.tp = tp or TPGroup()
        self.mc = mc
        self.device = device or pick_device(cfg.device)
        self.cfg = cfg = cfg.for_device(self.device.type)
        self.place = Placement.choose(cfg, self.tp, self.device)
        self.dtype, self.kv_dtype = self.place.dtype, self.place.kv_dtype
        self.thread_backoff = claim_threads(
            cfg, self.place
        )  # what the step loop calls after every CPU step
        self.context_len = cfg.context_length or mc.max_position_embeddings
        loader = ModelLoader(cfg, self.place, self.context_len)
        self.model = loader.load(model_dir, mc, cfg.quantization)
        self.draft_mc = self.draft_model = None
        if cfg.speculative_algorithm == "standalone":
            draft_dir = draft_model_dir(cfg, model_dir)
            self.draft_mc = check_draft_model(mc, draft_dir, model_dir)
            self.draft_model = loader.load(draft_dir, self.draft_mc, cfg.draft_quantization)
        self.page_size = cfg.page_size
        self.num_pages = agree_on_pages(
            cfg,
            self.place,
            mc,
            self.draft_mc,
            lambda: free_bytes_after_warmup(cfg, self.place, mc, self.model, self.context_len),
        )
        self.kv, self.attn = kv_and_attention(cfg, self.place, mc, self.num_pages, self.context_len)
        if self.tp.is_leader:
            log_memory([self.model, self.draft_model], self.kv)
        self._choose_cpu_paths()
        self.drafter = self._drafter()
        self.sampler = Sampler(mc.vocab_size, self.device, cfg.seed) if self.tp.is_leader else None
        self.requests = RequestTables(self.tp, self.device)
        # How far back every layer attends, where the scheduler gives back the pages behind it
        # (FREED_PAGE entries): not with a draft model, which reads the same pages with its own
        # windows and from its own, lagging, position.
        self.kv_window = mc.kv_window(self.context_len) if self.drafter is None else None
        self.checker = BatchChecker(
            mc.vocab_size,
            self.num_pages,
            self.page_size,
            self.context_len,
            self.drafter is not None,
            self.kv_window,
        )
        self.cuda_graphs = decode_graphs(cfg, self.model, self.attn, self.device, self.context_len)
        self._warm_up()

    def _choose_cpu_paths(self) -> None:
        """Which of the model's one-C-call paths its steps take here; the weight blocks no path reads go."""
        if self.place.on_cpu and self.model.use_decode_layers(self.attn):
            choose_decode_layers(
                self.model, self.attn, self.run_model, self.tp.size, self.page_size, self.num_pages
            )
        if self.place.on_cpu and self.model.use_prompt_layers(self.attn):
            logger.info(
                "steps with prompt chunks run their decoder layers in one C call on the bfloat16 panels"
            )
        self.model.drop_unused_weight_blocks()

    def _drafter(self) -> Drafter | None:
        """The standalone draft model over a KV pool of its own (as many pages), or None."""
        if self.draft_model is None:
            return None
        _, draft_attn = kv_and_attention(
            self.cfg, self.place, self.draft_mc, self.num_pages, self.context_len
        )
        if self.place.on_cpu:
            self.draft_model.use_decode_layers(draft_attn)
        self.draft_model.drop_unused_weight_blocks()
        return Drafter(self.draft_model, draft_attn, self.run_model)

    def _warm_up(self) -> None:
        """Run every kind of step once before the server says it is ready (relay.execution.warm_up)."""
        steps = warm_up_steps(
            self.context_len,
            self.page_size,
            self.num_pages,
            bool(self.cfg.speculative_algorithm),
            self.drafter is not None,
        )
        for batch in steps:
            out = self.forward(batch)
            if out.row_errors or out.error:
                raise RuntimeError(f"the warm-up step failed: {out.error or out.row_errors}")

    # ---- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: BatchInput) -> BatchOutput:
        """Run one step. A request whose input is malformed is left out of it (every rank
        reaches the same verdict, so the ranks stay in step) and so is one whose sampling
        raises; both come back in row_errors while the rest of the batch runs."""
        batch = self.requests.fill_pending(batch)
        self.requests.forget_sampled(batch)
        row_errors = self.invalid_rows(batch)
        run = batch.without(set(row_errors)) if row_errors else batch
        if self.sampler is not None:
            self.sampler.update(run.released_sids, run.new_specs)
        tables = self.requests.apply(run)
        speculative = bool(run.spec_lens or run.catchup_lens)
        proposals, dists = self._proposals(run, tables) if speculative else (None, None)
        logits, scored, pooled = None, [], []
        if run.sids and speculative:
            verify, rows = with_proposals(run, proposals)
            logits, scored, pooled = self.step_scores(verify, tables, rows)
        elif run.sids:
            logits, scored, pooled = self.step_scores(run, tables)
        if self.sampler is None:
            return BatchOutput(batch.step, [], row_errors=row_errors)
        out = sample_step(self.sampler, batch, run, row_errors, logits, proposals, dists)
        out.prompt_logprobs = _batch_rows(scored, batch, row_errors)
        out.embed_chunks = _batch_rows(pooled, batch, row_errors)
        self.requests.remember(batch, out)
        return out

    def invalid_rows(self, batch: BatchInput) -> dict[int, str]:
        """Rows whose input would index outside the model, the KV pool or the request's page
        table, with why (relay.execution.batch_checks)."""
        return self.checker.invalid_rows(batch, self.requests.page_tables)

    def _proposals(
        self, batch: BatchInput, tables: list[list[int]]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per row, the tokens to verify after its input token, and for sampled requests the
        draft distributions they came from (None: the proposals were certain, as n-gram's)."""
        if self.drafter is not None:
            return self.drafter.propose(batch, tables, self.sampler)
        return batch.row_runs(batch.proposed_ids, batch.spec_lens), [None] * len(batch.sids)

    def step_scores(
        self, batch: BatchInput, tables: list[list[int]], rows: list[int] | None = None
    ) -> tuple[torch.Tensor | None, list[PromptLogprobChunk], list[EmbedChunk]]:
        """step_logits, the prompt log-probabilities of the batch's PromptLogprobSpans
        (relay.execution.prompt_logprobs) and the hidden-state sums of its EmbedSpans
        (relay.execution.hidden_sums): the forward keeps their rows' hidden states too."""
        if not batch.prompt_logprob_spans and not batch.embed_spans:
            return self.step_logits(batch, tables, rows), [], []
        rows = last_rows(batch) if rows is None else rows
        scored, pooled = span_rows(batch), hidden_sums.span_rows(batch)
        keep = sorted(set(rows) | set(scored) | set(pooled))
        at = {r: k for k, r in enumerate(keep)}
        hidden = self.run_hidden(self.model, self.attn, batch, tables, keep)
        pick = lambda wanted: hidden[[at[r] for r in wanted]]  # noqa: E731
        logits = self.model.compute_logits(pick(rows)) if rows else None
        chunks = []
        if batch.prompt_logprob_spans:  # every TP rank: the logits gather across them
            chunks = score(pick(scored), self.model.compute_logits, batch.prompt_logprob_spans)
        sums = []
        if batch.embed_spans and self.tp.is_leader:  # only the leader answers the scheduler
            sums = hidden_sums.sums(pick(pooled), batch.embed_spans)
        return logits, chunks, sums

    @torch.inference_mode()
    def step_logits(
        self, batch: BatchInput, tables: list[list[int]], rows: list[int] | None = None
    ) -> torch.Tensor | None:
        """Run one step's forward over these page tables (one per request, covering its
        prefix and new tokens); float32 logits [rows, vocab] of the given token rows (default:
        each sampling request's last token; None when there are none). Decode steps that fit a
        captured CUDA graph replay it (logits included); everything else runs eagerly."""
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(len(batch.extend_lens), batch.is_decode):
            meta, input_ids = self.prepare(batch, tables)
            rows = last_rows(batch) if rows is None else rows
            logits = graphs.replay(meta, input_ids)
            if not rows:
                return None
            return logits[rows] if len(rows) < logits.shape[0] else logits
        return self.run_model(self.model, self.attn, batch, tables, rows)

    def run_model(
        self,
        model: torch.nn.Module,
        attn,
        batch: BatchInput,
        tables: list[list[int]],
        rows: list[int] | None = None,
    ) -> torch.Tensor | None:
        """An eager forward of model over its KV pool (attn's) and these page tables; float32
        logits of the given token rows (default: each sampling request's last token)."""
        rows = last_rows(batch) if rows is None else rows
        ordered = all(a < b for a, b in zip(rows, rows[1:]))
        hidden = self.run_hidden(model, attn, batch, tables, rows if ordered else None)
        if not rows:
            return None
        return model.compute_logits(hidden if ordered else hidden[rows])

    def run_hidden(
        self,
        model: torch.nn.Module,
        attn,
        batch: BatchInput,
        tables: list[list[int]],
        rows: list[int] | None,
    ) -> torch.Tensor:
        """An eager forward's final hidden states of the given token rows (increasing; None:
        every row)."""
        meta, input_ids = self.prepare(batch, tables, model)
        attn.plan(meta)
        return model(input_ids, meta.positions, attn, rows)

    def prepare(
        self, batch: BatchInput, tables: list[list[int]], model: torch.nn.Module | None = None
    ):
        """The step's attention metadata and input ids on this runner's device, positions on
        model's rotary tables (default: the runner's model)."""
        return prepare_step(
            batch, tables, self.page_size, self.device, model if model is not None else self.model
        )


def _batch_rows(chunks: list, batch: BatchInput, row_errors: dict[int, str]) -> list:
    """A step's chunks renumbered from the rows that ran to the batch's rows."""
    if not chunks or not row_errors:
        return chunks
    kept = [i for i in range(len(batch.sids)) if i not in row_errors]
    return [dataclasses.replace(c, row=kept[c.row]) for c in chunks]
