"""Staged row writes of the worker's row storage, applied on the device in one launch.

The resident batch changes a few rows per forward (a block opens where one retired, a request
takes a hole). Instead of several host-issued copies and scatters per change, the host packs
the changed rows into an *inbox* (one int64 buffer, one host-to-device copy) and the forward's
CUDA graph applies it first thing (managers/row_storage.py).

Inbox layout: [count, record 0, record 1, ...], each record RECORD_HEAD + K int64 values:
  row, request, start, seed, flags, ids[K]
flags: HAS_IDS (the record carries the block's ids), FRESH_STATE (the algorithm's fresh state
is due for the row; applied by RowStorage, not here), MOVED (the row takes the block of row
ids[0], the *source*: a layout that closes its holes moves its last rows into them).
`apply_rows`: for each of the first `count` records rows_meta[:, row] = (request, start, seed),
with HAS_IDS ids[row] = the record's ids, with MOVED ids[row] = ids[source]; then count = 0,
so a replay with nothing staged does nothing. Invariant (the caller's): no source row is
written (with ids, or as a move's target) by the same inbox, so records apply in any order.
Oracle: `apply_rows_reference` (the CPU path), which needs a scratch row: the last row of ids
and rows_meta takes the unused records' writes.
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
BLOCK_R = 16  # records per inner step


def record_width(block_size: int) -> int:
    return RECORD_HEAD + block_size


def apply_rows(inbox: torch.Tensor, ids: torch.Tensor, rows_meta: torch.Tensor) -> None:
    """inbox (1 + M * (RECORD_HEAD + K),) int64, ids (rows, K) int64 contiguous, rows_meta
    (3, rows) int64 with unit stride along rows: apply the staged records, zero the count."""
    check_device(inbox, "apply_rows")
    k = ids.shape[1]
    assert ids.stride(1) == 1 and rows_meta.stride(1) == 1
    _apply_kernel[(1,)](inbox, ids, rows_meta, ids.stride(0), rows_meta.stride(0), K=k,
                        BLOCK_R=BLOCK_R, BLOCK_K=next_pow2(k), num_warps=4)


def apply_rows_reference(inbox: torch.Tensor, ids: torch.Tensor, rows_meta: torch.Tensor,
                         ) -> None:
    """`apply_rows` in PyTorch ops (no host sync, so it can be captured too); rows past the
    count write the scratch row ids.shape[0] - 1."""
    k = ids.shape[1]
    width = record_width(k)
    records = inbox[1:1 + (inbox.shape[0] - 1) // width * width].view(-1, width)
    live = torch.arange(records.shape[0], device=inbox.device) < inbox[0]
    scratch = ids.shape[0] - 1
    rows_meta.index_copy_(1, torch.where(live, records[:, 0], scratch), records[:, 1:4].t())
    moved = live & ((records[:, 4] & MOVED) != 0)
    source = torch.where(moved, records[:, RECORD_HEAD], scratch)
    moved_ids = ids.index_select(0, source)  # read before any write: sources stay intact
    with_ids = live & ((records[:, 4] & HAS_IDS) != 0)
    ids.index_copy_(0, torch.where(with_ids, records[:, 0], scratch), records[:, RECORD_HEAD:])
    ids.index_copy_(0, torch.where(moved, records[:, 0], scratch), moved_ids)
    inbox[:1].zero_()


@triton.jit
def _apply_kernel(Inbox, Ids, Meta, stride_ids, stride_meta, K: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    count = tl.load(Inbox)
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    for e0 in range(0, count, BLOCK_R):
        e = e0 + r  # (BLOCK_R,)
        ok = e < count
        rec = Inbox + 1 + e.to(tl.int64) * (5 + K)
        row = tl.load(rec, mask=ok, other=0)
        for f in tl.static_range(3):
            tl.store(Meta + f * stride_meta + row, tl.load(rec + 1 + f, mask=ok), mask=ok)
        flags = tl.load(rec + 4, mask=ok, other=0)
        with_ids = ok & ((flags & 1) != 0)
        moved = ok & ((flags & 4) != 0)
        source = tl.load(rec + 5, mask=moved, other=0)
        k_ok = (kk < K)[None, :]
        values = tl.load(rec[:, None] + 5 + kk[None, :], mask=with_ids[:, None] & k_ok)
        values = tl.where(moved[:, None], tl.load(Ids + source[:, None] * stride_ids
                                                  + kk[None, :], mask=moved[:, None] & k_ok),
                          values)
        mask = (with_ids | moved)[:, None] & k_ok
        tl.store(Ids + row[:, None] * stride_ids + kk[None, :], values, mask=mask)
    tl.store(Inbox, count * 0)
