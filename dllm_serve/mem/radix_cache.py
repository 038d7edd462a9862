"""`RadixCache`: a prefix tree over committed KV pages, shared between requests.

The unit is the KV page: a page holds whole blocks, and only whole pages can be mapped into
another request's page table, so each edge of the tree is exactly one page of tokens and
nodes never split (a radix tree whose radix is the page). A node holds one page id whose KV is
the exact block-causal KV of the tokens on the path from the root to it; the tree owns that
page (one reference, counted by the allocator).

Invariants:
- `lock` counts the requests whose locked path passes through the node: a request locks the
  path root -> its deepest node, so a node's lock is >= each child's. A node with lock 0 has
  an unlocked subtree: all of it can be evicted, leaves first.
- `evictable` is the number of nodes with lock 0; `num_pages` the number of nodes (root
  excluded). Only unlocked leaves are evicted, least recently used first (`stamp`: the last
  lock, unlock or insert, from one counter).
The tree knows nothing of requests or of the page pool: the allocator (mem/allocator.py) owns
the pages, their reference counts and the locks' holders.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

Key = bytes  # one page of token ids, as int64 bytes (hashed in C, no Python ints made)
KEY_ITEM = np.dtype(np.int64).itemsize


@dataclass(eq=False, slots=True)
class Node:
    key: Key
    page: int
    parent: Node | None
    children: dict[Key, Node] = field(default_factory=dict)
    lock: int = 0
    stamp: int = 0

    @property
    def attached(self) -> bool:
        return self.parent is not None and self.parent.children.get(self.key) is self

    def path(self) -> Iterator[Node]:
        """This node and its ancestors, root excluded."""
        node: Node | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a token sequence: `pages` (in order) end at `node`;
    `unlocked` of them are not locked by anyone (locking them makes them unevictable)."""

    node: Node
    pages: list[int]
    unlocked: int


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node((), -1, None)
        self.num_pages = 0
        self.evictable = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, Node]] = []  # (stamp, tiebreak, leaf); lazily pruned
        self._tiebreak = itertools.count()

    def key(self, tokens: np.ndarray, i: int) -> Key:
        """The key of page i of `tokens` (int64: other dtypes' bytes would never match)."""
        if tokens.dtype != np.int64:
            raise TypeError(f"radix cache keys are int64 token ids, got {tokens.dtype}")
        p = self.page_size
        return tokens[i * p:(i + 1) * p].tobytes()

    def match(self, tokens: np.ndarray) -> Match:
        """The longest prefix of whole pages of `tokens` in the tree (read-only)."""
        node, pages, unlocked = self.root, [], 0
        for i in range(len(tokens) // self.page_size):
            child = node.children.get(self.key(tokens, i))
            if child is None:
                break
            node = child
            pages.append(child.page)
            unlocked += child.lock == 0
        return Match(node, pages, unlocked)

    def insert(self, parent: Node, key: Key, page: int, locking: bool = False) -> Node:
        """The child of `parent` under `key`: the existing one (its page stays, `page` is not
        taken), else a new unlocked leaf holding `page`. locking: the caller locks a path
        through the new leaf before anything can evict (mem/allocator.py's cache), so it does
        not enter the eviction heap now: its unlock pushes it, as any node's."""
        child = parent.children.get(key)
        if child is not None:
            return child
        child = Node(key, page, parent, {}, 0, next(self._clock))
        parent.children[key] = child
        self.num_pages += 1
        self.evictable += 1
        if not locking:
            self._push(child)
        return child

    def replace(self, node: Node, page: int) -> int:
        """Put `page` (the same tokens' KV) in an unlocked node; returns the page it held."""
        if node.lock:
            raise RuntimeError(f"radix cache: replacing the page of a locked node ({node.page})")
        old, node.page = node.page, page
        return old

    def lock(self, node: Node) -> None:
        """Lock the path root -> node (a request's use begins)."""
        stamp = next(self._clock)
        for x in node.path():
            self.evictable -= x.lock == 0
            x.lock += 1
            x.stamp = stamp

    def unlock(self, node: Node) -> None:
        """Undo one `lock(node)` (a request's use ends)."""
        stamp = next(self._clock)
        for x in node.path():
            if x.lock <= 0:
                raise RuntimeError(f"radix cache: unlock of an unlocked node (page {x.page})")
            x.lock -= 1
            x.stamp = stamp
            if x.lock == 0:
                self.evictable += 1
                self._push(x)

    def evict(self, n: int) -> list[int]:
        """Remove up to n unlocked leaves, least recently used first (a parent left without
        children joins the candidates); returns their pages."""
        freed: list[int] = []
        while len(freed) < n and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if stamp != node.stamp or not self._evictable_leaf(node):
                continue  # stale entry: the node was used, evicted or got children since
            freed.append(self._remove(node))
            assert node.parent is not None
            self._push(node.parent)
        self._compact()
        return freed

    def flush(self) -> list[int]:
        """Remove every node (none may be locked); returns their pages."""
        locked = [x.page for x in self.nodes() if x.lock]
        if locked:
            raise RuntimeError(f"radix cache: flush with locked pages {locked}")
        pages = [x.page for x in self.nodes()]
        self.root.children.clear()
        self.num_pages = self.evictable = 0
        self._heap.clear()
        return pages

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self, locks: dict[int, int]) -> None:
        """Integrity: each node's lock equals `locks[id(node)]` (recomputed by the caller from
        the requests' locked paths), the counters add up, each key is one page, no page twice."""
        nodes = list(self.nodes())
        for x in nodes:
            if x.lock != locks.get(id(x), 0):
                raise RuntimeError(f"radix cache: node of page {x.page} has lock {x.lock}, "
                                   f"its requests hold {locks.get(id(x), 0)}")
            if len(x.key) != self.page_size * KEY_ITEM or not x.attached:
                raise RuntimeError(f"radix cache: malformed node of page {x.page}")
        pages = [x.page for x in nodes]
        if len(set(pages)) != len(pages):
            raise RuntimeError("radix cache: a page is held by two nodes")
        unlocked = sum(x.lock == 0 for x in nodes)
        if (self.num_pages, self.evictable) != (len(nodes), unlocked):
            raise RuntimeError(f"radix cache: counters {self.num_pages} pages / "
                               f"{self.evictable} evictable, the tree has {len(nodes)} / "
                               f"{unlocked}")

    # ---- helpers --------------------------------------------------------------------------

    def _evictable_leaf(self, node: Node) -> bool:
        return node.attached and node.lock == 0 and not node.children

    def _push(self, node: Node) -> None:
        if node.parent is not None and self._evictable_leaf(node):
            heapq.heappush(self._heap, (node.stamp, next(self._tiebreak), node))

    def _remove(self, node: Node) -> int:
        assert node.parent is not None
        del node.parent.children[node.key]
        self.num_pages -= 1
        self.evictable -= 1
        return node.page

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the nodes."""
        if len(self._heap) > 2 * self.num_pages + 64:
            self._heap = [e for e in self._heap
                          if e[0] == e[2].stamp and self._evictable_leaf(e[2])]
            heapq.heapify(self._heap)
