"""Page and slot pools, and the allocator's reservation and in-place rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dllm_serve.mem.allocator import KVAllocator
from dllm_serve.mem.kv_cache import KVCache
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


def _page_table_after(device: str, writes: list[tuple[int, int, list[int]]],
                      together: bool) -> list[list[int]]:
    kv = KVCache(1, 64, 4, 1, 8, 3, 6, torch.float32, torch.device(device))
    w = [(s, f, np.asarray(p, dtype=np.int64)) for s, f, p in writes]
    if together:
        kv.map_pages_many(w)
    else:
        for write in w:
            kv.map_pages(*write)
    return kv.req_to_page.cpu().tolist()


WRITES = [(0, 0, [5, 6, 7]), (2, 1, [9]), (1, 0, [1, 2]), (0, 3, [8, 10, 11]),
          (1, 0, [40, 41, 42]), (2, 0, [3])]  # slot 1's entries 0, 1 written twice: last holds


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_page_writes_together_equal_one_by_one(device: str) -> None:
    """The worker maps an iteration's pages in one copy + scatter: the table is the one the
    writes one by one make, a repeated entry holding its last write."""
    assert (_page_table_after(device, WRITES, together=True)
            == _page_table_after(device, WRITES, together=False))
    assert _page_table_after(device, WRITES, True)[1][:3] == [40, 41, 42]
    assert (_page_table_after(device, WRITES[:1], True)
            == _page_table_after(device, WRITES[:1], False))
    distinct = [WRITES[0], WRITES[1], WRITES[2]]  # one write a slot: no entry repeats
    assert (_page_table_after(device, distinct, True)
            == _page_table_after(device, distinct, False))


def test_page_writes_past_the_table_are_refused() -> None:
    kv = KVCache(1, 64, 4, 1, 8, 2, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 5 pages"):
        kv.map_pages_many([(0, 0, np.arange(2)), (1, 2, np.arange(3))])
    assert (kv.req_to_page == -1).all()  # nothing written
