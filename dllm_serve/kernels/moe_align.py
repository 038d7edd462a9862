"""Sort MoE assignments by expert into padded blocks, on the device, with no host sync.

An *assignment* is one (token, choice) pair, row a = t * top_k + j of the flattened topk_ids.
Each expert's assignments are laid out contiguously and padded to a multiple of `block_m`, so
every block of `block_m` slots belongs to one expert: the grouped GEMMs run one program per
(block, N tile) and read that expert's weights. Shapes are static (sized for the worst case,
A + E * (block_m - 1) slots), so the launch is the same for any routing: graph-capturable.

A batch of at most DIRECT_MAX_TOKENS tokens skips the sort (`direct_blocks`): block e is expert
e's, over every token (block_m >= T). Its row m is token m's assignment to e when the token chose
e, padding otherwise; the GEMM programs find those rows in topk_ids themselves. At a denoise round
of one 32-token block the sort's two launches (count + prefix, place, and the gaps between
kernels) cost more than the compute the direct blocks add: each expert's product runs over all
T rows where the sort's blocks hold 16, but at that size the expert GEMMs are bound by their
weights' bytes, not by their FLOPs. On an H100 at LLaDA2.0-mini's experts (benchmarks/results/
h200/gpupath/direct_probe_h100_1304e3f.json) a MoE layer's experts took 357.5 against 364.2 us
at 32 tokens, and a B = 1 round 5.46 against 5.59 ms (prefix ~1k) and 5.82 against 5.96 (~4k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_serve.kernels.runtime import cdiv, next_pow2

DIRECT_MAX_TOKENS = 32  # batches of at most this many tokens take `direct_blocks` (no sort)


@dataclass
class ExpertBlocks:
    """Where each GEMM block's rows are. Sorted (`direct_top_k` 0): sorted_rows holds each
    slot's assignment (A = padding), block_expert each block's expert. Direct (`direct_top_k`
    = K): sorted_rows is topk_ids (T * K,) itself, block e is expert e's over tokens 0..T-1
    (block_m >= T); block_expert and num_slots are unused (the same ids)."""

    sorted_rows: torch.Tensor  # (max_blocks * block_m,) int32 assignment per slot; A = padding
    block_expert: torch.Tensor  # (max_blocks,) int32 expert of each block, -1 past the used ones
    num_slots: torch.Tensor  # (1,) int32 slots in use (a multiple of block_m)
    block_m: int
    direct_top_k: int = 0  # > 0: the direct layout, top-k choices per token
    num_experts: int = 0  # the direct layout's blocks (one per expert)

    @property
    def max_blocks(self) -> int:
        return self.num_experts if self.direct_top_k else self.block_expert.shape[0]


def direct_blocks(topk_ids: torch.Tensor, num_experts: int) -> ExpertBlocks:
    """topk_ids (T, K), each row's K experts distinct (a top-k) -> the direct layout, one block
    of next_pow2(T) (>= 16) rows per expert. No kernel runs and nothing is allocated."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    return ExpertBlocks(flat, flat, flat, max(16, next_pow2(t)), direct_top_k=k,
                        num_experts=num_experts)


def choose_block_m(num_assignments: int, num_experts: int) -> int:
    """Rows per block: twice the mean assignments per expert, rounded up to 16, 32 or 64.
    With the mean alone about half the experts spilled a few rows into a second block (a
    second program re-reading the expert's weights); twice it holds nearly every expert in one
    block. At LLaDA2.0-mini's experts on an H200 (benchmarks/moe_tune.py --block-m, results/
    h200/gpupath/moe_tune_block_m_*.json) the fused experts took 481 / 514 us per layer at
    512 / 1024 tokens with 32 / 64 rows against 502 / 534 us with 16 / 32; at 2048 tokens 64
    rows (613 us) beat 128 (631 us), hence the cap."""
    mean = 2 * num_assignments / num_experts
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids (T, K) -> ExpertBlocks (assignments sorted by expert, stable, padded)."""
    flat = topk_ids.flatten()  # (A,)
    a, dev = flat.shape[0], flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # (E,)
    order = flat.argsort(stable=True)  # (A,) assignments grouped by expert
    expert = flat.index_select(0, order)
    rank = torch.arange(a, device=dev) - (counts.cumsum(0) - counts).index_select(0, expert)
    dest = (padded_end - padded).index_select(0, expert) + rank  # (A,) slot of each
    max_blocks = cdiv(a + num_experts * (block_m - 1), block_m)
    sorted_rows = torch.full((max_blocks * block_m,), a, dtype=torch.int32, device=dev)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    used = block_start < padded_end[-1]
    block_expert = torch.where(used, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_rows, block_expert, padded_end[-1:].to(torch.int32), block_m)
