"""Staged row writes: the inbox kernel equals its PyTorch reference, and RowStorage's staged
writes land only at the next denoise forward (the runner's hook), once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dllm_serve.dllm.algorithms import build_algorithm
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.kernels.row_inbox import (
    FRESH_STATE,
    GATE_SHIFT,
    HAS_IDS,
    MOVED,
    PAGES,
    PARAMS,
    RECORD_HEAD,
    apply_rows,
    apply_rows_reference,
    record_width,
)
from dllm_serve.managers.row_storage import PAGE_ROOM, RowStorage
from dllm_serve.mem.kv_cache import KVCache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MASK = 15


def inbox_of(records: list[tuple[int, int, int, int, int, list[int]]], capacity: int,
             k: int, gen: torch.Generator) -> torch.Tensor:
    """An inbox with these records, garbage in the unused ones (they must not be applied)."""
    width = record_width(k)
    inbox = torch.randint(0, 1000, (1 + capacity * width,), generator=gen)
    inbox[0] = len(records)
    for e, (row, req, start, seed, flags, ids) in enumerate(records):
        rec = inbox[1 + e * width:1 + (e + 1) * width]
        rec[:RECORD_HEAD] = torch.tensor([row, req, start, seed, flags])
        rec[RECORD_HEAD:] = torch.tensor(ids)
    return inbox.to(DEVICE)


@pytest.mark.parametrize("count", [0, 1, 5, 21])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_apply_rows_equals_reference(count: int, gated: bool, paged: bool) -> None:
    """Rows in the count get their metadata, their ids where HAS_IDS is set and their source
    row's ids where MOVED is (sources: rows no record writes); a PARAMS record writes its
    request key's params and no row; records past the count and every other row and key stay;
    the count is zeroed. 21 records: two inner steps. gated: a HAS_IDS row also gets its
    record's gate (the bits from GATE_SHIFT on) and flags 0, a MOVED row its source's gate and
    flags. paged: every fifth record is a PAGES record instead (page-table entries [start,
    start + seed) of slot `row` := its first seed values, 0 <= seed <= K), which writes no
    row, and the rest of the page table stays."""
    gen = torch.Generator().manual_seed(count)
    capacity, k, slots, entries = 24, 6, 5, 16
    order = torch.randperm(capacity, generator=gen).tolist()
    rows, sources = order[:count], order[count:]
    flags = (0, HAS_IDS, MOVED, PARAMS)
    values = np.array([[0.25 * i, -1.5 - i] for i in range(count)], dtype=np.float32)
    bits = values.view(np.int32).astype(np.int64).tolist()

    def fields(i: int, r: int) -> list[int]:
        if i % 4 == 3:
            return bits[i] + [0] * (k - 2)
        return ([sources[i % len(sources)]] * (i % 4 == 2) + [r * 10 + j for j in range(k)])[:k]

    def page_record(i: int) -> tuple[int, int, int, int, int, list[int]]:
        """Slot i // 5 (one per record), entries from i // 5 % 3 + 2, i % 7 of them."""
        slot, first, n = i // 5, i // 5 % 3 + 2, min(i % 7, k)
        return (slot, 0, first, n, PAGES, [1000 + 10 * i + j for j in range(k)])

    gate_bits = [(i % 3) << GATE_SHIFT if flags[i % 4] == HAS_IDS else 0 for i in range(count)]
    records = [page_record(i) if paged and i % 5 == 4 else
               (i if i % 4 == 3 else r, i, 100 + i, 7 * i, flags[i % 4] | gate_bits[i],
                fields(i, r)) for i, r in enumerate(rows)]
    inbox = inbox_of(records, capacity, k, gen)
    ids = torch.randint(0, 50, (capacity + 1, k), generator=gen).to(DEVICE)
    meta = torch.randint(0, 50, (3, capacity + 1), generator=gen).to(DEVICE)
    params = torch.rand(2, capacity + 1, generator=gen).to(DEVICE)
    gates = torch.randint(1, 4, (capacity + 1, 2), generator=gen).to(DEVICE) if gated else None
    table = (torch.randint(0, 50, (slots, entries), generator=gen).to(DEVICE) if paged
             else None)
    want_ids, want_meta, want_params = ids.clone(), meta.clone(), params.clone()
    want_gates = None if gates is None else gates.clone()
    want_table = None if table is None else table.clone()
    for i, (row, req, start, seed, flag, row_ids) in enumerate(records):
        if flag & PARAMS:
            want_params[:, row] = torch.from_numpy(values[i])
            continue
        if flag & PAGES:
            assert want_table is not None
            want_table[row, start:start + seed] = torch.tensor(row_ids[:seed])
            continue
        want_meta[:, row] = torch.tensor([req, start, seed])
        if flag & HAS_IDS:
            want_ids[row] = torch.tensor(row_ids)
            if want_gates is not None:
                want_gates[row] = torch.tensor([flag >> GATE_SHIFT, 0])
        if flag & MOVED:
            want_ids[row] = ids[row_ids[0]]
            if want_gates is not None and gates is not None:
                want_gates[row] = gates[row_ids[0]]
    ref = (inbox.clone(), ids.clone(), meta.clone(), params.clone(),
           None if gates is None else gates.clone(), None if table is None else table.clone())
    apply_rows_reference(*ref)
    apply_rows(inbox, ids, meta, params, gates, table)
    for got in ((ids, meta, params, gates, table), ref[1:]):  # the scratch row / key / entry
        assert torch.equal(got[0][:capacity], want_ids[:capacity])  # (last): anything
        assert torch.equal(got[1][:, :capacity], want_meta[:, :capacity])
        assert torch.equal(got[2][:, :capacity], want_params[:, :capacity])
        if want_gates is not None:
            assert torch.equal(got[3][:capacity], want_gates[:capacity])
        if want_table is not None:
            assert got[4] is not None
            assert torch.equal(got[4].view(-1)[:-1], want_table.view(-1)[:-1])
    assert int(inbox[0]) == 0 and int(ref[0][0]) == 0
    assert torch.equal(inbox[1:], ref[0][1:])


