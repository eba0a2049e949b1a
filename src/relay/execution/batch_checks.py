"""The model runner's check of a step: rows whose input would index outside the model, the KV
pool or the request's page table. The scheduler never builds them; this keeps a bug (or a bad
id that slipped past the door) from failing a whole batch, or on a GPU from poisoning the
device. Every rank holds the same tables, so every rank reaches the same verdict."""

from __future__ import annotations

from dataclasses import dataclass

from relay.memory.kv_allocator import FREED_PAGE, pages_behind_window
from relay.step import PENDING_TOKEN, BatchInput


@dataclass(frozen=True)
class BatchChecker:
    vocab: int
    num_pages: int
    page_size: int
    context_len: int
    own_drafter: bool  # the runner drafts its proposals itself: a batch brings none
    kv_window: int | None = None  # ModelRunner.kv_window: FREED_PAGE entries behind it are fine

    def invalid_rows(self, batch: BatchInput, page_tables: dict[int, list[int]]) -> dict[int, str]:
        """Rows that cannot run, with why (a quick pass over the whole batch first)."""
        vocab = self.vocab
        specs_ok = all(
            ids_within(s.stop_token_ids, vocab) and ids_within(s.prompt_ids, vocab)
            for s in batch.new_specs
        )
        pages_ok = all(self._entries_ok(batch, i) for i in range(len(batch.new_pages)))
        spec_ok = (
            ids_within(batch.proposed_ids, vocab)
            and ids_within(batch.catchup_ids, vocab)
            and self._spec_lens_ok(batch)
        )
        if (
            ids_within(batch.input_ids, vocab)
            and pages_ok
            and specs_ok
            and spec_ok
            and sum(batch.extend_lens) == len(batch.input_ids)
            and not self._bad_tables(batch, page_tables)
        ):
            return {}
        return self._find_invalid_rows(batch, page_tables)

    def _entries_ok(self, batch: BatchInput, i: int) -> bool:
        """Row i's new page-table entries are pool pages, or FREED_PAGE where no query of the row
        attends (a page its sliding window has left behind), never a page it reads."""
        pages = batch.new_pages[i]
        if ids_within(pages, self.num_pages, 1):
            return True
        if not ids_within(pages, self.num_pages):
            return False
        dead = pages_behind_window(batch.prefix_lens[i], self.kv_window, self.page_size)
        return FREED_PAGE not in pages[max(0, dead - batch.page_starts[i]) :]

    def _spec_lens_ok(self, batch: BatchInput) -> bool:
        return len(batch.proposed_ids) == (0 if self.own_drafter else sum(batch.spec_lens)) and len(
            batch.catchup_ids
        ) == sum(batch.catchup_lens)

    def _bad_tables(self, batch: BatchInput, page_tables: dict[int, list[int]]) -> list[int]:
        """Rows whose page update leaves a gap, or whose table would not hold their tokens."""
        released = set(batch.released_sids)
        bad = []
        for i, sid in enumerate(batch.sids):
            held = 0 if sid in released else len(page_tables.get(sid, ()))
            end = (
                batch.prefix_lens[i]
                + batch.extend_lens[i]
                + (batch.spec_lens[i] if batch.spec_lens else 0)
            )
            start = batch.page_starts[i]
            if (
                start > held
                or (start + len(batch.new_pages[i])) * self.page_size < end
                or end > self.context_len
            ):
                bad.append(i)
        return bad

    def _find_invalid_rows(
        self, batch: BatchInput, page_tables: dict[int, list[int]]
    ) -> dict[int, str]:
        vocab = self.vocab
        bad_specs = {
            s.sid
            for s in batch.new_specs
            if not (ids_within(s.stop_token_ids, vocab) and ids_within(s.prompt_ids, vocab))
        }
        bad_tables = set(self._bad_tables(batch, page_tables))
        errors: dict[int, str] = {}
        start = 0
        proposed = batch.row_runs(batch.proposed_ids, batch.spec_lens)
        catchup = batch.row_runs(batch.catchup_ids, batch.catchup_lens)
        for i, (sid, n) in enumerate(zip(batch.sids, batch.extend_lens)):
            if PENDING_TOKEN in batch.input_ids[start : start + n]:
                errors[i] = "its previous step failed: there is no sampled token to continue from"
            elif not ids_within(
                batch.input_ids[start : start + n] + proposed[i] + catchup[i], vocab
            ):
                errors[i] = f"an input token id is outside the vocabulary [0, {vocab})"
            elif sid in bad_specs:
                errors[i] = f"a stop or prompt token id is outside the vocabulary [0, {vocab})"
            elif i in bad_tables or not self._entries_ok(batch, i):
                errors[i] = "the request's KV pages or positions are out of range"
            start += n
        if start != len(batch.input_ids) or not self._spec_lens_ok(batch):  # no row can be trusted
            errors = {
                i: "malformed batch: input ids and extend lengths disagree"
                for i in range(len(batch.sids))
            }
        return errors


def ids_within(ids: list[int], hi: int, lo: int = 0) -> bool:
    return not ids or (min(ids) >= lo and max(ids) < hi)
