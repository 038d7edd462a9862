"""`align_by_expert` in Triton: one launch for few assignments, five for many, instead of ~20
torch ops and a radix sort.

Same result as the oracle `moe_align.align_by_expert` (assignments stably sorted by expert,
each expert's run padded to a multiple of block_m), same static shapes, no host sync, on
either path. While `one_program(A, E)` (A * max(E, CHUNK) <= ONE_PROGRAM_PAIRS: 1024
assignments of 256 experts, LLaDA2.0-mini up to 128 tokens), `_one_program_kernel` does it all:
1. per-expert counts, a chunk of CHUNK assignments at a time; padded starts (a scan);
2. the padding value (A) in each run's tail and in every slot past the used ones, -1 as the
   expert of every block past them (slots and blocks no assignment takes: no ordering needed);
3. the scatter, chunk by chunk in order: slot = the expert's next free slot (carried over the
   earlier chunks) + the earlier assignments of the expert in the chunk; the assignment that
   heads a block names the block's expert.
At batch size 1 (256 assignments) the five launches cost ~9 us per MoE layer on an H200, nearly
all of it launch latency. The one program compares each chunk with every expert (and with
itself) twice, in sequence on one SM, so its time grows with A * max(E, CHUNK) where the five
launches spread the work over A / CHUNK programs; the bound is where the one program's ~16
sequential chunk steps are estimated to cost about the five launches (not measured yet: time
`sort_by_expert` at 512-2048 assignments on the GPU and move ONE_PROGRAM_PAIRS).
Past the bound, five launches:
1. `_count_kernel`, one program per chunk of CHUNK assignments: per-expert counts (C, E);
2. `_prefix_kernel`, one program per slice of EXPERT_SLICE experts: for each chunk its
   exclusive per-expert prefix over earlier chunks (C, E), and the experts' totals (E,);
3. `_starts_kernel`, one program: each expert's padded start and the slots in use (a scan
   over E totals; kept apart from 2 so that 2 runs in parallel: one program scanning every
   chunk of every expert took 28 us per MoE layer at 2048 tokens x 8 choices on an H200);
4. `_scatter_kernel`, one program per chunk: slot = start[e] + prefix[chunk, e] + the number
   of earlier assignments of e in the chunk (stable order);
5. `_blocks_kernel`, one program per block: its expert (-1 past the used blocks) and the
   padding value (A) in every slot of the block that holds no assignment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.moe_align import ExpertBlocks
from dllm_serve.kernels.runtime import cdiv, check_device, next_pow2

CHUNK = 128  # assignments per step of the one program, per program of count and scatter
EXPERT_SLICE = 16  # experts per program of the prefix kernel
ONE_PROGRAM_PAIRS = 1 << 18  # most A * max(E, CHUNK) sorted by the one program
# The one program's (CHUNK, E) comparisons live in registers: at E = 256, 16 warps hold them
# in 128 registers a thread (ptxas for sm_90); 8 warps need 255 and spill.
ONE_PROGRAM_WARPS = 16
FILL_SLOTS = 1024  # slots per step of the one program's fill of unused blocks


def supports(num_experts: int) -> bool:
    return num_experts == next_pow2(num_experts)


def one_program(num_assignments: int, num_experts: int) -> bool:
    """Whether `sort_by_expert` takes the one-launch path: its program compares each chunk of
    CHUNK assignments with every expert (and with each other) twice, in sequence."""
    return num_assignments * max(num_experts, CHUNK) <= ONE_PROGRAM_PAIRS


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids (T, K) -> ExpertBlocks, equal to `align_by_expert(topk_ids, E, block_m)`:
    one launch when `one_program(T * K, E)`, else five."""
    check_device(topk_ids, "sort_by_expert")
    flat = topk_ids.flatten()  # (A,)
    a = flat.shape[0]
    max_blocks = cdiv(a + num_experts * (block_m - 1), block_m)
    blocks = ExpertBlocks(
        torch.empty(max_blocks * block_m, dtype=torch.int32, device=flat.device),
        torch.empty(max_blocks, dtype=torch.int32, device=flat.device),
        torch.empty(1, dtype=torch.int32, device=flat.device), block_m)
    sort = _sort_in_one_launch if one_program(a, num_experts) else _sort_in_five_launches
    sort(flat, num_experts, blocks)
    return blocks