def storage(algorithm: str) -> RowStorage:
    cfg = DllmConfig(algorithm=algorithm, block_size=4, mask_id=MASK)
    return RowStorage(build_algorithm(cfg), 8, 4, DEVICE, free_key=8)


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_staged_rows_land_at_the_next_forward_with_fresh_state(algorithm: str) -> None:
    """write_rows changes nothing on the device until flush + apply_staged (the runner's hook
    before a forward); then the rows hold their ids, metadata and the algorithm's fresh state,
    and a second apply (a forward with nothing staged) changes nothing."""
    s = storage(algorithm)
    if s.state is not None:
        for v in s.state.values():
            v.fill_(1)
    before_ids = s.ids.clone()
    ids = np.array([[1, MASK, MASK, 2], [MASK] * 4], dtype=np.int64)
    s.write_rows(np.array([5, 2]), ids, [None, None], np.array([64, 96]), np.array([1, 0]),
                 np.array([11, 12]))
    assert torch.equal(s.ids, before_ids)
    s.flush()
    s.apply_staged()
    assert s.ids[5].tolist() == ids[0].tolist() and s.ids[2].tolist() == ids[1].tolist()
    assert s.row_req[[5, 2]].tolist() == [1, 0] and s.row_start[[5, 2]].tolist() == [64, 96]
    assert s.row_seed[[5, 2]].tolist() == [11, 12]
    assert torch.equal(s.ids[[0, 1, 3, 4, 6, 7]], before_ids[[0, 1, 3, 4, 6, 7]])
    if s.state is not None:
        fresh = s.algo.init_step_state(torch.as_tensor(ids, device=DEVICE))
        for key, v in s.state.items():
            assert torch.equal(v[[5, 2]], fresh[key]), key
            assert (v[[0, 1, 3, 4, 6, 7]] == 1).all(), key  # other rows untouched
    snapshot = s.ids.clone()
    s.ids[5, 0] = 9  # as a step would edit it
    s.apply_staged()
    assert s.ids[5, 0] == 9 and torch.equal(s.ids[2], snapshot[2])


