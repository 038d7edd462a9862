"""`KVAllocator`: the scheduler's view of KV memory (pages) and request slots, with the radix
prefix cache (mem/radix_cache.py) over committed pages.

Invariants:
- A request holds a request slot from admission until it finishes or is aborted, and a page
  table: page i holds positions [i*page_size, (i+1)*page_size). Its leading pages may be
  cached pages it shares with the tree and other requests; it only ever writes past them.
- Every page has a reference count: one per request whose table holds it, one if a tree node
  holds it. A page is free exactly when its count is 0; `release` and eviction drop counts,
  and free what reaches 0 (so nothing is freed twice or leaked).
- A request locks the tree path of its cached prefix (`Holding.node`); the tree's unlocked
  nodes are `evictable`: they can be freed at once, and count as available memory.
- At admission a request reserves the pages it can ever need beyond its cached prefix
  (prompt + max_new_tokens, whole blocks); pages are then taken lazily from that reservation.
  reserved <= free + evictable always holds, so `ensure` never fails (it evicts least recently
  used unlocked leaves when free pages run short) and a running request never waits.
- page_size is a multiple of block_size, so a block never straddles two pages.
- free + evictable + in use (by requests, or cached and locked) = total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dllm_serve.mem.pools import IdPool
from dllm_serve.mem.radix_cache import Match, Node, RadixCache


@dataclass
class Holding:
    """What one request holds; `slot` is None once released. `node`: the deepest tree node of
    its cached prefix (its path is locked), None if none; `cached`: pages of its table whose
    tokens are in the tree on that path."""

    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages promised but not yet allocated
    node: Node | None = None
    cached: int = 0


class KVAllocator:
    def __init__(self, num_pages: int, page_size: int, num_slots: int,
                 radix_cache: bool = False) -> None:
        self.page_size = page_size
        self.pages = IdPool(num_pages, "KV page")
        self.slots = IdPool(num_slots, "request slot")
        self.refs = np.zeros(num_pages, dtype=np.int64)
        self.tree = RadixCache(page_size) if radix_cache else None
        self.reserved = 0

    def pages_for(self, end: int) -> int:
        return -(-end // self.page_size)

    @property
    def evictable(self) -> int:
        return self.tree.evictable if self.tree is not None else 0

    def available_pages(self) -> int:
        """Pages a new reservation may take: free or evictable, less what is promised."""
        return self.pages.num_free + self.evictable - self.reserved

    # ---- admission --------------------------------------------------------------------------

    def match(self, tokens: np.ndarray) -> Match | None:
        """The longest cached prefix (whole pages) of a prompt; None without a cache or hit."""
        if self.tree is None:
            return None
        m = self.tree.match(tokens)
        return m if m.pages else None

    def can_admit(self, max_end: int, match: Match | None = None) -> bool:
        shared, unlocked = (len(match.pages), match.unlocked) if match else (0, 0)
        need = self.pages_for(max_end) - shared
        return self.slots.num_free > 0 and need <= self.available_pages() - unlocked

    def admit(self, max_end: int, match: Match | None = None) -> Holding:
        """Take a slot, share the matched pages (locking their path) and reserve pages for the
        rest of [0, max_end)."""
        if not self.can_admit(max_end, match):
            raise MemoryError("not enough KV pages to admit the request")
        h = Holding(slot=self.slots.alloc(1)[0])
        if match is not None:
            assert self.tree is not None
            self.tree.lock(match.node)
            h.node, h.cached, h.pages = match.node, len(match.pages), list(match.pages)
            self.refs[match.pages] += 1
        h.reserved = self.pages_for(max_end) - len(h.pages)
        self.reserved += h.reserved
        return h

    # ---- a running request ----------------------------------------------------------------

    def ensure(self, h: Holding, end: int) -> int:
        """Make h's pages cover [0, end); returns how many pages were newly allocated."""
        missing = self.pages_for(end) - len(h.pages)
        if missing <= 0:
            return 0
        if missing > h.reserved:
            raise RuntimeError(f"request needs {missing} more pages, reserved {h.reserved}")
        self._evict(missing - self.pages.num_free)
        new = self.pages.alloc(missing)
        self.refs[new] = 1
        h.pages.extend(new)
        h.reserved -= missing
        self.reserved -= missing
        return missing

    def cached_end(self, h: Holding) -> int:
        """Positions of h whose KV is in the tree (a multiple of page_size)."""
        return h.cached * self.page_size

    def cache(self, h: Holding, tokens: np.ndarray) -> None:
        """Put h's whole pages of `tokens` into the tree; tokens are h's committed tokens from
        position cached_end(h) on, whose KV is final. Where the tree has the tokens already
        (another request computed them too), an unlocked node takes h's page instead of its
        own (freed: so locking it keeps free + evictable), and a locked one keeps its page
        (h's copy stays h's own)."""
        if self.tree is None:
            return
        node = h.node or self.tree.root
        for i in range(len(tokens) // self.page_size):
            page = h.pages[h.cached]  # (locking: h locks the path to the last node below)
            node = self.tree.insert(node, self.tree.key(tokens, i), page, locking=True)
            if node.page != page and node.lock == 0:
                self._drop([self.tree.replace(node, page)])
            if node.page == page:
                self.refs[page] += 1
            h.cached += 1
        if node is not (h.node or self.tree.root):
            self.tree.lock(node)
            if h.node is not None:
                self.tree.unlock(h.node)
            h.node = node

    def release(self, h: Holding) -> None:
        """Free what h holds, exactly once: the slot, its references, its reservation."""
        if h.slot is None:
            return
        if h.node is not None:
            assert self.tree is not None
            self.tree.unlock(h.node)
        self._drop(h.pages)
        self.slots.free([h.slot])
        self.reserved -= h.reserved
        h.slot, h.pages, h.reserved, h.node, h.cached = None, [], 0, None, 0

    # ---- the cache as a whole -------------------------------------------------------------

    def flush(self) -> int:
        """Empty the tree (no request may hold a cached page); returns the pages freed."""
        if self.tree is None:
            return 0
        pages = self.tree.flush()
        self._drop(pages)
        return len(pages)

    def _evict(self, n: int) -> None:
        if n <= 0:
            return
        assert self.tree is not None, "pages short without a cache: reservations broken"
        pages = self.tree.evict(n)
        if len(pages) < n:
            raise RuntimeError(f"evicted {len(pages)} of the {n} pages needed: reserved "
                               f"{self.reserved} > free + evictable")
        self._drop(pages)

    def _drop(self, pages: list[int]) -> None:
        """Drop one reference to each page (in order; a page may appear more than once);
        free those left unreferenced. A page with no reference left to drop raises. Pages are
        few per call (one replaced cache page, a request's table): a loop over numpy scalars
        beats building an index array for np.subtract.at."""
        if not pages:
            return
        refs, freed = self.refs, []
        for p in pages:
            n = int(refs[p])
            if n <= 0:
                raise RuntimeError(f"KV page reference dropped below 0: page {p} of "
                                   f"{sorted(pages)}")
            refs[p] = n - 1
            if n == 1:
                freed.append(p)
        self.pages.free(sorted(freed))

    # ---- introspection --------------------------------------------------------------------

    def check(self, holdings: list[Holding]) -> None:
        """Integrity: every page's reference count equals its holders (request tables and tree
        nodes), a page is in use exactly when referenced, tree locks equal the requests'
        locked paths, reservations add up and fit in free + evictable."""
        live = [h for h in holdings if h.slot is not None]
        self.slots.check([[h.slot] for h in live])  # type: ignore[list-item]
        refs = np.zeros_like(self.refs)
        for h in live:
            np.add.at(refs, np.asarray(h.pages, dtype=np.int64), 1)
        if self.tree is not None:
            self._check_tree(live, refs)
        self._check_refs(refs)
        total = sum(h.reserved for h in live)
        if total != self.reserved:
            raise RuntimeError(f"reserved pages {self.reserved} != sum over requests {total}")
        if self.reserved > self.pages.num_free + self.evictable:
            raise RuntimeError(f"reserved pages {self.reserved} > free {self.pages.num_free} "
                               f"+ evictable {self.evictable}")

    def _check_tree(self, live: list[Holding], refs: np.ndarray) -> None:
        assert self.tree is not None
        locks: dict[int, int] = {}
        for h in live:
            for x in h.node.path() if h.node is not None else ():
                locks[id(x)] = locks.get(id(x), 0) + 1
        self.tree.check(locks)
        for x in self.tree.nodes():
            refs[x.page] += 1
            if x.lock == 0 and self.refs[x.page] != 1:
                raise RuntimeError(f"evictable cached page {x.page} is mapped by a request")

    def _check_refs(self, refs: np.ndarray) -> None:
        bad = np.flatnonzero(refs != self.refs)[:10]
        if len(bad):
            raise RuntimeError(f"KV page reference counts wrong for pages {bad.tolist()}: "
                               f"counted {refs[bad].tolist()}, recorded {self.refs[bad].tolist()}")
        used = set(np.flatnonzero(refs).tolist())
        if used != self.pages.in_use():
            leaked = sorted(self.pages.in_use() - used)
            stray = sorted(used - self.pages.in_use())
            raise RuntimeError(f"KV page pool inconsistent: leaked {leaked}, referenced but "
                               f"free {stray}")
        if self.pages.num_free + len(used) != self.pages.size:
            raise RuntimeError(f"KV pages: free {self.pages.num_free} + used {len(used)} != "
                               f"total {self.pages.size}")

    def stats(self) -> dict[str, int]:
        tree = self.tree
        return {"total_pages": self.pages.size, "free_pages": self.pages.num_free,
                "reserved_pages": self.reserved, "total_slots": self.slots.size,
                "free_slots": self.slots.num_free,
                "cached_pages": tree.num_pages if tree is not None else 0,
                "evictable_pages": self.evictable}
