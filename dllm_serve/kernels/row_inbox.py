"""Staged row writes of the worker's row storage, applied on the device in one launch.

The resident batch changes a few rows per forward (a block opens where one retired, a request
takes a hole). Instead of several host-issued copies and scatters per change, the host packs
the changed rows into an *inbox* (one int64 buffer, one message: on CUDA fetched by the
forward's graph from pinned memory, kernels/host_copy.py; on the CPU a copy) and the forward's
CUDA graph applies it first thing (managers/row_storage.py).

Inbox layout: [count, record 0, record 1, ...], each record RECORD_HEAD + K int64 values:
  row, request, start, seed, flags, ids[K]
flags: HAS_IDS (the record carries the block's ids), FRESH_STATE (the algorithm's fresh state
is due for the row; applied by RowStorage, not here), MOVED (the row takes the block of row
ids[0], the *source*: a layout that closes its holes moves its last rows into them; its state
is moved by RowStorage, in the same forward), PARAMS
(not a row: the per-request params of request key `row` are ids[0:P], each a float32's bits as
a signed int32; the record's other fields are unused), PAGES (not a row: page-table entries
[start, start + seed) of request slot `row` := ids[0:seed], seed <= K; request unused: the
scheduler's page mappings, riding the same message as the rows); bits from GATE_SHIFT on: the
flags of its predecessor that open a HAS_IDS row that waits for it (its gate).
`apply_rows`: for each of the first `count` records rows_meta[:, row] = (request, start, seed),
with HAS_IDS ids[row] = the record's ids (and, on gated storage, gates[row] = (its gate, flags
0)), with MOVED ids[row] = ids[source] (gates[row] = gates[source]), with PARAMS params[:, row]
= the values instead, with PAGES the page-table entries instead; then count = 0, so a replay
with nothing staged does nothing. Invariants (the caller's): no source row is
written (with ids, or as a move's target) by the same inbox, and no page-table entry by two of
its records, so records apply in any order.
Oracle: `apply_rows_reference` (the CPU path), which needs a scratch row: the last row of ids
and rows_meta, the last column of params, and the last entry of the page table's last row (the
runner's scratch slot, whose one mapped page is its first entry) take the unused records'
writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import check_device, next_pow2

RECORD_HEAD = 5  # row, request, start, seed, flags
HAS_IDS = 1
FRESH_STATE = 2
MOVED = 4
PARAMS = 8
PAGES = 16
GATE_SHIFT = 5  # flags >> GATE_SHIFT: a new row's gate
BLOCK_R = 16  # records per inner step


def record_width(block_size: int) -> int:
    return RECORD_HEAD + block_size


def apply_rows(inbox: torch.Tensor, ids: torch.Tensor, rows_meta: torch.Tensor,
               params: torch.Tensor, gates: torch.Tensor | None = None,
               pages: torch.Tensor | None = None) -> None:
    """inbox (1 + M * (RECORD_HEAD + K),) int64, ids (rows, K) int64 contiguous, rows_meta
    (3, rows) int64 and params (P, keys) float32 (P <= K), both with unit stride along their
    last dim, gates (rows, 2) int64 contiguous (gate, flags) or None, pages (slots, entries)
    int64 with unit stride along its last dim (the page table; PAGES records need it) or None:
    apply the staged records, zero the count."""
    check_device(inbox, "apply_rows")
    k = ids.shape[1]
    assert ids.stride(1) == 1 and rows_meta.stride(1) == 1 and params.stride(1) == 1
    assert params.shape[0] <= k and params.dtype == torch.float32
    assert gates is None or (gates.is_contiguous() and gates.shape == (ids.shape[0], 2))
    assert pages is None or (pages.stride(1) == 1 and pages.dtype == torch.int64)
    _apply_kernel[(1,)](inbox, ids, rows_meta, params, ids if gates is None else gates,
                        ids if pages is None else pages, ids.stride(0), rows_meta.stride(0),
                        params.stride(0), 0 if pages is None else pages.stride(0), K=k,
                        P=params.shape[0], HAS_GATES=gates is not None,
                        HAS_PAGES=pages is not None, GATE_SHIFT=GATE_SHIFT, BLOCK_R=BLOCK_R,
                        BLOCK_K=next_pow2(k), num_warps=4)


def apply_rows_reference(inbox: torch.Tensor, ids: torch.Tensor, rows_meta: torch.Tensor,
                         params: torch.Tensor, gates: torch.Tensor | None = None,
                         pages: torch.Tensor | None = None) -> None:
    """`apply_rows` in PyTorch ops (no host sync, so it can be captured too); records past the
    count write the scratch row ids.shape[0] - 1 (and params' last column, the page table's
    last entry)."""
    k = ids.shape[1]
    width = record_width(k)
    records = inbox[1:1 + (inbox.shape[0] - 1) // width * width].view(-1, width)
    live = torch.arange(records.shape[0], device=inbox.device) < inbox[0]
    flags = records[:, 4]
    scratch = ids.shape[0] - 1
    is_params = live & ((flags & PARAMS) != 0)
    is_pages = live & ((flags & PAGES) != 0)
    row = torch.where(live & ~is_params & ~is_pages, records[:, 0], scratch)
    rows_meta.index_copy_(1, row, records[:, 1:4].t())
    key = torch.where(is_params, records[:, 0], params.shape[1] - 1)
    values = records[:, RECORD_HEAD:RECORD_HEAD + params.shape[0]].to(torch.int32)
    params.index_copy_(1, key, values.view(torch.float32).t())
    if pages is not None:
        j = torch.arange(k, device=inbox.device)
        entry = records[:, 0:1] * pages.stride(0) + records[:, 2:3] + j  # (M, K)
        due = is_pages[:, None] & (j < records[:, 3:4])
        sink = pages.shape[0] * pages.stride(0) - 1
        pages.view(-1).index_copy_(0, torch.where(due, entry, sink).view(-1),
                                   records[:, RECORD_HEAD:].reshape(-1))
    moved = live & ((flags & MOVED) != 0)
    source = torch.where(moved, records[:, RECORD_HEAD], scratch)
    moved_ids = ids.index_select(0, source)  # read before any write: sources stay intact
    with_ids = live & ((flags & HAS_IDS) != 0)
    ids.index_copy_(0, torch.where(with_ids, records[:, 0], scratch), records[:, RECORD_HEAD:])
    ids.index_copy_(0, torch.where(moved, records[:, 0], scratch), moved_ids)
    if gates is not None:
        moved_gates = gates.index_select(0, source)
        new = torch.stack([flags >> GATE_SHIFT, torch.zeros_like(flags)], 1)
        gates.index_copy_(0, torch.where(with_ids, records[:, 0], scratch), new)
        gates.index_copy_(0, torch.where(moved, records[:, 0], scratch), moved_gates)
    inbox[:1].zero_()


@triton.jit
def _apply_kernel(Inbox, Ids, Meta, Params, Gates, Pages, stride_ids, stride_meta, stride_params,
                  stride_pages, K: tl.constexpr, P: tl.constexpr, HAS_GATES: tl.constexpr,
                  HAS_PAGES: tl.constexpr, GATE_SHIFT: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    count = tl.load(Inbox)
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    for e0 in range(0, count, BLOCK_R):
        e = e0 + r  # (BLOCK_R,)
        ok = e < count
        rec = Inbox + 1 + e.to(tl.int64) * (5 + K)
        row = tl.load(rec, mask=ok, other=0)
        flags = tl.load(rec + 4, mask=ok, other=0)
        is_params = ok & ((flags & 8) != 0)
        is_pages = ok & ((flags & 16) != 0)
        is_row = ok & ~is_params & ~is_pages
        for f in tl.static_range(3):
            tl.store(Meta + f * stride_meta + row, tl.load(rec + 1 + f, mask=is_row),
                     mask=is_row)
        for p in tl.static_range(P):
            bits = tl.load(rec + 5 + p, mask=is_params, other=0).to(tl.int32)
            tl.store(Params + p * stride_params + row, bits.to(tl.float32, bitcast=True),
                     mask=is_params)
        with_ids = ok & ((flags & 1) != 0)
        moved = ok & ((flags & 4) != 0)
        source = tl.load(rec + 5, mask=moved, other=0)
        k_ok = (kk < K)[None, :]
        values = tl.load(rec[:, None] + 5 + kk[None, :], mask=(with_ids | is_pages)[:, None]
                         & k_ok)
        if HAS_PAGES:  # entries [first, first + n) of slot `row` := the record's first n values
            first = tl.load(rec + 2, mask=is_pages, other=0)
            n = tl.load(rec + 3, mask=is_pages, other=0)
            due = is_pages[:, None] & (kk[None, :] < n[:, None])
            tl.store(Pages + row[:, None] * stride_pages + first[:, None] + kk[None, :],
                     values, mask=due)
        values = tl.where(moved[:, None], tl.load(Ids + source[:, None] * stride_ids
                                                  + kk[None, :], mask=moved[:, None] & k_ok),
                          values)
        mask = (with_ids | moved)[:, None] & k_ok
        tl.store(Ids + row[:, None] * stride_ids + kk[None, :], values, mask=mask)
        if HAS_GATES:  # (gate, flags): a new block's gate and no flags; a move's source's
            for c in tl.static_range(2):
                new = (flags >> GATE_SHIFT) * (c == 0)
                gate = tl.where(moved, tl.load(Gates + source * 2 + c, mask=moved, other=0), new)
                tl.store(Gates + row * 2 + c, gate, mask=with_ids | moved)
    tl.store(Inbox, count * 0)