def test_metadata_only_rows_keep_ids_and_a_resumed_block_keeps_its_state() -> None:
    """ids None (a new hole's row): only metadata is written. A block that brings its own
    state (a preempted block resumed) keeps it; the fresh state goes to the others."""
    s = storage("JointThreshold")
    assert s.state is not None
    s.ids[3] = 7
    s.write_rows(np.array([3]), None, None, np.array([32]), np.array([2]), np.array([5]))
    s.flush()
    s.apply_staged()
    assert s.ids[3].tolist() == [7] * 4 and int(s.row_start[3]) == 32
    own = {key: (~v[0] if v.dtype == torch.bool else v[0] + 3).cpu().numpy()
           for key, v in s.algo.init_step_state(torch.full((1, 4), MASK, device=DEVICE)).items()}
    ids = np.full((2, 4), MASK, dtype=np.int64)
    s.write_rows(np.array([1, 4]), ids, [own, None], np.array([0, 4]), np.array([0, 1]),
                 np.array([0, 0]))
    s.flush()
    s.apply_staged()
    for key, v in s.state.items():
        assert v[1].cpu().numpy().tolist() == np.asarray(own[key]).tolist(), key
    fresh = s.algo.init_step_state(torch.as_tensor(ids[1:], device=DEVICE))
    for key, v in s.state.items():
        assert torch.equal(v[4:5], fresh[key]), key
    assert FRESH_STATE & HAS_IDS == 0


def test_moved_rows_take_their_sources_ids_and_state() -> None:
    """A move (sources given): at the next forward the target rows hold their sources' ids and
    algorithm state as they were, with the metadata staged for them; the sources' metadata
    can be freed by the same write (a hole's record) and nothing else changes."""
    s = storage("JointThreshold")
    assert s.state is not None
    gen = torch.Generator().manual_seed(0)
    s.ids.copy_(torch.randint(0, 15, s.ids.shape, generator=gen).to(DEVICE))
    for v in s.state.values():
        v.copy_(torch.randint(0, 2, v.shape, generator=gen).to(DEVICE).to(v.dtype))
    ids_before = s.ids.clone()
    state_before = {key: v.clone() for key, v in s.state.items()}
    at, sources = np.array([1, 2, 6, 7]), np.array([6, 7])
    s.write_rows(at, None, None, np.array([8, 12, 0, 0]), np.array([3, 4, 8, 8]),
                 np.array([5, 6, 0, 0]), sources=sources)
    assert torch.equal(s.ids, ids_before)
    s.flush()
    s.apply_staged()
    assert torch.equal(s.ids[[1, 2]], ids_before[[6, 7]])
    assert torch.equal(s.ids[[0, 3, 4, 5, 6, 7]], ids_before[[0, 3, 4, 5, 6, 7]])
    for key, v in s.state.items():
        assert torch.equal(v[[1, 2]], state_before[key][[6, 7]]), key
        assert torch.equal(v[[0, 3, 4, 5, 6, 7]], state_before[key][[0, 3, 4, 5, 6, 7]]), key
    assert s.row_req.tolist()[:8] == [8, 3, 4, 8, 8, 8, 8, 8]
    assert s.row_start[[1, 2]].tolist() == [8, 12] and s.row_seed[[1, 2]].tolist() == [5, 6]


def test_staged_params_land_with_the_rows() -> None:
    """write_params after write_rows: both land at the next forward (flush + apply_staged),
    the other keys keep their values."""
    s = storage("JointThreshold")
    before = s.params.clone()
    s.write_rows(np.array([0]), np.full((1, 4), MASK), [None], np.array([0]), np.array([3]),
                 np.array([1]))
    s.write_params(np.array([3, 5]), np.array([[0.5, 0.75], [0.125, 0.0]], dtype=np.float32))
    assert torch.equal(s.params, before)
    s.flush()
    s.apply_staged()
    assert s.req_params["threshold"][[3, 5]].tolist() == [0.5, 0.75]
    assert s.req_params["edit_threshold"][[3, 5]].tolist() == [0.125, 0.0]
    keep = [i for i in range(s.params.shape[1] - 1) if i not in (3, 5)]
    assert torch.equal(s.params[:, keep], before[:, keep]) and int(s.row_req[0]) == 3


