"""The standalone draft: a second model in the model runner's process that proposes tokens.

Its KV pool has as many pages as the target's and is indexed by the same page tables, so
the scheduler's page accounting covers both and a verified token's page holds its KV in
both pools. The scheduler tracks how far each request's draft KV reaches (Req.draft_len)
and sends the tokens the draft has not read yet.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relay.execution.sampler import Sampler
from relay.step import BatchInput

# (model, attention backend, batch, page tables) -> float32 logits of the rows that sample.
RunModel = Callable[[torch.nn.Module, object, BatchInput, list[list[int]]], torch.Tensor]


class Drafter:
    def __init__(self, model: torch.nn.Module, attn, run_model: RunModel):
        self.model = model
        self.attn = attn
        self.run_model = run_model

    def propose(
        self, batch: BatchInput, tables: list[list[int]], sampler: Sampler
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per batch row, its proposals (spec_lens[i] tokens, drafted autoregressively) and
        the [k, vocab] distributions they were drawn from (None for greedy requests and rows
        that do not speculate). First the draft reads every row's catch-up tokens and, for a
        speculating row, its input token; then one decode pass per further proposal."""
        n = len(batch.sids)
        ks = batch.spec_lens or [0] * n
        catchup = batch.row_runs(batch.catchup_ids, batch.catchup_lens)
        firsts = _first_tokens(batch)
        rows = [i for i in range(n) if ks[i] or catchup[i]]
        drafted: list[list[int]] = [[] for _ in range(n)]
        dists: list[list[torch.Tensor | None]] = [[] for _ in range(n)]
        if not rows:
            return drafted, [None] * n
        read = [catchup[i] + ([firsts[i]] if ks[i] else []) for i in rows]
        step = _batch(
            batch, rows, read, [batch.draft_prefix_lens[i] for i in rows], [ks[i] > 0 for i in rows]
        )
        active, passed = [i for i in rows if ks[i]], rows
        for j in range(max(1, max(ks))):
            if j:
                active = passed = [i for i in active if ks[i] > j]
                step = _batch(
                    batch,
                    active,
                    [[drafted[i][-1]] for i in active],
                    [batch.prefix_lens[i] + j for i in active],
                    [True] * len(active),
                )
            logits = self.run_model(self.model, self.attn, step, [tables[i] for i in passed])
            if not active:
                break
            tokens, qs = sampler.propose(
                logits,
                [batch.sids[i] for i in active],
                [batch.output_lens[i] for i in active],
                [drafted[i] for i in active],
            )
            for i, tok, q in zip(active, tokens, qs):
                drafted[i].append(tok)
                dists[i].append(q)
        return drafted, [torch.stack(d) if d and d[0] is not None else None for d in dists]


def _first_tokens(batch: BatchInput) -> list[int]:
    """Each row's first input token (a decoding row's only one)."""
    out, at = [], 0
    for n in batch.extend_lens:
        out.append(batch.input_ids[at] if n else -1)
        at += n
    return out


def _batch(
    batch: BatchInput,
    rows: list[int],
    ids: list[list[int]],
    prefix_lens: list[int],
    sample: list[bool],
) -> BatchInput:
    """A draft forward over some rows of the target's batch: each reads ids from prefix_lens on."""
    return BatchInput(
        -1,
        [batch.sids[i] for i in rows],
        [t for run in ids for t in run],
        prefix_lens,
        [len(run) for run in ids],
        [],
        [],
        sample,
        [batch.output_lens[i] for i in rows],
    )
