"""Fused routed experts (`--moe-backend triton`): device routing, then two grouped GEMMs.

1. `fused_route` sums the router's partial logits and picks experts and weights
   (kernels/moe_route.py);
2. `sort_by_expert` sorts the T*K assignments by expert into padded blocks (moe_sort.py; its
   oracle `align_by_expert`, moe_align.py, serves expert counts that are not powers of two),
   or, for at most DIRECT_MAX_TOKENS tokens, nothing runs: `direct_blocks` gives each expert
   one block over every token, and each GEMM program finds its expert's rows in topk_ids;
3. `_up_kernel`: per (block, N tile) h = silu(x @ gate^T) * (x @ up^T) for the block's
   assignments, x rows gathered by token, SiLU-and-mul in the epilogue -> h (A, I), (A + T, I)
   with a shared expert;
4. `_down_kernel`: per (block, N tile) y = h @ down^T -> (A, hidden) in x.dtype, (A + T,
   hidden) with a shared expert (each expert's output rounded once, as `moe_reference` rounds
   it; half the bytes of fp32 rows);
5. `sum_choices` (kernels/moe_sum.py): each token's K rows times their routing weights, summed
   in fp32 in choice order, cast to x.dtype (one pass; the addends and the next norm fused).
A shared expert of the routed experts' width (LLaDA2.0-mini's) is one more expert here: its
blocks (every token, rows A .. A + T of h and y) follow the routed blocks in the same two
launches, and its rows are the first addend of the sum. That is two kernels fewer per MoE
layer than its own GEMMs and activation (at a denoise round's few rows each such GEMM costs
its launch latency, ~5 us on an H200, more than its bytes).
Each GEMM's tile width, reduction step, warps and stages come from MOE_LAUNCHES
(kernels/moe_launch.py) by the number of assignments (benchmarks/moe_tune.py measures the
candidates).
Program ids run the blocks of one N tile consecutively, or (`MoeLaunch.block_major`, the
launches past 512 tokens) each block's N tiles consecutively; either way the blocks of one
expert (same weight tiles) run side by side and share them through L2, so each selected
expert's weights come from memory about once per projection. Block-major also reads each
block's input rows once: N-major re-reads all of them per N tile, from memory once they outgrow
L2 (the down projection's h at 2048 tokens: 19 MB, 16 N tiles). Oracle: `layers.moe_router.route` +
`moe_reference`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dllm_serve.kernels import launch_fit, moe_align
from dllm_serve.kernels.moe_align import (
    ExpertBlocks,
    align_by_expert,
    choose_block_m,
    direct_blocks,
)
from dllm_serve.kernels.moe_launch import DEFAULT_LAUNCH, MoeLaunch, choose_moe_launches
from dllm_serve.kernels.moe_route import fused_route
from dllm_serve.kernels.moe_route import supports as route_supports
from dllm_serve.kernels.moe_sort import sort_by_expert
from dllm_serve.kernels.moe_sort import supports as sort_supports
from dllm_serve.kernels.moe_sum import sum_choices
from dllm_serve.kernels.runtime import check_device, interpreted, next_pow2
from dllm_serve.kernels.triton_utils import dot
from dllm_serve.layers.moe import (
    FUSES_NORM,
    FUSES_SHARED,
    MOE_BACKENDS,
    NormParams,
    SharedExpert,
    fuses_shared,
)
from dllm_serve.layers.moe_router import RoutingParams, route, sum_logit_parts

# The kernels address rows of x, h and y with int32 offsets: one call takes at most this many
# elements in each (fused_experts runs more tokens than that in parts)
MAX_ELEMENTS = 2**31 - 1


FUSES_SHARED.add("triton")  # fused_experts computes a shared expert among the routed ones
FUSES_NORM.add("triton")  # and the next RMSNorm in its final pass


@MOE_BACKENDS.register("triton")
def triton_moe(x: torch.Tensor, router_logits: torch.Tensor, expert_bias: torch.Tensor | None,
               p: RoutingParams, w13: torch.Tensor, w2: torch.Tensor,
               addends: tuple[torch.Tensor, ...] = (), shared: SharedExpert | None = None,
               norm: NormParams | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The MOE_BACKENDS "triton" entry: fused routing of the logits (T, E) or their partial
    sums (T, P, E) (where its shapes allow) + fused experts (the shared expert among them),
    the addends added and the norm (when given) applied in the experts' final pass."""
    if route_supports(router_logits.shape[-1], p):
        topk_ids, topk_weights = fused_route(router_logits, expert_bias, p)
    else:
        topk_ids, topk_weights = route(sum_logit_parts(router_logits), expert_bias, p)
    return fused_experts(x, w13, w2, topk_ids, topk_weights, addends=addends, shared=shared,
                         norm=norm)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor,
                  launches: tuple[MoeLaunch, MoeLaunch] | None = None,
                  addends: tuple[torch.Tensor, ...] = (), block_m: int | None = None,
                  shared: SharedExpert | None = None, norm: NormParams | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x (T, hidden), w13 (E, 2I, hidden), w2 (E, hidden, I), topk_ids/topk_weights (T, K)
    -> (T, hidden) in x.dtype; equal to `moe_reference` within rounding, then the addends
    (T, hidden) added in order (`sum_choices`). `shared` (2I, hidden), (hidden, I): a shared
    expert of the same width, computed with the routed ones and added (unweighted) before the
    addends. `norm` (weight, eps): (out, RMSNorm(out)) (`sum_choices`). `launches` (up,
    down) overrides the table's and `block_m` the expert blocks' rows (tests,
    benchmarks/moe_tune.py)."""
    check_device(x, "fused_experts")
    t, k = topk_ids.shape
    hidden = w2.shape[1]
    if t == 0:
        empty = x.new_zeros(0, hidden)
        if norm is None:
            return empty
        return empty, empty.to(torch.promote_types(x.dtype, norm[0].dtype))  # sum_choices' dtype
    step = max(1, MAX_ELEMENTS // ((k + 1) * max(hidden, w2.shape[2])))  # tokens a call takes
    if t > step:  # ~116k tokens at LLaDA2.0-mini's widths: a prefill chunk that large, in parts
        parts = [fused_experts(x[i:i + step], w13, w2, topk_ids[i:i + step],
                               topk_weights[i:i + step], launches,
                               tuple(a[i:i + step] for a in addends), block_m, shared, norm)
                 for i in range(0, t, step)]
        if norm is None:
            return torch.cat(parts)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if shared is not None:
        check_shared(shared, w13, w2)
        if len(addends) > 1:
            raise ValueError(f"with a shared expert fused_experts adds at most one addend (the "
                             f"choice sum takes two: the shared expert's and it); got "
                             f"{len(addends)}")
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    blocks = expert_blocks(topk_ids, w2.shape[0], block_m)
    up, down = launches or choose_moe_launches(t * k)
    if shared is None:
        h = up_proj(x, w13, blocks, k, up)  # (A, I)
        y = down_proj(h, w2, blocks, down)  # (A, hidden)
        return sum_choices(y, topk_weights, x.dtype, addends, norm)
    h = up_proj(x, w13, blocks, k, up, shared[0].contiguous())  # (A + T, I)
    y = down_proj(h, w2, blocks, down, shared[1].contiguous(), t)  # (A + T, hidden)
    a = t * k
    return sum_choices(y[:a], topk_weights, x.dtype, (y[a:], *addends), norm)


def check_shared(shared: SharedExpert, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if not fuses_shared(shared, w13, w2):
        raise ValueError(f"a fused shared expert must have the routed experts' shapes "
                         f"{tuple(w13.shape[1:])}, {tuple(w2.shape[1:])} and dtypes "
                         f"{w13.dtype}, {w2.dtype}; got {tuple(shared[0].shape)}, "
                         f"{tuple(shared[1].shape)}, {shared[0].dtype}, {shared[1].dtype}")


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int | None = None
                  ) -> ExpertBlocks:
    """topk_ids (T, K) -> the assignments sorted by expert into blocks of `block_m` rows
    (default: choose_block_m's), or with no block_m asked and at most DIRECT_MAX_TOKENS
    tokens the direct layout (no sort; each row's ids distinct, as a top-k's are)."""
    if block_m is None and topk_ids.shape[0] <= moe_align.DIRECT_MAX_TOKENS:
        return direct_blocks(topk_ids, num_experts)
    align = sort_by_expert if sort_supports(num_experts) else align_by_expert
    return align(topk_ids, num_experts, block_m or choose_block_m(topk_ids.numel(), num_experts))


def up_proj(x: torch.Tensor, w13: torch.Tensor, blocks: ExpertBlocks, top_k: int,
            launch: MoeLaunch, shared: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, hidden), w13 (E, 2I, hidden), both contiguous -> h (A, I) in x.dtype, A = T * top_k:
    row a = silu(gate) * up of token a // top_k through its expert. With `shared` (2I, hidden)
    contiguous: h (A + T, I), row A + t = token t through it (cdiv(T, block_m) more blocks)."""
    t, hidden, inter = x.shape[0], x.shape[1], w13.shape[1] // 2
    a = t * top_k
    extra = 0 if shared is None else triton.cdiv(t, blocks.block_m)
    h = x.new_empty(a + (0 if shared is None else t), inter)
    all_blocks = blocks.max_blocks + extra
    def go(run: MoeLaunch) -> None:
        _up_kernel[(all_blocks * triton.cdiv(inter, run.block_n),)](
            x, w13, w13 if shared is None else shared, h, blocks.sorted_rows,
            blocks.block_expert, blocks.num_slots, w13.stride(0), blocks.max_blocks,
            all_blocks, a, t, hidden, inter, TOP_K=top_k, **launch_args(blocks, run))

    _run_fitting("up", blocks.block_m, launch, go)
    return h


def down_proj(h: torch.Tensor, w2: torch.Tensor, blocks: ExpertBlocks, launch: MoeLaunch,
              shared: torch.Tensor | None = None, tokens: int = 0) -> torch.Tensor:
    """h (A, I), w2 (E, hidden, I) contiguous -> y (A, hidden) in h.dtype: row a = h[a] through
    its expert's down projection (fp32 accumulation, rounded once). With `shared` (hidden, I)
    contiguous and `tokens` = T > 0: h (A + T, I) from up_proj's shared expert, y (A + T,
    hidden)."""
    if shared is not None and tokens <= 0:
        raise ValueError("down_proj with a shared expert needs its token count (h's last rows)")
    (rows, inter), hidden = h.shape, w2.shape[1]
    a = rows - (0 if shared is None else tokens)
    extra = 0 if shared is None else triton.cdiv(tokens, blocks.block_m)
    y = h.new_empty(rows, hidden)
    all_blocks = blocks.max_blocks + extra
    def go(run: MoeLaunch) -> None:
        _down_kernel[(all_blocks * triton.cdiv(hidden, run.block_n),)](
            h, w2, w2 if shared is None else shared, y, blocks.sorted_rows,
            blocks.block_expert, blocks.num_slots, w2.stride(0), blocks.max_blocks,
            all_blocks, a, rows - a, hidden, inter, **launch_args(blocks, run))

    _run_fitting("down", blocks.block_m, launch, go)
    return y


def fell_back(kernel: str, block_m: int, launch: MoeLaunch) -> bool:
    """True when `launch` of `kernel` ("up" / "down") at `block_m` did not fit the device and
    its calls ran DEFAULT_LAUNCH instead (benchmarks/moe_tune.py must not time it as itself)."""
    return launch_fit.fell_back((kernel, block_m), launch)


def _run_fitting(kernel: str, block_m: int, launch: MoeLaunch,
                 go: Callable[[MoeLaunch], None]) -> None:
    """go(launch), or go(DEFAULT_LAUNCH) when `launch` needs more shared memory than the device
    has at this BLOCK_M (the table is tuned at one model's shapes; kernels/launch_fit.py)."""
    launch_fit.run_fitting((kernel, block_m), (launch, DEFAULT_LAUNCH), go)


def launch_args(blocks: ExpertBlocks, launch: MoeLaunch) -> dict[str, int | bool]:
    return dict(BLOCK_M=blocks.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                BLOCK_MAJOR=launch.block_major, DIRECT_K=blocks.direct_top_k,
                DIRECT_KP=next_pow2(max(blocks.direct_top_k, 1)), DOT_F32=interpreted(),
                num_warps=launch.num_warps, num_stages=launch.num_stages)


@triton.jit
def _block_rows(SortedRows, BlockExpert, NumSlots, max_blocks, all_blocks, num_rows,
                num_shared, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_MAJOR: tl.constexpr, DIRECT_K: tl.constexpr, DIRECT_KP: tl.constexpr):
    """This program's tile: (its block's expert, -1 when unused; whether it is a block of the
    shared expert (those follow the max_blocks routed ones); rows of h / y; row validity;
    output columns (BLOCK_N,) of n_cols). The shared expert's rows are num_rows + t for its
    num_shared tokens t. BLOCK_MAJOR: program ids run a block's N tiles consecutively, then
    the next block's; else one N tile's blocks, then the next N tile's. Either way the blocks
    of one expert run side by side and share its weight tiles through L2. DIRECT_K > 0: the
    direct layout (ExpertBlocks), routed block e is expert e's (`_direct_rows`)."""
    if BLOCK_MAJOR:
        n_tiles = tl.cdiv(n_cols, BLOCK_N)
        block = tl.program_id(0) // n_tiles
        n_tile = tl.program_id(0) % n_tiles
    else:
        block = tl.program_id(0) % all_blocks
        n_tile = tl.program_id(0) // all_blocks
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    shared = block >= max_blocks
    m = tl.arange(0, BLOCK_M)
    if DIRECT_K > 0:
        expert, routed_rows = _direct_rows(SortedRows, block, num_rows, DIRECT_K, DIRECT_KP,
                                           BLOCK_M)
    else:
        routed = tl.minimum(block, max_blocks - 1)  # in bounds either way
        expert = tl.load(BlockExpert + routed)
        expert = tl.where(block * BLOCK_M < tl.load(NumSlots), expert, -1)
        routed_rows = tl.load(SortedRows + routed * BLOCK_M + m)
    expert = tl.where(shared, 0, expert)
    rows = tl.where(shared, num_rows + (block - max_blocks) * BLOCK_M + m,
                    routed_rows)  # (BLOCK_M,)
    valid = tl.where(shared, rows < num_rows + num_shared, rows < num_rows)
    return expert, shared, rows, valid, n


@triton.jit
def _direct_rows(Ids, expert, num_rows, K: tl.constexpr, KP: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """The direct layout's block of `expert`: (the expert, -1 when no token chose it; rows
    (BLOCK_M,): row m = token m's assignment m * K + j where ids[m, j] == expert, num_rows
    (padding) where token m did not choose it or is past the tokens)."""
    m = tl.arange(0, BLOCK_M)
    j = tl.arange(0, KP)
    at = m[:, None] * K + j[None, :]  # (BLOCK_M, KP)
    ids = tl.load(Ids + at, mask=(at < num_rows) & (j[None, :] < K), other=-1)
    pick = tl.max(tl.where(ids == expert, j[None, :], -1), 1)  # (BLOCK_M,) the choice, or -1
    rows = tl.where(pick >= 0, m * K + pick, num_rows)
    return tl.where(tl.max(pick, 0) >= 0, expert, -1), rows


@triton.jit
def _expert_weight(W, WShared, expert, shared, stride_we):
    """The block's weight: expert `expert` of W, or the shared expert's."""
    if shared:
        w = WShared
    else:
        w = W + expert.to(tl.int64) * stride_we
    return w


@triton.jit
def _up_kernel(X, W13, WShared, H, SortedRows, BlockExpert, NumSlots, stride_we, max_blocks,
               all_blocks, num_rows, num_tokens, hidden, inter, TOP_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_MAJOR: tl.constexpr, DIRECT_K: tl.constexpr, DIRECT_KP: tl.constexpr,
               DOT_F32: tl.constexpr):
    """h[a, n] = silu(x[a // TOP_K] . w13[e, n]) * (x[a // TOP_K] . w13[e, inter + n]); the
    shared expert's rows num_rows + t: the same of token t through WShared."""
    expert, shared, rows, valid, n = _block_rows(SortedRows, BlockExpert, NumSlots,
                                                 max_blocks, all_blocks, num_rows, num_tokens,
                                                 inter, BLOCK_M, BLOCK_N, BLOCK_MAJOR,
                                                 DIRECT_K, DIRECT_KP)
    if expert >= 0:
        n_ok = n < inter
        tokens = tl.where(rows < num_rows, rows // TOP_K, rows - num_rows)
        w = _expert_weight(W13, WShared, expert, shared, stride_we)
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            a = tl.load(X + tokens[:, None] * hidden + kk[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w + n[None, :] * hidden + kk[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w + (inter + n[None, :]) * hidden + kk[:, None], mask=w_mask,
                           other=0.0)  # (BLOCK_K, BLOCK_N)
            gate += dot(a, w_gate, DOT_F32)
            up += dot(a, w_up, DOT_F32)
        h = gate * tl.sigmoid(gate) * up
        tl.store(H + rows[:, None] * inter + n[None, :], h.to(H.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(H, W2, WShared, Y, SortedRows, BlockExpert, NumSlots, stride_we, max_blocks,
                 all_blocks, num_rows, num_shared, hidden, inter, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
                 DIRECT_K: tl.constexpr, DIRECT_KP: tl.constexpr, DOT_F32: tl.constexpr):
    """y[a, n] = h[a] . w2[e, n] (WShared for the shared expert's rows), accumulated in fp32,
    stored in Y's dtype."""
    expert, shared, rows, valid, n = _block_rows(SortedRows, BlockExpert, NumSlots,
                                                 max_blocks, all_blocks, num_rows, num_shared,
                                                 hidden, BLOCK_M, BLOCK_N, BLOCK_MAJOR,
                                                 DIRECT_K, DIRECT_KP)
    if expert >= 0:
        n_ok = n < hidden
        w = _expert_weight(W2, WShared, expert, shared, stride_we)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter
            a = tl.load(H + rows[:, None] * inter + kk[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            wt = tl.load(w + n[None, :] * inter + kk[:, None],
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
            acc += dot(a, wt, DOT_F32)
        tl.store(Y + rows[:, None] * hidden + n[None, :], acc.to(Y.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])
