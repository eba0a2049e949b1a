"""Page bookkeeping for the paged KV pool: which pages are free.

Pure Python and tensor-free: the scheduler owns it, the model runner only ever sees page ids.
Page 0 is never handed out; runners use it as a scratch target for padded slots, and it is what
a page table maps a page to once a sliding window has left it behind (FREED_PAGE).
"""

from __future__ import annotations

# The page-table entry of a page a request gave back because no future query attends it (every
# layer slides past it): the scratch page, never allocated. Attention may still gather it (a
# padded gather over the whole table, masked): it only ever holds zeros or padded rows' finite
# keys and values, so a masked score over it is exactly zero weight, as over the padding.
FREED_PAGE = 0


def pages_behind_window(next_position: int, window: int | None, page_size: int) -> int:
    """Leading pages of a sequence that no query at next_position or later attends when every
    layer attends at most `window` positions back (keys j with p - window < j <= p): those
    whose every slot is below next_position - window + 1. 0 without a window."""
    if window is None:
        return 0
    return max(0, next_position - window + 1) // page_size


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Popping from the end hands out low page ids first, which keeps a new request's
        # pages adjacent in memory (cheaper gathers on CPU).
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def capacity(self) -> int:
        """Usable pages (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def free_pages(self) -> list[int]:
        return list(self._free)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, 0, -1))
