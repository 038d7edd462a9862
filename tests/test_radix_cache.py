"""The radix prefix cache and the allocator's page references: unit tests, and a randomized
state machine (hypothesis) that drives the allocator against a plain dict model of the tree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dllm_serve.mem.allocator import Holding, KVAllocator
from dllm_serve.mem.radix_cache import RadixCache

P = 2  # page size of the randomized test


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def key(*tokens: int) -> bytes:
    """A page's key in the tree: its int64 ids' bytes."""
    return ids(*tokens).tobytes()


def test_match_takes_whole_pages_only() -> None:
    tree = RadixCache(page_size=2)
    a = tree.insert(tree.root, key(1, 2), page=7)
    tree.insert(a, key(3, 4), page=8)
    assert tree.match(ids(1, 2, 3, 4, 5)).pages == [7, 8]
    assert tree.match(ids(1, 2, 3)).pages == [7]  # (3,) is not a whole page
    assert tree.match(ids(1, 2, 3, 5)).pages == [7]
    assert tree.match(ids(2, 2)).pages == [] and tree.match(ids(1, 2)).node is a
    assert tree.insert(tree.root, key(1, 2), page=9) is a and a.page == 7  # existing: kept


def test_locked_paths_are_not_evicted_and_lru_leaves_go_first() -> None:
    tree = RadixCache(page_size=1)
    a = tree.insert(tree.root, key(1), 0)
    b = tree.insert(a, key(2), 1)
    c = tree.insert(tree.root, key(3), 2)
    d = tree.insert(c, key(4), 3)
    tree.lock(b)
    assert tree.evictable == 2  # c, d
    tree.lock(d)
    tree.unlock(d)  # d, c used after a, b: but a, b are locked
    assert tree.evict(1) == [3] and tree.evict(5) == [2]  # the leaf, then its parent
    assert tree.evict(1) == [] and tree.num_pages == 2
    tree.unlock(b)
    assert tree.evict(5) == [1, 0] and tree.num_pages == 0 == tree.evictable
    with pytest.raises(RuntimeError, match="unlock of an unlocked"):
        tree.unlock(a)


def test_lru_order_follows_the_last_use() -> None:
    tree = RadixCache(page_size=1)
    leaves = [tree.insert(tree.root, key(t), t) for t in range(4)]
    for t in (2, 0, 3):  # used in this order; 1 never
        tree.lock(leaves[t])
        tree.unlock(leaves[t])
    assert tree.evict(4) == [1, 2, 0, 3]


def test_allocator_shares_a_prefix_and_counts_references() -> None:
    alloc = KVAllocator(num_pages=8, page_size=2, num_slots=4, radix_cache=True)
    prompt = ids(1, 2, 3, 4, 5)
    a = alloc.admit(max_end=8)  # 4 pages reserved
    alloc.ensure(a, 8)
    alloc.cache(a, prompt[:4])  # two whole pages
    assert a.cached == 2 and alloc.stats()["cached_pages"] == 2
    m = alloc.match(prompt)
    assert m is not None and m.pages == a.pages[:2] and m.unlocked == 0
    b = alloc.admit(max_end=6, match=m)  # 3 pages: 2 shared, 1 reserved
    assert b.pages == a.pages[:2] and b.reserved == 1 and alloc.cached_end(b) == 4
    assert alloc.refs[a.pages[:2]].tolist() == [3, 3]  # a, b and the tree
    alloc.check([a, b])
    alloc.release(a)
    assert alloc.evictable == 0  # b still locks the path
    alloc.check([b])
    alloc.release(b)
    s = alloc.stats()
    assert s["evictable_pages"] == 2 and s["free_pages"] == 6 and alloc.reserved == 0
    alloc.check([])
    assert alloc.flush() == 2 and alloc.stats()["free_pages"] == 8
    alloc.check([])


def test_a_page_cached_twice_stays_private_and_the_tree_keeps_one() -> None:
    alloc = KVAllocator(num_pages=8, page_size=2, num_slots=4, radix_cache=True)
    tokens = ids(1, 2, 3, 4)
    a, b = alloc.admit(4), alloc.admit(4)  # both missed: computed the same prompt
    alloc.ensure(a, 4)
    alloc.ensure(b, 4)
    alloc.cache(a, tokens)
    alloc.cache(b, tokens)
    assert alloc.stats()["cached_pages"] == 2 and b.cached == 2
    assert alloc.refs[b.pages].tolist() == [1, 1]  # b's own copies
    alloc.check([a, b])
    alloc.release(b)
    assert alloc.stats()["free_pages"] == 6  # b's copies freed; a's pages are the tree's
    alloc.release(a)
    alloc.check([])
    assert alloc.stats()["free_pages"] == 6 and alloc.evictable == 2


def test_an_unused_cached_page_is_replaced_by_a_new_copy() -> None:
    """Locking an unlocked node would take an evictable page from admission's count: the node
    takes the new copy instead and its old page is freed (free + evictable unchanged)."""
    alloc = KVAllocator(num_pages=4, page_size=1, num_slots=2, radix_cache=True)
    a, b = alloc.admit(1), alloc.admit(2)
    alloc.ensure(a, 1)
    alloc.ensure(b, 1)
    alloc.cache(a, ids(5))
    alloc.release(a)
    before = alloc.available_pages()
    alloc.cache(b, ids(5))
    m = alloc.match(ids(5))
    assert m is not None and m.pages == b.pages and m.unlocked == 0
    assert alloc.stats()["free_pages"] == 3 and alloc.available_pages() == before
    alloc.check([b])


def test_admission_counts_evictable_pages_and_eviction_makes_room() -> None:
    alloc = KVAllocator(num_pages=4, page_size=1, num_slots=4, radix_cache=True)
    a = alloc.admit(4)
    alloc.ensure(a, 4)
    alloc.cache(a, ids(1, 2, 3, 4))
    alloc.release(a)
    assert alloc.stats()["free_pages"] == 0 and alloc.available_pages() == 4
    m = alloc.match(ids(1, 2, 9))
    assert m is not None and m.unlocked == 2
    assert not alloc.can_admit(5, m)  # 2 shared + 3 new > 4 pages
    b = alloc.admit(4, m)  # 2 shared (locked now) + 2 new: the unlocked leaves go
    assert alloc.available_pages() == 0
    alloc.ensure(b, 4)
    assert alloc.stats()["cached_pages"] == 2 and alloc.stats()["free_pages"] == 0
    alloc.check([b])
    with pytest.raises(RuntimeError, match="flush with locked"):
        alloc.flush()


def test_without_the_cache_nothing_is_matched_or_kept() -> None:
    alloc = KVAllocator(num_pages=4, page_size=1, num_slots=2)
    a = alloc.admit(2)
    alloc.ensure(a, 2)
    alloc.cache(a, ids(1, 2))
    assert alloc.match(ids(1, 2)) is None and alloc.flush() == 0
    alloc.release(a)
    assert alloc.stats()["free_pages"] == 4
    alloc.check([])


def test_check_catches_a_wrong_reference_count() -> None:
    alloc = KVAllocator(num_pages=4, page_size=1, num_slots=2, radix_cache=True)
    a = alloc.admit(2)
    alloc.ensure(a, 2)
    alloc.cache(a, ids(1, 2))
    alloc.refs[a.pages[0]] += 1
    with pytest.raises(RuntimeError, match="reference counts wrong"):
        alloc.check([a])


# ---- randomized: the allocator against a plain dict model ------------------------------------


class Model:
    """The cache as a dict: token prefix (whole pages) -> [page, lock, stamp]; stamps follow
    the same events as the tree (each lock, unlock and insert is one tick)."""

    def __init__(self, pages: int) -> None:
        self.nodes: dict[tuple[int, ...], list[int]] = {}
        self.free = pages
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def path(self, prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [prefix[:i] for i in range(P, len(prefix) + 1, P)]

    def match(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        prefix: tuple[int, ...] = ()
        while len(prefix) + P <= len(tokens) and tokens[:len(prefix) + P] in self.nodes:
            prefix = tokens[:len(prefix) + P]
        return prefix

    def lock(self, prefix: tuple[int, ...], delta: int) -> None:
        t = self.tick()
        for p in self.path(prefix):
            self.nodes[p][1] += delta
            self.nodes[p][2] = t

    def evictable(self) -> int:
        return sum(n[1] == 0 for n in self.nodes.values())

    def leaves(self) -> list[tuple[int, ...]]:
        inner = {p[:-P] for p in self.nodes}
        return [p for p, n in self.nodes.items() if n[1] == 0 and p not in inner]

    def evict(self, n: int) -> None:
        for _ in range(n):
            victim = min(self.leaves(), key=lambda p: self.nodes[p][2])
            del self.nodes[victim]
            self.free += 1


class Req:
    def __init__(self, tokens: tuple[int, ...], h: Holding, locked: tuple[int, ...]) -> None:
        self.tokens, self.h, self.locked = tokens, h, locked


PAGES_OF_TOKENS = st.lists(st.sampled_from([(0, 0), (0, 1), (1, 1)]), min_size=1, max_size=5)


class CacheMachine(RuleBasedStateMachine):
    PAGES, SLOTS = 8, 3

    def __init__(self) -> None:
        super().__init__()
        self.alloc = KVAllocator(self.PAGES, P, self.SLOTS, radix_cache=True)
        self.model = Model(self.PAGES)
        self.reqs: list[Req] = []
        self.reserved = 0

    @rule(pages=PAGES_OF_TOKENS, tail=st.integers(0, P - 1))
    def admit(self, pages: list[tuple[int, int]], tail: int) -> None:
        self._admit(pages, tail)

    def _admit(self, pages: list[tuple[int, int]], tail: int) -> Req | None:
        tokens = tuple(t for p in pages for t in p)
        prompt = np.array(tokens[:len(tokens) - tail], dtype=np.int64)
        m, prefix = self.alloc.match(prompt), self.model.match(tuple(prompt.tolist()))
        assert (m.pages if m else []) == [self.model.nodes[p][0]
                                         for p in self.model.path(prefix)]
        unlocked = sum(self.model.nodes[p][1] == 0 for p in self.model.path(prefix))
        need = len(pages) - len(prefix) // P
        fits = (len(self.reqs) < self.SLOTS
                and need <= self.model.free + self.model.evictable() - self.reserved - unlocked)
        assert self.alloc.can_admit(len(tokens), m) == fits
        if not fits:
            return None
        h = self.alloc.admit(len(tokens), m)
        if prefix:
            self.model.lock(prefix, +1)
        self.reserved += need
        self.reqs.append(Req(tokens, h, prefix))
        return self.reqs[-1]

    @rule(pages=PAGES_OF_TOKENS)
    def whole_request(self, pages: list[tuple[int, int]]) -> None:
        """Admit, run and finish a request at once (fills the cache: evictions follow)."""
        r = self._admit(pages, 0)
        if r is not None:
            self._grow(r, r.h.reserved)
            self._commit(r, len(r.h.pages))
            self._release(r)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.reqs))
        self._grow(r, data.draw(st.integers(0, r.h.reserved)))

    def _grow(self, r: Req, n: int) -> None:
        if n == 0:
            return
        short = n - self.model.free
        if short > 0:
            self.model.evict(short)
        self.alloc.ensure(r.h, (len(r.h.pages) + n) * P)
        self.model.free -= n
        self.reserved -= n

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.reqs))
        self._commit(r, data.draw(st.integers(r.h.cached, len(r.h.pages))))

    def _commit(self, r: Req, end: int) -> None:
        start = r.h.cached
        if end == start:
            return
        self.alloc.cache(r.h, np.array(r.tokens[start * P:end * P], dtype=np.int64))
        for i in range(start, end):
            prefix = r.tokens[:(i + 1) * P]
            if prefix not in self.model.nodes:
                self.model.nodes[prefix] = [r.h.pages[i], 0, self.model.tick()]
            elif self.model.nodes[prefix][1] == 0:  # unused: takes r's page, frees its own
                self.model.nodes[prefix][0] = r.h.pages[i]
                self.model.free += 1
        new = r.tokens[:end * P]
        self.model.lock(new, +1)
        if r.locked:
            self.model.lock(r.locked, -1)
        r.locked = new

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._release(data.draw(st.sampled_from(self.reqs)))

    def _release(self, r: Req) -> None:
        self.reqs.remove(r)
        own = [p for i, p in enumerate(r.h.pages)
               if self.model.nodes.get(r.tokens[:(i + 1) * P], [None])[0] != p]
        self.reserved -= r.h.reserved
        self.alloc.release(r.h)
        if r.locked:
            self.model.lock(r.locked, -1)
        self.model.free += len(own)

    @precondition(lambda self: not self.reqs)
    @rule()
    def flush(self) -> None:
        assert self.alloc.flush() == len(self.model.nodes)
        self.model.free += len(self.model.nodes)
        self.model.nodes.clear()

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.alloc.check([r.h for r in self.reqs])
        tree = self.alloc.tree
        assert tree is not None
        assert tree_dict(tree) == {p: n[0] for p, n in self.model.nodes.items()}
        assert {p: (n.lock, n.stamp) for p, n in tree_nodes(tree).items()} == {
            p: (n[1], n[2]) for p, n in self.model.nodes.items()}
        s = self.alloc.stats()
        assert s["free_pages"] == self.model.free and self.alloc.reserved == self.reserved
        in_use = s["total_pages"] - s["free_pages"] - s["evictable_pages"]
        assert s["free_pages"] + s["evictable_pages"] + in_use == self.PAGES
        assert s["evictable_pages"] == self.model.evictable()


def tree_nodes(tree: RadixCache) -> dict[tuple[int, ...], object]:
    out, stack = {}, [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for raw, child in node.children.items():
            path = prefix + tuple(np.frombuffer(raw, dtype=np.int64).tolist())
            out[path] = child
            stack.append((path, child))
    return out


def tree_dict(tree: RadixCache) -> dict[tuple[int, ...], int]:
    return {p: n.page for p, n in tree_nodes(tree).items()}  # type: ignore[attr-defined]


CacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                          deadline=None)
test_cache_against_a_dict_model = CacheMachine.TestCase
