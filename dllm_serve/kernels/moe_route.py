"""The MoE router on the device in one launch: scores, grouped top-k, combine weights.

Computes exactly `layers.moe.route` (the oracle): scores = sigmoid(logits) (or softmax);
selection ranks scores + expert_bias, limited to each token's `topk_group` best groups (a
group's score is the sum of its two best biased scores); the combine weights are the unbiased
scores of the chosen experts, renormalised to sum 1 when asked, times the scaling factor.
BLOCK_T tokens per program; experts are picked best first by repeated argmax (ties: lowest
index), so ids come out in the same order as `torch.topk`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import check_device, interpreted, next_pow2
from dllm_serve.layers.moe import RoutingParams

BLOCK_T = 16  # tokens per program on the GPU


def supports(num_experts: int, p: RoutingParams) -> bool:
    """Shapes this kernel handles (power-of-two experts and groups of >= 2 experts)."""
    groups = max(p.n_group, 1)
    return (num_experts == next_pow2(num_experts) and groups == next_pow2(groups)
            and (p.n_group == 0 or num_experts // groups >= 2))


def fused_route(logits: torch.Tensor, expert_bias: torch.Tensor | None, p: RoutingParams
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) fp32, expert_bias (E,) or None -> topk_ids (T, K) int64,
    topk_weights (T, K) fp32; equal to `layers.moe.route`."""
    check_device(logits, "fused_route")
    t, e = logits.shape
    if not supports(e, p):
        raise ValueError(f"fused_route supports power-of-two experts and groups; got {e} "
                         f"experts in {p.n_group} groups")
    logits = logits.float().contiguous()
    ids = torch.empty(t, p.top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, p.top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    bias = logits if expert_bias is None else expert_bias.float().contiguous()
    block_t = min(next_pow2(t), 64) if interpreted() else BLOCK_T
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, ids, weights, t, p.scaling, E=e, N_GROUP=max(p.n_group, 1),
        TOPK_GROUP=p.topk_group if p.n_group else 1, TOP_K=p.top_k,
        BLOCK_K=next_pow2(p.top_k), BLOCK_T=block_t, SIGMOID=p.score_function == "sigmoid",
        HAS_BIAS=expert_bias is not None, RENORM=p.renormalize and p.top_k > 1, num_warps=4)
    return ids, weights


@triton.jit
def _column(x, col, j):
    """x (R, C), col (C,) -> x[:, j] (R,)."""
    return tl.sum(tl.where(col[None, :] == j, x, 0), 1)


@triton.jit
def _group_keep(choice, BLOCK_T: tl.constexpr, E: tl.constexpr, N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr):
    """(BLOCK_T, E) biased scores -> (BLOCK_T, E) bool: the expert is in one of its token's
    TOPK_GROUP best groups (a group's score: the sum of its two best scores)."""
    e = tl.arange(0, E)
    g = tl.arange(0, N_GROUP)
    group_of = e // (E // N_GROUP)  # (E,)
    group_score = tl.zeros([BLOCK_T, N_GROUP], tl.float32)
    for j in tl.static_range(N_GROUP):
        inside = tl.where(group_of[None, :] == j, choice, float("-inf"))
        best = tl.argmax(inside, 1)
        second = tl.max(tl.where(e[None, :] == best[:, None], float("-inf"), inside), 1)
        group_score = tl.where(g[None, :] == j, (tl.max(inside, 1) + second)[:, None],
                               group_score)
    keep = tl.zeros([BLOCK_T, N_GROUP], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.argmax(group_score, 1)  # (BLOCK_T,)
        keep = tl.where(g[None, :] == top[:, None], 1, keep)
        group_score = tl.where(g[None, :] == top[:, None], float("-inf"), group_score)
    kept = tl.zeros([BLOCK_T, E], tl.int32)
    for j in tl.static_range(N_GROUP):
        kept = tl.where(group_of[None, :] == j, _column(keep, g, j)[:, None], kept)
    return kept > 0


@triton.jit
def _route_kernel(Logits, Bias, Ids, Weights, num_tokens, scaling, E: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    t_ok = t < num_tokens
    e = tl.arange(0, E)
    x = tl.load(Logits + t[:, None] * E + e[None, :], mask=t_ok[:, None], other=0.0)
    if SIGMOID:
        scores = tl.sigmoid(x)  # (BLOCK_T, E)
    else:
        z = tl.exp(x - tl.max(x, 1)[:, None])
        scores = z / tl.sum(z, 1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(Bias + e)[None, :]
    if N_GROUP > 1:
        keep = _group_keep(choice, BLOCK_T, E, N_GROUP, TOPK_GROUP)
        choice = tl.where(keep, choice, float("-inf"))
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        top = tl.argmax(choice, 1)  # (BLOCK_T,)
        picked = e[None, :] == top[:, None]  # (BLOCK_T, E)
        ids = tl.where(k[None, :] == i, top[:, None], ids)
        weights = tl.where(k[None, :] == i, tl.sum(tl.where(picked, scores, 0.0), 1)[:, None],
                           weights)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
    out = t[:, None] * TOP_K + k[None, :]
    mask = t_ok[:, None] & (k[None, :] < TOP_K)
    tl.store(Ids + out, ids.to(tl.int64), mask=mask)
    tl.store(Weights + out, weights * scaling, mask=mask)
