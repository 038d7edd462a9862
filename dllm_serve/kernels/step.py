"""The fused step: argmax and softmax confidence over the vocabulary, mask token excluded.

For each row of logits (N, V): x = argmax (first index on ties) over v != mask_id, and
p = softmax(logits)[x] = 1 / sum_v exp(l_v - l_x), the confidence `DllmAlgorithm.predict`
computes for greedy rows (its oracle). The vocabulary is read once, in chunks, with an online
max / sum-exp in fp32: no (N, V) fp32 temporary. Each row's vocabulary is cut into `splits`
slices (so that small batches still fill the GPU); `_combine_kernel` merges the slices'
(max, argmax, sum-exp). Shapes depend only on (N, V): graph-capturable, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import cdiv, check_device, floor_pow2, num_sms

# Launch constants, from benchmarks/step_tune.py on an H200 at LLaDA2.0-mini's vocabulary
# (benchmarks/results/h200/gpupath/step_tune_2eb859d.json). Against the earlier 1024 entries a
# step and 4 programs per SM: B=1 93 -> 94 us, B=4 141 -> 79, B=16 212 -> 119, B=32 312 -> 201,
# B=64 546 -> 374. The constants: vocabulary entries per loop step when a row is split (small
# batches) and when it is read whole, warps and software-pipeline stages of the partial
# kernel, programs per SM wanted.
BLOCK_V_SPLIT = 2048
BLOCK_V_WHOLE = 4096
NUM_WARPS = 4
NUM_STAGES = 3
PROGRAMS_PER_SM = 8
MAX_SPLITS = 64


def choose_splits(rows: int, vocab: int, sms: int) -> int:
    """Vocabulary slices per row (a power of two), at least two BLOCK_V_SPLIT chunks each."""
    wanted = max(1, PROGRAMS_PER_SM * sms // max(rows, 1))
    return floor_pow2(min(wanted, max(1, vocab // (2 * BLOCK_V_SPLIT)), MAX_SPLITS))


def argmax_confidence(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., V) any float dtype -> x (...) int64, p (...) fp32."""
    check_device(logits, "argmax_confidence")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, dev = flat.shape[0], flat.device
    x = torch.empty(rows, dtype=torch.int64, device=dev)
    p = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows:
        splits = choose_splits(rows, vocab, num_sms(dev))
        part_max = torch.empty(rows, splits, dtype=torch.float32, device=dev)
        part_idx = torch.empty(rows, splits, dtype=torch.int32, device=dev)
        part_sum = torch.empty(rows, splits, dtype=torch.float32, device=dev)
        block_v = BLOCK_V_SPLIT if splits > 1 else BLOCK_V_WHOLE
        chunk = cdiv(cdiv(vocab, splits), block_v) * block_v
        _partial_kernel[(rows, splits)](
            flat, part_max, part_idx, part_sum, flat.stride(0), vocab, mask_id, chunk,
            SPLITS=splits, BLOCK_V=block_v, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        _combine_kernel[(rows,)](part_max, part_idx, part_sum, x, p, vocab, SPLITS=splits,
                                 num_warps=1)
    return x.view(lead), p.view(lead)


@triton.jit
def _partial_kernel(Logits, PartMax, PartIdx, PartSum, stride_row, vocab, mask_id, chunk,
                    SPLITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (row, slice): max, first argmax and sum of exp(l - max) over the slice."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    base = Logits + row.to(tl.int64) * stride_row
    top = float("-inf")
    total = 0.0
    idx = 0
    for start in range(lo, hi, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        ok = (v < hi) & (v != mask_id)
        logit = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32)
        chunk_top = tl.max(logit, 0)
        new_top = tl.maximum(top, chunk_top)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - safe) + tl.sum(tl.exp(logit - safe), 0)
        idx = tl.where(chunk_top > top, start + tl.argmax(logit, 0), idx)
        top = new_top
    out = row * SPLITS + split
    tl.store(PartMax + out, top)
    tl.store(PartIdx + out, idx)
    tl.store(PartSum + out, total)


@triton.jit
def _combine_kernel(PartMax, PartIdx, PartSum, X, P, vocab, SPLITS: tl.constexpr):
    """Merge a row's slices (merge_partials)."""
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    x, p = merge_partials(PartMax, PartIdx, PartSum, row * SPLITS, s, s < SPLITS, vocab)
    tl.store(X + row, x.to(tl.int64))
    tl.store(P + row, p)


@triton.jit
def merge_partials(PartMax, PartIdx, PartSum, base, s, ok, vocab):
    """One row's slices s (where ok) at base + s of the partial (max, argmax, sum-exp) arrays
    -> (x, p): the first slice holding the max gives x (slices are in vocabulary order); p =
    1 / the sum-exp rescaled to that max. Also kernels/lm_head.py's merge."""
    part_max = tl.load(PartMax + base + s, mask=ok, other=float("-inf"))
    top = tl.max(part_max, 0)
    x = tl.min(tl.where(ok & (part_max == top), tl.load(PartIdx + base + s, mask=ok, other=0),
                        vocab), 0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.load(PartSum + base + s, mask=ok, other=0.0) * tl.exp(part_max - safe), 0)
    return x, 1.0 / total
