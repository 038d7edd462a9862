"""Fused routed experts (`--moe-backend triton`): device routing, then two grouped GEMMs.

1. `fused_route` picks experts and weights (kernels/moe_route.py);
2. `sort_by_expert` sorts the T*K assignments by expert into padded blocks (moe_sort.py; its
   oracle `align_by_expert`, moe_align.py, serves expert counts that are not powers of two);
3. `_up_kernel`: per (block, N tile) h = silu(x @ gate^T) * (x @ up^T) for the block's
   assignments, x rows gathered by token, SiLU-and-mul in the epilogue -> h (A, I);
4. `_down_kernel`: per (block, N tile) y = (h @ down^T) * routing weight -> (A, hidden) fp32;
5. the K choices of each token are summed in fp32 (torch), cast to x.dtype.
Program ids run the blocks of one N tile consecutively, so the blocks of one expert (same
weight tile) run side by side and share it through L2: each selected expert's weights come from
memory about once per projection. Oracle: `layers.moe.route` + `moe_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.moe_align import align_by_expert, choose_block_m
from dllm_serve.kernels.moe_route import fused_route
from dllm_serve.kernels.moe_route import supports as route_supports
from dllm_serve.kernels.moe_sort import sort_by_expert
from dllm_serve.kernels.moe_sort import supports as sort_supports
from dllm_serve.kernels.runtime import check_device, interpreted
from dllm_serve.kernels.triton_utils import dot
from dllm_serve.layers.moe import MOE_BACKENDS, RoutingParams, route

BLOCK_N = 64
BLOCK_K = 64


@MOE_BACKENDS.register("triton")
def triton_moe(x: torch.Tensor, router_logits: torch.Tensor, expert_bias: torch.Tensor | None,
               p: RoutingParams, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The MOE_BACKENDS "triton" entry: fused routing (where its shapes allow) + fused experts."""
    routing = fused_route if route_supports(router_logits.shape[1], p) else route
    topk_ids, topk_weights = routing(router_logits, expert_bias, p)
    return fused_experts(x, w13, w2, topk_ids, topk_weights)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """x (T, hidden), w13 (E, 2I, hidden), w2 (E, hidden, I), topk_ids/topk_weights (T, K)
    -> (T, hidden) in x.dtype; equal to `moe_reference` within rounding."""
    check_device(x, "fused_experts")
    t, k = topk_ids.shape
    e, hidden, inter = w2.shape
    if t == 0:
        return x.new_zeros(0, hidden)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    align = sort_by_expert if sort_supports(e) else align_by_expert
    blocks = align(topk_ids, e, choose_block_m(t * k, e))
    h = x.new_empty(t * k, inter)  # (A, I)
    y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)  # (A, hidden)
    common = dict(BLOCK_M=blocks.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                  DOT_F32=interpreted(), num_warps=4, num_stages=3)
    _up_kernel[(blocks.max_blocks * triton.cdiv(inter, BLOCK_N),)](
        x, w13, h, blocks.sorted_rows, blocks.block_expert, blocks.num_slots,
        w13.stride(0), blocks.max_blocks, t * k, hidden, inter, TOP_K=k, **common)
    _down_kernel[(blocks.max_blocks * triton.cdiv(hidden, BLOCK_N),)](
        h, w2, y, topk_weights.float().contiguous(), blocks.sorted_rows, blocks.block_expert,
        blocks.num_slots, w2.stride(0), blocks.max_blocks, t * k, hidden, inter, **common)
    return y.view(t, k, hidden).sum(1).to(x.dtype)


@triton.jit
def _block_rows(SortedRows, BlockExpert, NumSlots, max_blocks, num_rows,
                BLOCK_M: tl.constexpr):
    """This program's block: (expert or -1 when unused, assignment rows, row validity)."""
    block = tl.program_id(0) % max_blocks
    expert = tl.load(BlockExpert + block)
    expert = tl.where(block * BLOCK_M < tl.load(NumSlots), expert, -1)
    rows = tl.load(SortedRows + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    return expert, rows, rows < num_rows


@triton.jit
def _up_kernel(X, W13, H, SortedRows, BlockExpert, NumSlots, stride_we, max_blocks, num_rows,
               hidden, inter, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """h[a, n] = silu(x[a // TOP_K] . w13[e, n]) * (x[a // TOP_K] . w13[e, inter + n])."""
    expert, rows, valid = _block_rows(SortedRows, BlockExpert, NumSlots, max_blocks, num_rows,
                                      BLOCK_M)
    if expert >= 0:
        n = (tl.program_id(0) // max_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        n_ok = n < inter
        tokens = rows // TOP_K
        w = W13 + expert.to(tl.int64) * stride_we
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
def _down_kernel(H, W2, Y, Weights, SortedRows, BlockExpert, NumSlots, stride_we, max_blocks,
                 num_rows, hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """y[a, n] = weight[a] * (h[a] . w2[e, n]), fp32."""
    expert, rows, valid = _block_rows(SortedRows, BlockExpert, NumSlots, max_blocks, num_rows,
                                      BLOCK_M)
    if expert >= 0:
        n = (tl.program_id(0) // max_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        n_ok = n < hidden
        w = W2 + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter
            a = tl.load(H + rows[:, None] * inter + kk[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            wt = tl.load(w + n[None, :] * inter + kk[:, None],
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
            acc += dot(a, wt, DOT_F32)
        acc = acc * tl.load(Weights + rows, mask=valid, other=0.0)[:, None]
        tl.store(Y + rows[:, None] * hidden + n[None, :], acc, mask=valid[:, None] & n_ok[None, :])
