"""Unit tests for the page allocator and the radix prefix cache (pure Python, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relay.memory.kv_allocator import PageAllocator
from relay.memory.radix_cache import RadixCache


def make(
    num_pages: int = 64, page_size: int = 1, disabled: bool = False
) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc, disabled=disabled)


def put(cache: RadixCache, tokens: list[int]) -> tuple[int, list[int]]:
    """Cache `tokens` the way a request does (KVManager.cache_prefix): compute every whole
    page into fresh pages, insert, and free the duplicates of what the tree already held.
    Returns (held, the pages the tree now holds for the tokens)."""
    ps = cache.page_size
    n = len(tokens) // ps
    pages = cache.alloc(n)
    assert pages is not None, "test pool too small"
    held = cache.insert(tokens, pages)
    assert held % ps == 0
    cache.allocator.free(pages[: held // ps])
    matched, _ = cache.match_prefix(tokens)
    assert len(matched) == n
    assert matched[held // ps :] == pages[held // ps :]
    return held, matched


def all_accounted(alloc: PageAllocator, cache: RadixCache, held_by_test: list[int] = ()) -> None:
    every = cache.check() + alloc.free_pages() + list(held_by_test)
    assert sorted(every) == list(range(1, alloc.num_pages))


def tree_paths(cache: RadixCache) -> list[tuple[int, ...]]:
    """The full token sequence from the root to every node."""
    out, stack = [], [(child, child.key) for child in cache.root.children.values()]
    while stack:
        node, path = stack.pop()
        out.append(path)
        stack.extend((c, path + c.key) for c in node.children.values())
    return out


def cached_len(cache: RadixCache, tokens: list[int]) -> int:
    """Longest cached page-aligned prefix of tokens, found without touching LRU stamps."""
    ps = cache.page_size
    limit = len(tokens) - len(tokens) % ps
    best = 0
    for path in tree_paths(cache):
        n = 0
        while n < min(len(path), limit) and path[n] == tokens[n]:
            n += 1
        best = max(best, n - n % ps)
    return best


# ---- allocator --------------------------------------------------------------------------


def test_allocator_never_hands_out_page_zero_and_starts_low():
    alloc = PageAllocator(5, 4)
    assert alloc.capacity == 4 and alloc.num_free == 4
    assert alloc.alloc(0) == []
    assert alloc.alloc(2) == [1, 2]
    assert alloc.alloc(3) is None  # all or nothing
    assert alloc.num_free == 2
    assert alloc.alloc(2) == [3, 4]
    assert alloc.alloc(1) is None
    alloc.free([2, 4])
    assert sorted(alloc.alloc(2)) == [2, 4]
    alloc.reset()
    assert sorted(alloc.free_pages()) == [1, 2, 3, 4]


def test_allocator_rejects_a_pool_without_usable_pages():
    with pytest.raises(ValueError):
        PageAllocator(1, 16)


# ---- radix cache: concrete cases --------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 4])
def test_match_on_empty_tree(ps):
    alloc, cache = make(page_size=ps)
    for tokens in ([], [1], list(range(9))):
        pages, node = cache.match_prefix(tokens)
        assert pages == [] and node is cache.root
    assert cache.cached_pages == 0
    all_accounted(alloc, cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_then_match(ps):
    alloc, cache = make(page_size=ps)
    tokens = list(range(3 * ps))
    held, pages = put(cache, tokens)
    assert held == 0 and len(pages) == 3
    assert cache.match_prefix(tokens)[0] == pages
    assert cache.match_prefix(tokens + [99] * (2 * ps))[0] == pages  # longer query
    assert cache.match_prefix(tokens[: 2 * ps + ps // 2])[0] == pages[:2]  # shorter query
    assert cache.match_prefix([99] + tokens)[0] == []
    assert cache.stats().cached_pages == 3 and cache.stats().evictable_pages == 3
    all_accounted(alloc, cache)


def test_split_in_the_middle_of_an_edge_at_a_page_boundary():
    ps = 4
    alloc, cache = make(page_size=ps)
    a = list(range(12))  # one edge of 3 pages
    _, pa = put(cache, a)
    assert cache._num_nodes == 1
    # Diverges inside the third page: the shared part is 2 whole pages.
    b = a[:10] + [50, 51]
    held, pb = put(cache, b)
    assert held == 8
    assert pb[:2] == pa[:2] and pb[2] != pa[2]
    assert cache._num_nodes == 3  # [0..8) with children [8..12) and [8,9,50,51]
    upper = cache.root.children[tuple(a[:4])]
    assert upper.key == tuple(a[:8]) and upper.pages == pa[:2]
    assert set(upper.children) == {tuple(a[8:12]), tuple(b[8:12])}
    assert cache.match_prefix(a)[0] == pa
    assert cache.match_prefix(b)[0] == pb
    all_accounted(alloc, cache)


def test_match_splits_an_edge_and_returns_a_node_ending_at_the_match():
    ps = 4
    alloc, cache = make(page_size=ps)
    a = list(range(16))
    _, pa = put(cache, a)
    # Shares 6 tokens: one whole page matches, the split lands on the page boundary.
    pages, node = cache.match_prefix(a[:6] + [77] * 10)
    assert pages == pa[:1]
    assert node.key == tuple(a[:4]) and node.parent is cache.root
    assert len(node.children) == 1 and next(iter(node.children.values())).pages == pa[1:]
    cache.check()
    assert cache.match_prefix(a)[0] == pa  # the split keeps the full path intact
    all_accounted(alloc, cache)


def test_match_splits_a_locked_edge_and_keeps_its_lock():
    ps = 2
    alloc, cache = make(page_size=ps)
    a = [1, 1, 2, 2, 3, 3]
    put(cache, a)
    pages, node = cache.match_prefix(a)
    cache.lock(node)
    cache.match_prefix([1, 1, 9, 9])  # splits the locked edge
    cache.check()
    assert cache.locked_pages == 3 and cache.evictable_pages == 0
    assert cache.evict(10) == 0
    cache.unlock(node)
    cache.check()
    assert cache.locked_pages == 0 and cache.evictable_pages == 3
    assert cache.evict(10) == 3
    all_accounted(alloc, cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_partial_page_is_never_matched_or_cached(ps):
    alloc, cache = make(page_size=ps)
    tokens = list(range(2 * ps + ps - 1)) if ps > 1 else [5, 6]
    whole = len(tokens) // ps
    pages = alloc.alloc(whole + 1)  # the caller also holds the partial page
    held = cache.insert(tokens, pages)
    assert held == 0
    assert cache.cached_pages == whole  # only whole pages enter the tree
    alloc.free(pages[whole:])  # the partial page stays the caller's
    assert cache.match_prefix(tokens)[0] == pages[:whole]
    if ps > 1:
        assert cache.match_prefix(tokens[: ps - 1])[0] == []  # less than a page
        # A query whose last page is partial only matches whole pages.
        assert cache.match_prefix(tokens[: 2 * ps - 1])[0] == pages[:1]
    all_accounted(alloc, cache)


def test_insert_uses_only_as_many_tokens_as_it_gets_pages():
    ps = 4
    alloc, cache = make(page_size=ps)
    tokens = list(range(12))
    pages = alloc.alloc(2)
    assert cache.insert(tokens, pages) == 0
    assert cache.cached_pages == 2
    assert cache.match_prefix(tokens)[0] == pages
    all_accounted(alloc, cache)


def test_lock_prevents_eviction():
    alloc, cache = make(page_size=1)
    put(cache, [1, 2, 3])
    pages, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    assert cache.stats().locked_pages == 3
    assert cache.evict(100) == 0
    assert cache.alloc(alloc.num_free + 1) is None  # cannot evict locked pages to make room
    cache.lock(node)  # two holders
    cache.unlock(node)
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.evict(100) == 3
    assert cache.match_prefix([1, 2, 3])[0] == []
    all_accounted(alloc, cache)


def test_locking_a_child_pins_its_ancestors():
    ps = 2
    alloc, cache = make(page_size=ps)
    put(cache, [1, 1, 2, 2])
    put(cache, [1, 1, 2, 2, 3, 3])
    put(cache, [1, 1, 4, 4])
    _, deep = cache.match_prefix([1, 1, 2, 2, 3, 3])
    cache.lock(deep)
    assert cache.locked_pages == 3 and cache.evictable_pages == 1
    assert cache.evict(100) == 1  # only [4, 4]
    assert cache.match_prefix([1, 1, 2, 2, 3, 3])[0] != []
    cache.unlock(deep)
    assert cache.evict(100) == 3
    all_accounted(alloc, cache)


def test_unlock_of_an_unlocked_node_raises():
    _, cache = make()
    put(cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_lru_order_of_eviction():
    ps = 2
    alloc, cache = make(page_size=ps)
    seqs = {name: [i, i, i, i] for i, name in enumerate("abcd")}  # 4 disjoint leaves, 2 pages each
    for name in "abcd":
        put(cache, seqs[name])
    cache.match_prefix(seqs["a"])  # a is now the most recent
    cache.match_prefix(seqs["c"][:2])  # touches (and splits) c: its lower half keeps its old stamp

    def sizes():  # pages cached per sequence, probed without touching anything
        return {name: cached_len(cache, seq) // ps for name, seq in seqs.items()}

    assert sizes() == dict(a=2, b=2, c=2, d=2)
    steps = []
    while cache.cached_pages:
        assert cache.evict(1) >= 1  # a whole leaf goes, even if it has more pages
        cache.check()
        steps.append(sizes())
    assert steps == [
        dict(a=2, b=0, c=2, d=2),  # b: least recently used
        dict(a=2, b=0, c=1, d=2),  # c's untouched lower half
        dict(a=2, b=0, c=1, d=0),  # d
        dict(a=0, b=0, c=1, d=0),  # a (matched before c's upper half)
        dict(a=0, b=0, c=0, d=0),
    ]
    all_accounted(alloc, cache)


def test_lru_eviction_goes_least_recently_matched_leaf_first():
    alloc, cache = make(page_size=1)
    for i in range(5):
        put(cache, [i, 10 + i])
    for i in (3, 0, 4, 1, 2):  # match order, oldest first
        cache.match_prefix([i, 10 + i])
    evicted = []
    for _ in range(5):
        assert cache.evict(2) == 2
        gone = [i for i in range(5) if i not in evicted and cached_len(cache, [i, 10 + i]) == 0]
        assert len(gone) == 1
        evicted += gone
    assert evicted == [3, 0, 4, 1, 2]
    all_accounted(alloc, cache)


def test_evicting_a_leaf_makes_its_parent_evictable():
    ps = 2
    alloc, cache = make(page_size=ps)
    put(cache, [1, 1, 2, 2])
    put(cache, [1, 1, 3, 3])  # root - [1 1] - {[2 2], [3 3]}
    parent = cache.root.children[(1, 1)]
    assert len(parent.children) == 2 and not parent.is_evictable_leaf
    assert cache.evict(1) == 1  # [2 2], the older leaf
    assert cached_len(cache, [1, 1, 2, 2]) == 2 and cached_len(cache, [1, 1, 3, 3]) == 4
    assert cache.evict(1) == 1  # [3 3]
    assert parent.is_evictable_leaf
    cache.check()
    assert cache.evict(1) == 1  # now the parent itself
    assert cache.cached_pages == 0 and cache.root.children == {}
    all_accounted(alloc, cache)


def test_evict_cascades_up_a_chain_in_one_call():
    alloc, cache = make(page_size=1)
    for n in range(1, 6):  # a chain of 5 one-page nodes, built by extension
        put(cache, list(range(n)))
    put(cache, [0, 1, 9])  # a side branch
    assert cache.cached_pages == 6
    assert cache.evict(100) == 6
    assert cache.cached_pages == 0 and cache._num_nodes == 0
    all_accounted(alloc, cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_returns_the_already_held_prefix_length(ps):
    alloc, cache = make(page_size=ps)
    a = list(range(2 * ps))
    assert put(cache, a)[0] == 0
    assert put(cache, a)[0] == 2 * ps  # all duplicate
    assert put(cache, a + [50] * ps)[0] == 2 * ps  # extends
    assert put(cache, a[:ps] + [60] * ps)[0] == ps  # diverges at a page boundary
    if ps > 1:
        # Diverges inside the second page: only whole shared pages count as held.
        assert put(cache, a[: ps + 1] + [70] * (ps - 1))[0] == ps
    assert put(cache, [80] * ps)[0] == 0
    assert cache.cached_pages == (6 if ps > 1 else 5)
    all_accounted(alloc, cache)


def test_insert_with_the_matched_pages_keeps_them():
    """A request inserting pages it matched (plus new ones) gets held == matched length."""
    ps = 4
    alloc, cache = make(page_size=ps)
    _, pa = put(cache, list(range(8)))
    matched, node = cache.match_prefix(list(range(12)))
    cache.lock(node)
    fresh = cache.alloc(1)
    held = cache.insert(list(range(12)), matched + fresh)
    assert held == 8
    assert cache.match_prefix(list(range(12)))[0] == pa + fresh
    cache.unlock(node)
    all_accounted(alloc, cache)


def test_disabled_cache_matches_nothing_and_inserts_nothing():
    alloc, cache = make(num_pages=8, page_size=2, disabled=True)
    pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], pages) == 0
    assert cache.cached_pages == 0 and cache.root.children == {}
    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got == [] and node is cache.root
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(10) == 0
    assert cache.alloc(5) is not None  # allocation still works
    assert cache.alloc(1) is None
    cache.check()


def test_reset_frees_every_page():
    ps = 4
    alloc, cache = make(num_pages=32, page_size=ps)
    for i in range(5):
        put(cache, [i] * 8 + [i + 1] * 4)
    put(cache, [0] * 8 + [7] * 8)
    _, node = cache.match_prefix([1] * 8)
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()  # not while a request holds pages
    cache.unlock(node)
    assert cache.cached_pages > 0
    cache.reset()
    assert alloc.num_free == alloc.capacity
    assert cache.cached_pages == 0 and cache.locked_pages == 0 and cache._heap == []
    assert cache.match_prefix([0] * 8)[0] == []
    all_accounted(alloc, cache)
    put(cache, [3] * 8)  # usable again
    all_accounted(alloc, cache)


def test_evict_of_a_large_count_frees_only_unlocked_pages():
    ps = 2
    alloc, cache = make(num_pages=40, page_size=ps)
    _, pa = put(cache, [1] * 6)
    _, pb = put(cache, [2] * 6)
    _, pc = put(cache, [1, 1, 3, 3])  # shares a page with a
    _, node = cache.match_prefix([1] * 6)
    cache.lock(node)
    free_before = alloc.num_free
    freed = cache.evict(10**9)
    assert freed == 3 + 1  # b and c's own page; a's path is locked
    assert alloc.num_free == free_before + freed
    assert cache.match_prefix([1] * 6)[0] == pa
    assert cache.match_prefix([2] * 6)[0] == []
    assert cache.cached_pages == cache.locked_pages == 3
    cache.unlock(node)
    all_accounted(alloc, cache)


def test_alloc_evicts_only_when_the_free_list_is_short():
    alloc, cache = make(num_pages=9, page_size=1)  # 8 usable pages
    put(cache, [1, 2, 3])
    put(cache, [4, 5, 6])
    assert alloc.num_free == 2
    pages = cache.alloc(2)
    assert len(pages) == 2 and cache.cached_pages == 6  # no eviction needed
    alloc.free(pages)
    cache.match_prefix([1, 2, 3])  # [4 5 6] is now least recent
    pages = cache.alloc(4)
    assert len(pages) == 4
    assert cached_len(cache, [4, 5, 6]) == 0  # the LRU leaf went, whole
    assert len(cache.match_prefix([1, 2, 3])[0]) == 3
    all_accounted(alloc, cache, pages)
    assert cache.alloc(alloc.num_free + cache.evictable_pages + 1) is None
    all_accounted(alloc, cache, pages)


def test_evict_never_walks_the_tree(monkeypatch):
    alloc, cache = make(num_pages=200, page_size=1)
    for i in range(20):
        put(cache, [i % 4, i // 4, i])

    def no_scan():
        raise AssertionError("evict must not scan the tree")

    monkeypatch.setattr(cache, "_nodes", no_scan)
    assert cache.evict(cache.cached_pages) > 0
    assert cache.alloc(5) is not None


def test_eviction_heap_stays_bounded_under_repeated_matches():
    alloc, cache = make(num_pages=16, page_size=1)
    put(cache, [1, 2])
    put(cache, [3, 4])
    for _ in range(1000):
        cache.match_prefix([1, 2])
        cache.match_prefix([3, 4])
    assert len(cache._heap) <= 2 * cache._num_nodes + 64 + 1
    cache.check()
    assert cache.evict(1) == 2  # [3 4] was touched last, so [1 2] goes
    assert cached_len(cache, [1, 2]) == 0 and cached_len(cache, [3, 4]) == 2


# ---- radix cache: property-based --------------------------------------------------------

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=20)


class RadixMachine(RuleBasedStateMachine):
    """Random inserts, match+lock, unlock and evict against a small pool.

    `content` records the tokens each cached page holds, so a match that maps a page
    holding other tokens (a freed-and-reused page, a botched split) is caught."""

    @initialize(ps=st.sampled_from([1, 4]), num_pages=st.integers(2, 24))
    def setup(self, ps, num_pages):
        self.alloc, self.cache = make(num_pages=num_pages, page_size=ps)
        self.ps = ps
        self.locks: list[tuple[object, list[int], list[int]]] = []  # (node, pages, tokens)
        self.content: dict[int, tuple[int, ...]] = {}

    def _verify_pages(self, tokens, pages):
        for i, page in enumerate(pages):
            assert self.content[page] == tuple(tokens[i * self.ps : (i + 1) * self.ps])

    @rule(tokens=TOKENS, match_first=st.booleans())
    def insert(self, tokens, match_first):
        """Cache `tokens`, either after matching and locking its cached prefix (a request
        that reused the tree) or from scratch (one that computed everything itself)."""
        ps, cache = self.ps, self.cache
        n = len(tokens) // ps
        if match_first:
            matched, node = cache.match_prefix(tokens)
            cache.lock(node)
        else:
            matched, node = [], cache.root
        fresh = cache.alloc(n - len(matched))
        if fresh is None:
            assert n - len(matched) > self.alloc.num_free + cache.evictable_pages
            cache.unlock(node)
            return
        pages = matched + fresh
        for i in range(len(matched), n):
            self.content[pages[i]] = tuple(tokens[i * ps : (i + 1) * ps])
        expected_held = cached_len(cache, tokens)
        held = cache.insert(tokens, pages)
        assert held == expected_held
        assert held >= len(matched) * ps
        # Exactly what KVManager.cache_prefix does with the caller's duplicates.
        self.alloc.free(pages[len(matched) : held // ps])
        cache.unlock(node)
        got, _ = cache.match_prefix(tokens)
        assert len(got) == n
        assert got[held // ps :] == pages[held // ps :]
        self._verify_pages(tokens, got)

    @rule(tokens=TOKENS)
    def match_and_lock(self, tokens):
        want = cached_len(self.cache, tokens)
        pages, node = self.cache.match_prefix(tokens)
        assert len(pages) * self.ps == want
        if node is not self.cache.root:
            assert node.key == tuple(tokens[want - len(node.key) : want])
        self._verify_pages(tokens, pages)
        self.cache.lock(node)
        self.locks.append((node, pages, tokens))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, pages, tokens = self.locks.pop(i)
        # Locked pages were never evicted: the path still holds the same pages.
        assert self.cache.match_prefix(tokens[: len(pages) * self.ps])[0] == pages
        self.cache.unlock(node)

    @rule(k=st.integers(0, 30))
    def evict(self, k):
        evictable, free = self.cache.evictable_pages, self.alloc.num_free
        freed = self.cache.evict(k)
        assert freed >= min(k, evictable)
        assert freed <= evictable
        assert self.alloc.num_free == free + freed
        if k >= evictable:
            assert self.cache.evictable_pages == 0

    @rule(n=st.integers(0, 8))
    def alloc_and_free(self, n):
        avail = self.alloc.num_free + self.cache.evictable_pages
        pages = self.cache.alloc(n)
        assert (pages is None) == (n > avail)
        if pages is not None:
            assert len(pages) == n and 0 not in pages
            self.alloc.free(pages)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        tree = self.cache.check()
        every = tree + self.alloc.free_pages()
        assert sorted(every) == list(range(1, self.alloc.num_pages)), (
            "a page is lost or owned twice"
        )
        locked = {p for _, pages, _ in self.locks for p in pages}
        assert locked <= set(tree)
        assert self.cache.locked_pages >= len(locked)
        if not self.locks:
            assert self.cache.locked_pages == 0


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixMachine = RadixMachine.TestCase
