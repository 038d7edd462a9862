"""Page and slot pools, and the allocator's reservation and in-place rules."""

from __future__ import annotations

import pytest

from dllm_serve.mem.allocator import KVAllocator
from dllm_serve.mem.pools import IdPool


def test_pool_alloc_free_and_double_free() -> None:
    pool = IdPool(4, "KV page")
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    pool.free(a[:1])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(MemoryError, match="out of KV pages"):
        pool.alloc(3)
    pool.check([a[1:]])
    with pytest.raises(RuntimeError, match="leaked"):
        pool.check([[1]])
    with pytest.raises(RuntimeError, match="owned twice"):
        pool.check([[1, 2], [2]])


def test_allocator_reserves_then_allocates_lazily_and_releases_once() -> None:
    alloc = KVAllocator(num_pages=8, page_size=4, num_slots=2)
    h = alloc.admit(max_end=20)  # 5 pages reserved
    assert alloc.available_pages() == 3 and not alloc.can_admit(16)
    assert alloc.ensure(h, 8) == 2 and h.pages == [0, 1]
    assert alloc.ensure(h, 8) == 0  # in place: nothing new
    assert alloc.ensure(h, 9) == 1
    alloc.check([h])
    with pytest.raises(RuntimeError, match="reserved"):
        alloc.ensure(h, 40)
    alloc.release(h)
    alloc.release(h)  # exactly once: the second call is a no-op
    assert alloc.stats()["free_pages"] == 8 and alloc.reserved == 0
    alloc.check([])
