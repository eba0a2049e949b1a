"""Radix-tree prefix cache over KV pages (SGLang semantics, page-aligned).

Each edge holds a run of token ids whose length is a multiple of the page size, and the
KV pages that hold them. Running requests lock the path to their deepest node; unlocked
leaves are evicted least-recently-used first. Evictable leaves sit in a heap maintained as
nodes change state, so eviction never walks the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from relay.memory.kv_allocator import PageAllocator


class RadixNode:
    __slots__ = ("key", "pages", "parent", "children", "lock_ref", "last_access")

    def __init__(
        self,
        key: tuple[int, ...] = (),
        pages: list[int] | None = None,
        parent: RadixNode | None = None,
    ):
        self.key = key
        self.pages = pages or []
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    @property
    def is_evictable_leaf(self) -> bool:
        return not self.children and self.lock_ref == 0 and self.parent is not None

    def __lt__(self, other: RadixNode) -> bool:  # heap ties
        return id(self) < id(other)


@dataclass
class CacheStats:
    cached_pages: int  # pages held by the tree
    locked_pages: int  # of those, pages on a path some running request locks
    evictable_pages: int


class RadixCache:
    def __init__(self, allocator: PageAllocator, disabled: bool = False):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.disabled = disabled
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget everything (pages go back to the allocator); only valid with no locks."""
        if getattr(self, "root", None) is not None:
            if self.locked_pages:
                raise RuntimeError("cannot reset the prefix cache while requests hold it")
            for node in self._nodes():
                self.allocator.free(node.pages)
        self.root = RadixNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._heap: list[tuple[int, RadixNode]] = []
        self._num_nodes = 0
        self.evictable_pages = 0
        self.locked_pages = 0

    # ---- lookup and insertion -------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], RadixNode]:
        """Longest cached page-aligned prefix of `tokens`: its pages and deepest node."""
        node, pages = self.root, []
        if self.disabled:
            return pages, node
        now = next(self._clock)
        pos, limit = 0, len(tokens) - len(tokens) % self.page_size
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + self.page_size]))
            if child is None:
                break
            n = self._common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            pages.extend(child.pages)
            pos += n
            node = child
        return pages, node

    def insert(self, tokens: Sequence[int], pages: list[int]) -> int:
        """Cache pages for the page-aligned prefix of `tokens`.

        Returns how many leading tokens the tree already held; the caller's pages for
        that span are duplicates (or the very pages it matched) and stay the caller's.
        """
        if self.disabled:
            return 0
        length = min(len(tokens) - len(tokens) % self.page_size, len(pages) * self.page_size)
        node, pos, now = self.root, 0, next(self._clock)
        while pos < length:
            child = node.children.get(tuple(tokens[pos : pos + self.page_size]))
            if child is None:
                key = tuple(tokens[pos:length])
                new = RadixNode(
                    key, list(pages[pos // self.page_size : length // self.page_size]), node
                )
                node.children[key[: self.page_size]] = new
                self._num_nodes += 1
                self.evictable_pages += len(new.pages)
                self._touch(new, now)  # `node` is no leaf now: its heap entry goes stale
                return pos
            n = self._common_len(child.key, tokens, pos, length)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            pos += n
            node = child
        return pos

    # ---- locking ----------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.locked_pages -= len(node.pages)
                self._push_if_evictable(node)
            node = node.parent

    # ---- eviction ---------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, LRU first; returns pages freed."""
        freed = 0
        while freed < num_pages and self._heap:
            stamp, node = heapq.heappop(self._heap)
            if stamp != node.last_access or not node.is_evictable_leaf or node.parent is None:
                continue  # stale entry
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            self._num_nodes -= 1
            self.allocator.free(node.pages)
            self.evictable_pages -= len(node.pages)
            freed += len(node.pages)
            self._push_if_evictable(parent)
        return freed

    def alloc(self, n: int) -> list[int] | None:
        """Allocate n pages, evicting cached ones if the free list is short."""
        short = n - self.allocator.num_free
        if short > 0:
            if short > self.evictable_pages:
                return None
            self.evict(short)
        return self.allocator.alloc(n)

    # ---- introspection ----------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    def stats(self) -> CacheStats:
        return CacheStats(self.cached_pages, self.locked_pages, self.evictable_pages)

    def check(self) -> list[int]:
        """Verify the tree's bookkeeping; return every page it holds.

        Raises AssertionError on any inconsistency (used by tests and the idle check).
        """
        pages, locked, evictable, nodes = [], 0, 0, 0
        for node in self._nodes():
            nodes += 1
            assert len(node.key) == len(node.pages) * self.page_size, "key/pages length mismatch"
            assert node.key and len(node.key) % self.page_size == 0, "unaligned edge"
            assert node.parent.children.get(node.key[: self.page_size]) is node, (
                "broken parent link"
            )
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "child holds more locks than its parent"
            if node.lock_ref:
                locked += len(node.pages)
            else:
                evictable += len(node.pages)
            pages.extend(node.pages)
        assert nodes == self._num_nodes, f"node count {self._num_nodes} != {nodes}"
        assert locked == self.locked_pages, f"locked pages {self.locked_pages} != {locked}"
        assert evictable == self.evictable_pages, (
            f"evictable pages {self.evictable_pages} != {evictable}"
        )
        assert len(set(pages)) == len(pages), "a page is cached twice"
        live = {id(n) for n in self._nodes() if n.is_evictable_leaf}
        in_heap = {
            id(n) for stamp, n in self._heap if stamp == n.last_access and n.is_evictable_leaf
        }
        assert live <= in_heap, "an evictable leaf is missing from the eviction heap"
        return pages

    # ---- internals --------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _common_len(
        self, key: tuple[int, ...], tokens: Sequence[int], pos: int, end: int | None = None
    ) -> int:
        """Matched length between key and tokens[pos:], rounded down to whole pages."""
        end = len(tokens) if end is None else end
        n = min(len(key), end - pos)
        if n == len(key) and key == tuple(tokens[pos : pos + n]):
            return n  # the common case, compared in C
        i = 0
        while i < n and key[i] == tokens[pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut `child` after n tokens; returns the new upper node."""
        p = n // self.page_size
        upper = RadixNode(child.key[:n], child.pages[:p], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[upper.key[: self.page_size]] = upper
        child.key, child.pages, child.parent = child.key[n:], child.pages[p:], upper
        upper.children[child.key[: self.page_size]] = child
        self._num_nodes += 1
        return upper

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        self._push_if_evictable(node)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if node.is_evictable_leaf:
            heapq.heappush(self._heap, (node.last_access, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [(s, n) for s, n in self._heap if s == n.last_access and n.is_evictable_leaf]
        heapq.heapify(self._heap)
