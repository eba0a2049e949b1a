"""A request's KV pages: reserving them, sharing them through the radix prefix cache, and
giving them back.

Every page is free, privately held by one running request, or in the tree (locked by the
requests that map it, or evictable), exactly once (check()). A request's first tree_len
tokens are the tree's (locked through req.last_node); pages after them are its own.

Sliding windows (a model whose every layer attends at most `window` positions back): a running
request's leading pages that no future query attends are dropped (drop_dead_pages): its own go
back to the pool, and the tree's, locked as one path from the root, are unlocked (still cached)
once all of them are behind the window. Its held pages are then one run after FREED_PAGE entries
(req.dropped_pages), bounded by the window and the step's new tokens however long it runs. So
that the tree's share stays bounded too, a running request hands the tree at most its first
window's pages; when it ends (or is retracted) the tree gets its leading run of held pages, none
once it has dropped one: a tree path never has a hole.
"""

from __future__ import annotations

import sys

from relay.memory.kv_allocator import FREED_PAGE, PageAllocator, pages_behind_window
from relay.memory.radix_cache import RadixCache
from relay.scheduling import embedding, prompt_logprobs
from relay.scheduling.long_rope import LongRopeBoundary
from relay.scheduling.request import Req

# Radix keys of tokens whose KV rotates with LongRoPE's long factors are token id + this (token
# ids stay below 2**31): one tree, one eviction order, no match across the two rotations.
LONG_ROPE_KEY = 1 << 32


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        disable_radix_cache: bool,
        long_rope: LongRopeBoundary,
        window: int | None = None,
    ):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.cache = RadixCache(self.allocator, disabled=disable_radix_cache)
        self.long_rope = long_rope
        # The model's ModelConfig.kv_window (None: some layer reads every key, nothing drops).
        self.window = window
        # The most leading tokens a running request hands the tree (whole pages of one window).
        self.share_limit = sys.maxsize if window is None else window - window % page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def obtainable(self) -> int:
        """Pages a reservation could get now: the free ones and the evictable cached ones."""
        return self.allocator.num_free + self.cache.evictable_pages

    def reserve(self, req: Req, num_tokens: int, headroom: int = 0) -> bool:
        """Pages for req's first num_tokens tokens, leaving at least headroom obtainable; False
        (nothing taken) when that is more than there is."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if self.obtainable - need < headroom:
            return False
        pages = self.cache.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def match(self, req: Req) -> None:
        """Lock the longest cached prefix of a waiting request and adopt its pages."""
        req.long_rope = self.long_rope.past(req)
        # Match at most seq_len - 1 tokens: the last one is always computed, since its
        # logits give the next token; nor prompt positions still to score (prompt_logprobs)
        # or to pool (pooling).
        pages, node = self.cache.match_prefix(self._key(req, cache_limit(req, req.seq_len - 1)))
        self.cache.lock(node)
        req.set_pages(0, pages)
        req.last_node, req.dropped_pages = node, 0
        # A cached page's draft KV is trusted: if whoever wrote the page never ran the draft
        # over it, proposals get worse, never the output (the target verifies them).
        req.kv_len = req.tree_len = req.draft_len = len(pages) * self.page_size

    def unmatch(self, req: Req) -> None:
        """Undo match() (and any reservation after it): the request holds no KV."""
        self.allocator.free(req.pages[self._private_start(req) :])
        self.cache.unlock(req.last_node)
        req.set_pages(0, [])
        req.last_node, req.kv_len, req.tree_len, req.draft_len = None, 0, 0, 0
        req.dropped_pages = 0

    def cache_prefix(self, req: Req, final: bool = False) -> None:
        """Hand the request's computed whole pages to the radix tree and lock them there: while
        it runs at most its first share_limit tokens' (final: it ends or is retracted, all of
        them); nothing once it dropped a page (its held pages no longer start at 0)."""
        ps = self.page_size
        n = req.written_len - req.written_len % ps
        if not final:
            n = min(n, self.share_limit)
        if self.cache.disabled or req.dropped_pages or n <= req.tree_len:
            return
        tokens = self._key(req, n)
        held = self.cache.insert(tokens, req.pages[: n // ps])
        if held > req.tree_len:  # someone cached the same tokens meanwhile: use theirs
            self.allocator.free(req.pages[req.tree_len // ps : held // ps])
        pages, node = self.cache.match_prefix(tokens)
        first = req.tree_len // ps  # pages before it were the tree's already
        if pages[first:] != req.pages[first : len(pages)]:
            req.set_pages(first, pages[first:] + req.pages[len(pages) :])
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node, req.tree_len = node, n

    def release(self, req: Req) -> None:
        """Cache what req computed and give back the rest: it holds no KV after."""
        if req.last_node is None:
            return
        self.cache_prefix(req, final=True)
        self.unmatch(req)

    def drop_dead_pages(self, req: Req) -> None:
        """Give back req's leading pages that no query from its next position (kv_len: what
        steps already built compute, in flight or not, attends before it) reads again; until
        the tree has its share of req (cache_prefix), from its written position only: a page a
        step still out computes could otherwise go before that step is processed and shared,
        and what the prefix cache keeps would depend on overlap's timing. Its own
        go back to the pool; the tree's stay cached, unlocked, once every one of them is behind
        the window (the lock holds the path from the root: all of it or none). Their entries
        become FREED_PAGE, which the runner learns with req's next page update. Pages freed here
        are only reused by steps built later, which the runner runs after the ones out now."""
        shared = self.cache.disabled or req.dropped_pages or req.tree_len >= self.share_limit
        upto = req.kv_len if shared else req.written_len
        dead = pages_behind_window(upto, self.window, self.page_size)
        first = req.dropped_pages
        if dead <= first:
            return
        tree_pages = req.tree_len // self.page_size
        if tree_pages:  # (then first is 0: a request that dropped a page holds no tree path)
            if dead < tree_pages:
                return
            self.cache.unlock(req.last_node)
            req.last_node, req.tree_len = self.cache.root, 0
        self.allocator.free(req.pages[max(first, tree_pages) : dead])
        req.set_pages(first, [FREED_PAGE] * (dead - first) + req.pages[dead:])
        req.dropped_pages = dead

    def shares_up_to(self, req: Req) -> int:
        """How many leading tokens of running req the tree may still get before it ends."""
        return 0 if req.dropped_pages else self.share_limit

    def most_held_tokens(self, tokens: int, chunk: int) -> int:
        """The most KV tokens a request of `tokens` tokens holds at once, computing at most
        `chunk` per step: all of them, or under a window its share of the tree (one window,
        locked until it falls behind), the window before its next position, a step's new tokens
        and a page of rounding at each end."""
        if self.window is None:
            return tokens
        return min(tokens, self.share_limit + self.window + chunk + 2 * self.page_size)

    def trim(self, req: Req) -> None:
        """Give back the pages past req's kv_len (a rejected proposal's): they are private,
        since tree_len <= kv_len."""
        keep = self.pages_for(req.kv_len)
        self.allocator.free(req.pages[keep:])
        req.set_pages(keep, [])

    def _key(self, req: Req, n: int) -> list[int]:
        """The radix tree's key for the request's first n tokens: the tokens, moved to a range of
        their own when their KV rotates with LongRoPE's long factors (the same tokens on the short
        factors have other keys and values)."""
        tokens = req.token_slice(0, n)
        return [t + LONG_ROPE_KEY for t in tokens] if req.long_rope else tokens

    def _private_start(self, req: Req) -> int:
        """The index of req's first page of its own: after the tree's and the dropped ones."""
        return max(req.tree_len // self.page_size, req.dropped_pages)

    def locked_pages(self, running: list[Req]) -> int:
        """Pages running requests hold, privately or through the tree."""
        private = sum(len(r.pages) - self._private_start(r) for r in running)
        return private + self.cache.locked_pages

    def check(self, running: list[Req]) -> None:
        """Every page is free, privately held by one running request, or in the tree (locked
        or evictable), exactly once. Raises AssertionError otherwise."""
        ps = self.page_size
        tree = self.cache.check()
        tree_set = set(tree)
        private: list[int] = []
        for req in running:
            shared = req.pages[: req.tree_len // ps]
            assert set(shared) <= tree_set, f"request {req.rid} maps pages the tree lacks"
            dropped = req.pages[: req.dropped_pages]
            assert dropped == [FREED_PAGE] * req.dropped_pages, (
                f"request {req.rid} maps a dropped page"
            )
            assert not (dropped and shared), f"request {req.rid} locks a path it dropped"
            private.extend(req.pages[self._private_start(req) :])
        every = tree + private + self.allocator.free_pages()
        assert len(every) == len(set(every)), "a KV page is owned twice"
        assert sorted(every) == list(range(1, self.allocator.num_pages)), "a KV page is lost"
        if not running:
            assert self.cache.locked_pages == 0, "locked pages with no running request"


def cache_limit(req: Req, limit: int) -> int:
    """How many leading tokens of req the prefix cache may serve, at most limit: not the
    positions it must still compute to score (prompt logprobs) or pool (an embedding)."""
    return embedding.cache_limit(req, prompt_logprobs.cache_limit(req, limit))