def _sort_in_one_launch(flat: torch.Tensor, e: int, out: ExpertBlocks) -> None:
    """flat (A,) expert ids -> out's three tensors, in one program."""
    _one_program_kernel[(1,)](flat, out.sorted_rows, out.block_expert, out.num_slots,
                              flat.shape[0], out.max_blocks, E=e, BM=out.block_m, CHUNK=CHUNK,
                              FILL_BLOCKS=max(1, FILL_SLOTS // out.block_m),
                              num_warps=ONE_PROGRAM_WARPS)


def _sort_in_five_launches(flat: torch.Tensor, e: int, out: ExpertBlocks) -> None:
    """flat (A,) expert ids -> out's three tensors: count, prefix, starts, scatter, blocks."""
    a, bm, dev = flat.shape[0], out.block_m, flat.device
    chunks = max(1, cdiv(a, CHUNK))
    counts = torch.empty(chunks, e, dtype=torch.int32, device=dev)
    prefix = torch.empty(chunks, e, dtype=torch.int32, device=dev)
    starts = torch.empty(e, dtype=torch.int32, device=dev)
    totals = torch.empty(e, dtype=torch.int32, device=dev)
    _count_kernel[(chunks,)](flat, counts, a, E=e, CHUNK=CHUNK, num_warps=4)
    slice_ = min(EXPERT_SLICE, e)
    _prefix_kernel[(e // slice_,)](counts, prefix, totals, chunks, E=e,
                                   BLOCK_C=max(2, next_pow2(chunks)), SLICE=slice_,
                                   num_warps=4)
    _starts_kernel[(1,)](totals, starts, out.num_slots, E=e, BM=bm, num_warps=4)
    _scatter_kernel[(chunks,)](flat, prefix, starts, out.sorted_rows, a, E=e, CHUNK=CHUNK,
                               num_warps=4)
    _blocks_kernel[(out.max_blocks,)](starts, totals, out.num_slots, out.sorted_rows,
                                      out.block_expert, a, E=e, BM=bm, num_warps=1)


@triton.jit
def _chunk_ids(Ids, first, num_rows, E: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk of assignments from `first`: rows, validity, experts (E where invalid)."""
    a = first + tl.arange(0, CHUNK)
    ok = a < num_rows
    return a, ok, tl.load(Ids + a, mask=ok, other=E).to(tl.int32)


@triton.jit
def _per_expert(ids, E: tl.constexpr):
    """ids (CHUNK,) -> (CHUNK, E) int32: 1 where the assignment's expert is the column's."""
    return (ids[:, None] == tl.arange(0, E)[None, :]).to(tl.int32)


@triton.jit
def _earlier_same(ids, CHUNK: tl.constexpr):
    """ids (CHUNK,) -> (CHUNK,): the earlier assignments of the same expert in the chunk."""
    i = tl.arange(0, CHUNK)
    earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    return tl.sum(earlier.to(tl.int32), 1)


@triton.jit
def _one_program_kernel(Ids, SortedRows, BlockExpert, NumSlots, num_rows, max_blocks,
                        E: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr,
                        FILL_BLOCKS: tl.constexpr):
    count = tl.zeros([E], tl.int32)
    for first in range(0, num_rows, CHUNK):
        _, _, ids = _chunk_ids(Ids, first, num_rows, E, CHUNK)
        count += tl.sum(_per_expert(ids, E), 0)
    padded = (count + BM - 1) // BM * BM  # (E,)
    start = tl.cumsum(padded, 0) - padded
    used = tl.sum(padded, 0)
    tl.store(NumSlots, used)
    j = tl.arange(0, BM)
    tail = (start + count)[:, None] + j[None, :]  # (E, BM): each run's padding slots
    tl.store(SortedRows + tail, tl.zeros([E, BM], tl.int32) + num_rows,
             mask=tail < (start + padded)[:, None])
    for b0 in range(used // BM, max_blocks, FILL_BLOCKS):
        b = b0 + tl.arange(0, FILL_BLOCKS)  # (FILL_BLOCKS,) unused blocks
        unused = b < max_blocks
        tl.store(BlockExpert + b, tl.full([FILL_BLOCKS], -1, tl.int32), mask=unused)
        tl.store(SortedRows + b[:, None] * BM + j[None, :],
                 tl.zeros([FILL_BLOCKS, BM], tl.int32) + num_rows, mask=unused[:, None])
    free = start  # (E,) each expert's next free slot
    for first in range(0, num_rows, CHUNK):
        a, ok, ids = _chunk_ids(Ids, first, num_rows, E, CHUNK)
        hot = _per_expert(ids, E)  # (CHUNK, E)
        slot = tl.sum(hot * free[None, :], 1) + _earlier_same(ids, CHUNK)
        tl.store(SortedRows + slot, a, mask=ok)
        tl.store(BlockExpert + slot // BM, ids, mask=ok & (slot % BM == 0))
        free += tl.sum(hot, 0)


@triton.jit
def _count_kernel(Ids, Counts, num_rows, E: tl.constexpr, CHUNK: tl.constexpr):
    _, _, ids = _chunk_ids(Ids, tl.program_id(0) * CHUNK, num_rows, E, CHUNK)
    tl.store(Counts + tl.program_id(0) * E + tl.arange(0, E), tl.sum(_per_expert(ids, E), 0))


@triton.jit
def _prefix_kernel(Counts, Prefix, Totals, num_chunks, E: tl.constexpr,
                   BLOCK_C: tl.constexpr, SLICE: tl.constexpr):
    c = tl.arange(0, BLOCK_C)
    e = tl.program_id(0) * SLICE + tl.arange(0, SLICE)
    c_ok = (c < num_chunks)[:, None]
    at = c[:, None] * E + e[None, :]  # (BLOCK_C, SLICE)
    count = tl.load(Counts + at, mask=c_ok, other=0)
    tl.store(Prefix + at, tl.cumsum(count, 0) - count, mask=c_ok)
    tl.store(Totals + e, tl.sum(count, 0))


@triton.jit
def _starts_kernel(Totals, Starts, NumSlots, E: tl.constexpr, BM: tl.constexpr):
    e = tl.arange(0, E)
    total = tl.load(Totals + e)
    padded = (total + BM - 1) // BM * BM
    tl.store(Starts + e, tl.cumsum(padded, 0) - padded)
    tl.store(NumSlots, tl.sum(padded, 0))


@triton.jit
def _scatter_kernel(Ids, Prefix, Starts, SortedRows, num_rows, E: tl.constexpr,
                    CHUNK: tl.constexpr):
    a, ok, ids = _chunk_ids(Ids, tl.program_id(0) * CHUNK, num_rows, E, CHUNK)
    safe = tl.where(ok, ids, 0)
    slot = (tl.load(Starts + safe, mask=ok, other=0)
            + tl.load(Prefix + tl.program_id(0) * E + safe, mask=ok, other=0)
            + _earlier_same(ids, CHUNK))
    tl.store(SortedRows + slot, a.to(tl.int32), mask=ok)


@triton.jit
def _blocks_kernel(Starts, Totals, NumSlots, SortedRows, BlockExpert, num_rows,
                   E: tl.constexpr, BM: tl.constexpr):
    block_start = tl.program_id(0) * BM
    e = tl.arange(0, E)
    padded_end = tl.load(Starts + e) + (tl.load(Totals + e) + BM - 1) // BM * BM
    expert = tl.sum((padded_end <= block_start).to(tl.int32), 0)  # searchsorted, right
    used = block_start < tl.load(NumSlots)
    tl.store(BlockExpert + tl.program_id(0), tl.where(used, expert, -1))
    mine = tl.minimum(expert, E - 1)
    slot = block_start + tl.arange(0, BM)
    held = tl.where(used, tl.load(Totals + mine), 0)  # assignments of the block's expert
    padding = slot - tl.load(Starts + mine) >= held  # (BM,): slots that hold no assignment
    tl.store(SortedRows + slot, tl.full([BM], 0, tl.int32) + num_rows, mask=padding)
