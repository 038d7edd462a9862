"""The LM head and the greedy prediction in one pass: no (T, V) logits tensor.

For hidden states h (T, H) and the head's weight W (V, H), each asked row t gets
x = argmax over v != mask_id of l_v (first index on ties) and p = softmax(l)[x] =
1 / sum_v exp(l_v - l_x), with l = h[t] @ W^T rounded to h's dtype first: exactly what
`kernels/step.py` computes from the logits the LM head's GEMM writes in that dtype (up to the
order of the fp32 sum). Rows not asked for (`rows` False: an algorithm that reads only its
masked positions) are skipped: they are sorted behind the asked ones on the device and the
GEMM's row tiles past the asked count return at once, so the cost follows the asked rows, with
shapes that depend only on (T, V, H) (graph-capturable, no host sync). Such rows get x =
`skip_id`, p = 0. A row with a NaN logit gets p = NaN (the step's `bad` flag).

0. `_order_kernel` (one program): the asked rows' order and count.
1. `_head_kernel`: per (row tile, vocabulary tile) the GEMM tile in fp32, then its rows' max,
   first argmax and sum of exp(l - max) over the tile -> (T, tiles) partials. Program ids run
   one vocabulary tile's row tiles consecutively, so each weight tile comes from memory once
   and the hidden states (T x H, a few MB) stay in L2. A persistent launch
   (`HeadLaunch.persistent` programs per SM) loops over the asked rows' tiles in that order,
   in one loop with the K steps, so a tile's epilogue overlaps the next tile's loads.
2. `_merge_kernel`: per asked row, the partials merged (step.py's `merge_partials`), written
   at the row's own index.
Oracle: `reference_head_greedy` (the LM head's GEMM, then step.py's reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.launch_fit import run_fitting
from dllm_serve.kernels.runtime import cdiv, check_device, interpreted, next_pow2, num_sms
from dllm_serve.kernels.step import merge_partials
from dllm_serve.kernels.triton_utils import dot


@dataclass(frozen=True)
class HeadLaunch:
    """Rows and vocabulary entries per program, reduction step, warps and stages; `persistent`
    > 0: that many programs per SM, each running one loop over the reduction steps of its
    tiles (the tiles of the asked rows only), so the next tile's loads run during a tile's
    epilogue. Any values are correct; they only change speed."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    persistent: int = 0


