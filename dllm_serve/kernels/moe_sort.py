"""`align_by_expert` in two or three small Triton launches instead of ~20 torch ops and a sort.

Same result as the oracle `moe_align.align_by_expert` (assignments stably sorted by expert,
each expert's run padded to a multiple of block_m), same static shapes, no host sync:
1. the per-chunk counts (C, E) of chunks of CHUNK assignments, then for each chunk its exclusive
   per-expert prefix over earlier chunks (C, E) and the experts' totals (E,). Up to
   FUSED_CHUNKS chunks (256 assignments: one 32-token block at top-8) one launch does both,
   `_count_prefix_kernel`: one program per slice of EXPERT_SLICE experts walks the chunks in
   order. Past that, `_count_kernel` (one program per chunk) then `_prefix_kernel` (one per
   slice of experts over the chunks' counts): the walk grows with the chunks;
2. `_place_kernel`, one program per chunk, then one per block. Each first scans the E totals
   into the experts' padded starts (E values, 256 in LLaDA2.0-mini: cheaper than a launch of
   its own, which the starts once had). A chunk's program puts each assignment at slot = start[e] +
   prefix[chunk, e] + the number of earlier assignments of e in the chunk (stable order); a
   block's program writes the block's expert (-1 past the used blocks) and the padding value
   (A) in every slot of the block that holds no assignment. The two kinds write disjoint
   slots, so they share the launch. Program 0 also stores the slots in use.
Speed (LLaDA2.0-mini's 256 experts, top-8, an H200, CUDA graphs of back-to-back sorts;
benchmarks/results/h200/gpupath/sort_probe.py, sort_probe_6f696b1.json): at 32 / 128 / 512 /
2048 tokens 6.0 / 8.1 / 8.7 / 10.9 us a sort against 8.5 / 9.3 / 10.0 / 12.1 us with
128-assignment chunks, 4 placing warps and counts and prefix always apart. A chunk's (CHUNK, E)
one-hot and (CHUNK, CHUNK) rank are short reductions that 2 warps finish sooner than 4. The
fused count-prefix pays only while its walk is short: 6.0-7.1 us at 32 tokens, 9.5-10.4 at
128, 18-26 at 512, 53-88 at 2048 (its programs walk every chunk). One program scanning every
chunk of every expert took 28 us per MoE layer at 2048 tokens x 8 choices, and a single program
doing the whole sort ~30 us at 32 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.moe_align import ExpertBlocks
from dllm_serve.kernels.runtime import cdiv, check_device, next_pow2

CHUNK = 64  # assignments per program of the count kernel and of the placing chunks
EXPERT_SLICE = 16  # experts per program of the prefix (and fused count-prefix) kernel
FUSED_CHUNKS = 4  # at most this many chunks: counts and prefix in one launch
PLACE_WARPS = 2  # warps of the placing launch (short reductions: 2 beat 4)


def supports(num_experts: int) -> bool:
    return num_experts == next_pow2(num_experts)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids (T, K) -> ExpertBlocks, equal to `align_by_expert(topk_ids, E, block_m)`."""
    check_device(topk_ids, "sort_by_expert")
    flat = topk_ids.flatten()  # (A,)
    a, e, dev = flat.shape[0], num_experts, flat.device
    chunks = max(1, cdiv(a, CHUNK))
    max_blocks = cdiv(a + e * (block_m - 1), block_m)
    prefix = torch.empty(chunks, e, dtype=torch.int32, device=dev)
    totals = torch.empty(e, dtype=torch.int32, device=dev)
    num_slots = torch.empty(1, dtype=torch.int32, device=dev)
    sorted_rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    slice_ = min(EXPERT_SLICE, e)
    if chunks <= FUSED_CHUNKS:
        _count_prefix_kernel[(e // slice_,)](flat, prefix, totals, a, chunks, E=e, CHUNK=CHUNK,
                                             SLICE=slice_, num_warps=4)
    else:
        counts = torch.empty(chunks, e, dtype=torch.int32, device=dev)
        _count_kernel[(chunks,)](flat, counts, a, E=e, CHUNK=CHUNK, num_warps=4)
        _prefix_kernel[(e // slice_,)](counts, prefix, totals, chunks, E=e,
                                       BLOCK_C=max(2, next_pow2(chunks)), SLICE=slice_,
                                       num_warps=4)
    _place_kernel[(chunks + max_blocks,)](flat, prefix, totals, sorted_rows, block_expert,
                                          num_slots, a, chunks, E=e, CHUNK=CHUNK, BM=block_m,
                                          num_warps=PLACE_WARPS)
    return ExpertBlocks(sorted_rows, block_expert, num_slots, block_m)


@triton.jit
def _chunk_ids(Ids, num_rows, E: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk: assignment rows, validity, experts (E where invalid)."""
    a = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = a < num_rows
    return a, ok, tl.load(Ids + a, mask=ok, other=E).to(tl.int32)


@triton.jit
def _count_kernel(Ids, Counts, num_rows, E: tl.constexpr, CHUNK: tl.constexpr):
    _, _, ids = _chunk_ids(Ids, num_rows, E, CHUNK)
    e = tl.arange(0, E)
    count = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)  # (E,)
    tl.store(Counts + tl.program_id(0) * E + e, count)


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
def _count_prefix_kernel(Ids, Prefix, Totals, num_rows, num_chunks, E: tl.constexpr,
                         CHUNK: tl.constexpr, SLICE: tl.constexpr):
    """_count_kernel and _prefix_kernel in one pass: this program's SLICE experts, their
    counts chunk by chunk in order, each chunk's exclusive prefix stored before its count is
    added; the totals at the end."""
    e = tl.program_id(0) * SLICE + tl.arange(0, SLICE)
    seen = tl.zeros([SLICE], tl.int32)  # (SLICE,) assignments of each expert in earlier chunks
    for c in range(num_chunks):
        a = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(Ids + a, mask=a < num_rows, other=E).to(tl.int32)
        tl.store(Prefix + c * E + e, seen)
        seen += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
    tl.store(Totals + e, seen)


@triton.jit
def _place_kernel(Ids, Prefix, Totals, SortedRows, BlockExpert, NumSlots, num_rows, num_chunks,
                  E: tl.constexpr, CHUNK: tl.constexpr, BM: tl.constexpr):
    e = tl.arange(0, E)
    total = tl.load(Totals + e)
    padded = (total + BM - 1) // BM * BM
    starts = tl.cumsum(padded, 0) - padded  # (E,) each expert's first slot
    used = tl.sum(padded, 0)  # slots in use
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(NumSlots, used)
    if pid < num_chunks:
        _scatter(Ids, Prefix, SortedRows, starts, num_rows, E, CHUNK)
    else:
        _fill_block(SortedRows, BlockExpert, pid - num_chunks, starts, total, used, num_rows,
                    E, BM)


@triton.jit
def _scatter(Ids, Prefix, SortedRows, starts, num_rows, E: tl.constexpr, CHUNK: tl.constexpr):
    """This chunk's assignments into their slots (stable within each expert)."""
    a, ok, ids = _chunk_ids(Ids, num_rows, E, CHUNK)
    i = tl.arange(0, CHUNK)
    earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)  # (CHUNK,) earlier assignments of the same expert
    mine = ids[:, None] == tl.arange(0, E)[None, :]  # (CHUNK, E); all False where invalid
    start = tl.sum(tl.where(mine, starts[None, :], 0), 1)
    safe = tl.where(ok, ids, 0)
    slot = start + tl.load(Prefix + tl.program_id(0) * E + safe, mask=ok, other=0) + rank
    tl.store(SortedRows + slot, a.to(tl.int32), mask=ok)


@triton.jit
def _fill_block(SortedRows, BlockExpert, block, starts, total, used, num_rows, E: tl.constexpr,
                BM: tl.constexpr):
    """Block `block`'s expert (-1 past the used slots) and the padding value in its free slots."""
    block_start = block * BM
    e = tl.arange(0, E)
    padded_end = starts + (total + BM - 1) // BM * BM
    expert = tl.sum((padded_end <= block_start).to(tl.int32), 0)  # searchsorted, right
    in_use = block_start < used
    tl.store(BlockExpert + block, tl.where(in_use, expert, -1))
    mine = e == tl.minimum(expert, E - 1)
    held = tl.where(in_use, tl.sum(tl.where(mine, total, 0), 0), 0)  # the expert's assignments
    slot = block_start + tl.arange(0, BM)
    padding = slot - tl.sum(tl.where(mine, starts, 0), 0) >= held  # (BM,) slots without one
    tl.store(SortedRows + slot, tl.full([BM], 0, tl.int32) + num_rows, mask=padding)
