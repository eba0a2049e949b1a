"""What a model runner keeps per request between steps, keyed by its handle (sid): the page
table each step's changes are applied to, and the token it last sampled, the input of a decode
row the scheduler built before it saw that token (PENDING_TOKEN)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from relay.execution.distributed import TPGroup
from relay.step import PENDING_TOKEN, BatchInput, BatchOutput


class RequestTables:
    def __init__(self, tp: TPGroup, device: torch.device):
        self.tp, self.device = tp, device
        self.page_tables: dict[
            int, list[int]
        ] = {}  # sid -> the KV pages of its prefix and new tokens
        self.last_tokens: dict[
            int, int
        ] = {}  # sid -> its token sampled last (the leader's: overlap)

    def fill_pending(self, batch: BatchInput) -> BatchInput:
        """The batch with each PENDING_TOKEN input (a decode row's only one) replaced by the
        token the leader sampled for that request last, sent to the other ranks (one small
        collective, only in steps that have such inputs); one it lacks stays, and its row fails."""
        if (
            not batch.input_ids
            or min(batch.input_ids) != PENDING_TOKEN
            or sum(batch.extend_lens) != len(batch.input_ids)
        ):
            return batch  # (a malformed batch: the runner's check fails it)
        ends = np.cumsum(batch.extend_lens) - 1
        rows = [
            (int(e), sid) for sid, e in zip(batch.sids, ends) if batch.input_ids[e] == PENDING_TOKEN
        ]
        tokens = self.tp.broadcast_ints(
            [self.last_tokens.get(sid, PENDING_TOKEN) for _, sid in rows], self.device
        )
        ids = list(batch.input_ids)
        for (i, _), tok in zip(rows, tokens):
            ids[i] = tok
        return dataclasses.replace(batch, input_ids=ids)

    def forget_sampled(self, batch: BatchInput) -> None:
        """Drop the last token of each row this step samples anew (a step that raises leaves none)."""
        for sid, sample in zip(batch.sids, batch.sample):
            if sample:
                self.last_tokens.pop(sid, None)

    def apply(self, run: BatchInput) -> list[list[int]]:
        """Release the step's finished requests, apply its page updates; the page table of each row."""
        for sid in run.released_sids:
            self.page_tables.pop(sid, None)
            self.last_tokens.pop(sid, None)
        for sid, start, pages in zip(run.sids, run.page_starts, run.new_pages):
            table = self.page_tables.setdefault(sid, [])
            del table[start:]
            table.extend(pages)
        return [self.page_tables[sid] for sid in run.sids]

    def remember(self, batch: BatchInput, out: BatchOutput) -> None:
        """Keep each sampling row's last emitted token for a PENDING_TOKEN in the next step."""
        sids = [sid for sid, s in zip(batch.sids, batch.sample) if s]
        spec = out.spec_token_ids or [[]] * len(sids)
        for sid, tok, more in zip(sids, out.next_token_ids, spec):
            tok = more[-1] if more else tok
            if tok >= 0:
                self.last_tokens[sid] = tok
            else:  # its row failed: a pending input that follows must fail too
                self.last_tokens.pop(sid, None)