# (most rows, launches best first): the first row whose bound holds T; of its launches the first
# the device holds (kernels/launch_fit.py: the table is tuned on an H100 / H200, whose programs
# may take 227 KB of shared memory). The fastest of nine launches at LLaDA2.0-mini's head on an
# H200, every row and half of them asked, T = 32 / 128 / 512 / 1024 / 2048 (benchmarks/results/
# h200/gpupath/lm_head_probe_*.json): against cuBLAS's GEMM into bf16 logits + the step kernel
# 0.96 / 0.92 / 1.03 / 1.07 / 1.05x the time with every row asked, 1.03 / 0.98 / 0.79 / 0.58 /
# 0.60x with half. Past 64 rows the same tiles as one program per SM at 4 stages (~196 KB), its
# loop over tiles and K steps flattened so a tile's epilogue overlaps the next tile's loads: in
# rounds on an H100 (gpupath/head_inround_probe.sh, two turns) the head took 322 / 1167 us
# against 355 / 1317 one program a tile at B = 16 / 64 (prefix ~1k; 12.31 / 17.68-17.69 ms
# rounds against 12.35-12.37 / 17.74-17.82); kernel alone 8-14% faster at 512-2048 rows
# (persistent_rounds_h100_632e3e4.json).
_ONE_A_TILE = HeadLaunch(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
_SMALL = HeadLaunch(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=2)  # 48 KB
HEAD_LAUNCHES: tuple[tuple[int, tuple[HeadLaunch, ...]], ...] = (
    (64, (HeadLaunch(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4), _SMALL)),
    (1 << 30, (HeadLaunch(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                          persistent=1), _ONE_A_TILE, _SMALL)),
)


def choose_head_launches(rows: int) -> tuple[HeadLaunch, ...]:
    """The table's launches for T = `rows`, best first."""
    return next(launches for bound, launches in HEAD_LAUNCHES if rows <= bound)


def head_greedy(hidden: torch.Tensor, weight: torch.Tensor, mask_id: int,
                rows: torch.Tensor | None = None, skip_id: int = 0,
                launch: HeadLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (T, H), weight (V, H) of one dtype; rows (T,) bool or None (all) -> x (T,)
    int64, p (T,) fp32 (module docstring). `launch` overrides the table's (tests, probes)."""
    check_device(hidden, "head_greedy")
    t, width = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != width or weight.dtype != hidden.dtype:
        raise ValueError(f"head_greedy: hidden {tuple(hidden.shape)} {hidden.dtype} and weight "
                         f"{tuple(weight.shape)} {weight.dtype} do not match")
    dev = hidden.device
    x = torch.empty(t, dtype=torch.int64, device=dev)
    p = torch.empty(t, dtype=torch.float32, device=dev)
    if t == 0:
        return x, p
    hidden, weight = hidden.contiguous(), weight.contiguous()
    order = torch.empty(t, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    asked = x if rows is None else rows.reshape(t)  # x: an unread stand-in pointer
    _order_kernel[(1,)](asked, order, count, t, HAS_ROWS=rows is not None, BLOCK=next_pow2(t))

    def go(run: HeadLaunch) -> None:
        tiles = cdiv(vocab, run.block_n)
        part_max = torch.empty(t, tiles, dtype=torch.float32, device=dev)
        part_idx = torch.empty(t, tiles, dtype=torch.int32, device=dev)
        part_sum = torch.empty(t, tiles, dtype=torch.float32, device=dev)
        programs = cdiv(t, run.block_m) * tiles
        if run.persistent:
            programs = min(programs, run.persistent * num_sms(dev))
        _head_kernel[(programs,)](
            hidden, weight, order, count, part_max, part_idx, part_sum, t, vocab, width,
            mask_id, tiles, ROUND=hidden.dtype != torch.float32,
            IEEE=hidden.dtype == torch.float32, EVEN_K=width % run.block_k == 0,
            PERSISTENT=run.persistent > 0, BLOCK_M=run.block_m, BLOCK_N=run.block_n,
            BLOCK_K=run.block_k, DOT_F32=interpreted(), num_warps=run.num_warps,
            num_stages=run.num_stages)
        _merge_kernel[(t,)](part_max, part_idx, part_sum, order, count, x, p, tiles, vocab,
                            skip_id, BLOCK=next_pow2(tiles), num_warps=4)

    if launch is not None:
        go(launch)
    else:
        run_fitting(("head", hidden.dtype), choose_head_launches(t), go)
    return x, p


def reference_head_greedy(hidden: torch.Tensor, weight: torch.Tensor, mask_id: int,
                          rows: torch.Tensor | None = None, skip_id: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: logits = hidden @ weight^T accumulated in fp32 and rounded once to hidden's
    dtype (as the LM head's GEMM writes them), then argmax and softmax confidence in fp32 with
    the mask token excluded; rows not asked: (skip_id, 0)."""
    logits = (hidden.float() @ weight.float().t()).to(hidden.dtype).float()
    logits[:, mask_id] = float("-inf")
    x = logits.argmax(-1)
    p = torch.exp(logits.gather(-1, x[:, None])[:, 0] - logits.logsumexp(-1))
    if rows is not None:
        asked = rows.reshape(-1)
        x = torch.where(asked, x, skip_id)
        p = torch.where(asked, p, 0.0)
    return x, p


@triton.jit
def _order_kernel(Asked, Order, Count, rows, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Order (T,): the asked rows in index order, then the others; Count: how many asked."""
    i = tl.arange(0, BLOCK)
    ok = i < rows
    if HAS_ROWS:
        a = tl.load(Asked + i, mask=ok, other=0).to(tl.int32)
    else:
        a = ok.to(tl.int32)
    before = tl.cumsum(a, 0) - a  # asked rows before row i
    count = tl.sum(a, 0)
    tl.store(Order + tl.where(a > 0, before, count + i - before), i, mask=ok)
    tl.store(Count, count)


@triton.jit
def _head_kernel(H, W, Order, Count, PartMax, PartIdx, PartSum, rows, vocab, width, mask_id,
                 tiles, ROUND: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                 PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """Per (row tile, vocabulary tile): partial (max, argmax, sum-exp) of its asked rows. One
    program a tile (those past the asked rows return), or (PERSISTENT) each program loops
    over the asked rows' tiles, one vocabulary tile's row tiles consecutively (one loop with
    the K steps: the compiler flattens it)."""
    count = tl.load(Count)
    if PERSISTENT:
        num_m = tl.cdiv(count, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tiles, tl.num_programs(0),
                             flatten=True):
            _head_tile(H, W, Order, PartMax, PartIdx, PartSum, tile // num_m, tile % num_m,
                       count, vocab, width, mask_id, tiles, ROUND, IEEE, EVEN_K, BLOCK_M,
                       BLOCK_N, BLOCK_K, DOT_F32)
    else:
        pid = tl.program_id(0)
        num_m = tl.cdiv(rows, BLOCK_M)
        tile_m = pid % num_m
        if tile_m * BLOCK_M < count:
            _head_tile(H, W, Order, PartMax, PartIdx, PartSum, pid // num_m, tile_m, count,
                       vocab, width, mask_id, tiles, ROUND, IEEE, EVEN_K, BLOCK_M, BLOCK_N,
                       BLOCK_K, DOT_F32)


@triton.jit
def _head_tile(H, W, Order, PartMax, PartIdx, PartSum, tile_n, tile_m, count, vocab, width,
               mask_id, tiles, ROUND: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_F32: tl.constexpr):
    """Tile (tile_n, tile_m) of `_head_kernel` (it holds asked rows)."""
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the asked order
    m_ok = m < count
    src = tl.load(Order + m, mask=m_ok, other=0).to(tl.int64)  # (BLOCK_M,) hidden rows
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < vocab
    k = tl.arange(0, BLOCK_K)
    a_ptr = H + src[:, None] * width + k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptr = W + n[None, :].to(tl.int64) * width + k[:, None]  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptr, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k < width
            a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:  # fp32 weights: no TF32 (the logits as an fp32 GEMM computes them)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += dot(a, b, DOT_F32)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if ROUND:  # the logits as the LM head's GEMM writes them in the model's dtype
        acc = acc.to(H.dtype.element_ty).to(tl.float32)
    nan = acc != acc
    logit = tl.where((n_ok & (n != mask_id))[None, :] & ~nan, acc, float("-inf"))
    top = tl.max(logit, 1)  # (BLOCK_M,)
    idx = tl.argmax(logit, 1)  # first index of the max
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(logit - safe[:, None]), 1)
    total = tl.where(tl.max(nan.to(tl.int32), 1) > 0, float("nan"), total)  # p = NaN: `bad`
    out = m * tiles + tile_n
    tl.store(PartMax + out, top, mask=m_ok)
    tl.store(PartIdx + out, tile_n * BLOCK_N + idx, mask=m_ok)
    tl.store(PartSum + out, total, mask=m_ok)


@triton.jit
def _merge_kernel(PartMax, PartIdx, PartSum, Order, Count, X, P, tiles, vocab, skip_id,
                  BLOCK: tl.constexpr):
    """Position j of the asked order: merge its row's tiles (step.py's merge_partials) and
    write (x, p) at the row's index; positions past the asked count write (skip_id, 0) there."""
    j = tl.program_id(0)
    row = tl.load(Order + j).to(tl.int64)
    if j >= tl.load(Count):
        tl.store(X + row, skip_id.to(tl.int64))
        tl.store(P + row, 0.0)
        return
    s = tl.arange(0, BLOCK)
    x, p = merge_partials(PartMax, PartIdx, PartSum, j.to(tl.int64) * tiles, s, s < tiles,
                          vocab)
    tl.store(X + row, x.to(tl.int64))
    tl.store(P + row, p)
