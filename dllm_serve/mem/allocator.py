"""`KVAllocator`: the scheduler's view of KV memory (pages) and request slots.

Invariants:
- A request holds a request slot from admission until it finishes or is aborted, and the pages
  covering [0, allocated end); page i of a request holds positions [i*page_size, (i+1)*page_size).
- page_size is a multiple of block_size, so a block never straddles two pages.
- At admission a request reserves the pages it can ever need (prompt + max_new_tokens, rounded up
  to whole blocks); pages are then taken lazily, one new block at a time, from that reservation.
  So a running request never waits for memory and admission cannot deadlock.
- An unfinished block keeps its pages across rounds: `ensure` allocates only past the end.
- `release` frees everything a request holds exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dllm_serve.mem.pools import IdPool


@dataclass
class Holding:
    """What one request holds; `slot` is None once released."""

    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages promised but not yet allocated


class KVAllocator:
    def __init__(self, num_pages: int, page_size: int, num_slots: int) -> None:
        self.page_size = page_size
        self.pages = IdPool(num_pages, "KV page")
        self.slots = IdPool(num_slots, "request slot")
        self.reserved = 0
        self.alloc_calls = 0  # number of page allocations made (tests use it)

    def pages_for(self, end: int) -> int:
        return -(-end // self.page_size)

    def available_pages(self) -> int:
        return self.pages.num_free - self.reserved

    def can_admit(self, max_end: int) -> bool:
        return self.slots.num_free > 0 and self.pages_for(max_end) <= self.available_pages()

    def admit(self, max_end: int) -> Holding:
        """Take a slot and reserve pages for positions [0, max_end)."""
        need = self.pages_for(max_end)
        if need > self.available_pages():
            raise MemoryError("not enough KV pages to admit the request")
        self.reserved += need
        return Holding(slot=self.slots.alloc(1)[0], reserved=need)

    def ensure(self, h: Holding, end: int) -> int:
        """Make h's pages cover [0, end); returns how many pages were newly allocated."""
        missing = self.pages_for(end) - len(h.pages)
        if missing <= 0:
            return 0
        if missing > h.reserved:
            raise RuntimeError(f"request needs {missing} more pages, reserved {h.reserved}")
        self.alloc_calls += 1
        h.pages.extend(self.pages.alloc(missing))
        h.reserved -= missing
        self.reserved -= missing
        return missing

    def release(self, h: Holding) -> None:
        if h.slot is None:
            return
        self.pages.free(h.pages)
        self.slots.free([h.slot])
        self.reserved -= h.reserved
        h.slot, h.pages, h.reserved = None, [], 0

    def page_array(self, h: Holding) -> np.ndarray:
        return np.asarray(h.pages, dtype=np.int64)

    def check(self, holdings: list[Holding]) -> None:
        """Integrity: every page and slot owned exactly once, reservations add up."""
        live = [h for h in holdings if h.slot is not None]
        self.pages.check([h.pages for h in live])
        self.slots.check([[h.slot] for h in live])  # type: ignore[list-item]
        total = sum(h.reserved for h in live)
        if total != self.reserved:
            raise RuntimeError(f"reserved pages {self.reserved} != sum over requests {total}")

    def stats(self) -> dict[str, int]:
        return {"total_pages": self.pages.size, "free_pages": self.pages.num_free,
                "reserved_pages": self.reserved, "total_slots": self.slots.size,
                "free_slots": self.slots.num_free}