def paged_storage(slots: int = 6, entries: int = 12) -> tuple[RowStorage, KVCache]:
    """A storage of 8 rows (K = 4) writing the page table of a KV cache of `slots` request
    slots (the last: the scratch slot)."""
    kv = KVCache(1, 64, 4, 1, 2, slots, entries, torch.float32, DEVICE)
    cfg = DllmConfig(algorithm="JointThreshold", block_size=4, mask_id=MASK)
    return RowStorage(build_algorithm(cfg), 8, 4, DEVICE, free_key=slots - 1,
                      page_table=kv.req_to_page), kv


def test_staged_pages_land_with_the_next_forward_in_order() -> None:
    """stage_pages changes nothing until flush + apply_staged (a denoise forward's hook); then
    the page table is what the same writes give one by one (`KVCache.map_pages`), writes
    longer than K pages spanning several records. A slot written twice (a released slot mapped
    again, an overlapping top-up), within one call or with one staged before, is declined:
    the caller's path (apply what is staged, then `map_pages_many`) keeps the writes in order,
    the later one holding. Staged with rows, both land together; the rows keep their own
    values."""
    s, kv = paged_storage()
    _, ref = paged_storage()
    writes = [(0, 0, np.arange(10, 19)), (2, 3, np.array([7, 8])), (0, 6, np.array([30, 31])),
              (1, 0, np.array([5])), (2, 0, np.array([40, 41, 42, 43, 44])), (0, 11, np.array([9]))]
    for w in writes:
        ref.map_pages(*w)
    before = kv.req_to_page.clone()
    s.write_rows(np.array([1]), np.full((1, 4), 3), [None], np.array([8]), np.array([2]),
                 np.array([5]))
    assert s.stage_pages(writes[:2]) and s.stage_pages(writes[3:4])  # slots 0, 2, 1
    assert not s.stage_pages(writes[2:3])  # slot 0 again: declined, nothing staged
    assert not s.stage_pages([(3, 0, np.array([1])), (3, 2, np.array([2]))])
    assert torch.equal(kv.req_to_page, before)
    s.flush()
    assert torch.equal(kv.req_to_page, before)  # sent, applied by the forward's hook
    s.apply_staged()
    assert s.ids[1].tolist() == [3] * 4 and int(s.row_req[1]) == 2 and int(s.row_start[1]) == 8
    s.apply_pages()  # the caller's path for the declined writes (nothing left to apply)
    kv.map_pages_many([writes[2], *writes[4:]])
    assert torch.equal(kv.req_to_page[:-1], ref.req_to_page[:-1])
    s.apply_staged()  # nothing staged: nothing changes
    assert torch.equal(kv.req_to_page[:-1], ref.req_to_page[:-1])


def test_apply_pages_lands_at_once_and_a_full_inbox_declines() -> None:
    """apply_pages (before a prefill or a write of the caller's own) applies what is staged
    now; with nothing staged it sends nothing. stage_pages declines (False, nothing staged)
    what would pass the inbox's PAGE_ROOM records a row, or everything without a page table."""
    s, kv = paged_storage(slots=8)
    s.apply_pages()
    assert not s.sent
    assert s.stage_pages([(3, 2, np.array([11, 12]))])
    s.apply_pages()
    assert kv.req_to_page[3, 2:4].tolist() == [11, 12] and not s.page_writes
    assert PAGE_ROOM * s.capacity == 16  # records of K = 4 pages
    assert s.stage_pages([(slot, 0, np.arange(12) + slot) for slot in range(5)])  # 15
    assert s.stage_pages([(5, 0, np.array([7]))])  # 16
    assert not s.stage_pages([(6, 0, np.array([7]))])
    s.apply_pages()
    assert kv.req_to_page[0, :12].tolist() == list(range(12))
    assert kv.req_to_page[5, 0] == 7 and kv.req_to_page[6, 0] == -1
    assert kv.req_to_page[4, :12].tolist() == list(range(4, 16))
    with pytest.raises(ValueError, match="12"):  # past the table, as KVCache.map_pages
        s.stage_pages([(2, 10, np.arange(3))])
    plain = storage("JointThreshold")
    assert not plain.stage_pages([(0, 0, np.arange(2))])
