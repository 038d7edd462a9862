"""The MoE router on the device in one launch: scores, grouped top-k, combine weights.

Computes exactly `layers.moe_router.route` (the oracle) of the logits, which may come as P partial
sums (T, P, E) (the Router's split GEMM: P = 3): the kernel adds them in fp32 in part order,
the order of `layers.moe_router.sum_logit_parts` (torch's sum over the parts; bit for bit, tested),
instead of a reduction launch of its own (~4 us per MoE layer at batch size 1 on an H200).
Then scores = sigmoid(logits) (or softmax); selection ranks scores + expert_bias, limited to
each token's `topk_group` best groups (a group's score is the sum of its two best biased
scores); the combine weights are the unbiased scores of the chosen experts, renormalised to
sum 1 when asked, times the scaling factor.
Experts are picked best first by repeated argmax (ties: lowest index), so ids come out in the
same order as `torch.topk`'s.

Speed. The work is a chain of small reductions per token (two per group score, one per picked
group, one per picked expert), so latency, not bandwidth, bounds it. On the GPU each program
takes one token in one warp: every reduction is a few warp shuffles, and 512-2048 programs run
in one wave. The scores are held as (tokens, groups, experts per group) so that both group
reductions are single passes, and the combine weights are gathered back from the logits (its
P parts, summed again in the same order) by expert id instead of one more reduction per pick.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import check_device, interpreted, next_pow2
from dllm_serve.layers.moe_router import RoutingParams

GPU_TOKENS_PER_PROGRAM = 1
GPU_WARPS = 1


def supports(num_experts: int, p: RoutingParams) -> bool:
    """Shapes this kernel handles (power-of-two experts and groups of >= 2 experts)."""
    groups = max(p.n_group, 1)
    return (num_experts == next_pow2(num_experts) and groups == next_pow2(groups)
            and (p.n_group == 0 or num_experts // groups >= 2))


def fused_route(logits: torch.Tensor, expert_bias: torch.Tensor | None, p: RoutingParams
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E), or (T, P, E) partial logits (fp32 when P > 1), expert_bias (E,) or None
    -> topk_ids (T, K) int64, topk_weights (T, K) fp32; equal to
    `layers.moe_router.route(sum_logit_parts(logits))`."""
    check_device(logits, "fused_route")
    parts = (logits if logits.dim() == 3 else logits[:, None]).contiguous()  # (T, P, E)
    t, num_parts, e = parts.shape
    if not supports(e, p):
        raise ValueError(f"fused_route supports power-of-two experts and groups; got {e} "
                         f"experts in {p.n_group} groups")
    if num_parts > 1 and parts.dtype != torch.float32:
        raise ValueError(f"partial router logits must be fp32 (torch sums {parts.dtype} parts "
                         f"with a rounding each); got {num_parts} parts")
    ids = torch.empty(t, p.top_k, dtype=torch.int64, device=parts.device)
    weights = torch.empty(t, p.top_k, dtype=torch.float32, device=parts.device)
    if t == 0:
        return ids, weights
    bias = parts if expert_bias is None else expert_bias.contiguous()  # cast in the kernel
    block_t = min(next_pow2(t), 64) if interpreted() else GPU_TOKENS_PER_PROGRAM
    groups = max(p.n_group, 1)
    _route_kernel[(triton.cdiv(t, block_t),)](
        parts, bias, ids, weights, t, p.scaling, E=e, PARTS=num_parts, N_GROUP=groups,
        GROUP=e // groups, TOPK_GROUP=p.topk_group if p.n_group else 1, TOP_K=p.top_k,
        BLOCK_K=next_pow2(p.top_k), BLOCK_T=block_t, SIGMOID=p.score_function == "sigmoid",
        HAS_BIAS=expert_bias is not None, RENORM=p.renormalize and p.top_k > 1,
        num_warps=GPU_WARPS)
    return ids, weights


@triton.jit
def _logits_at(Parts, t, expert, mask, E: tl.constexpr, PARTS: tl.constexpr):
    """Token t's logits of `expert` (broadcast shapes): its PARTS partial logits (T, PARTS, E)
    summed in fp32 in part order (0 where masked)."""
    at = Parts + t * (PARTS * E) + expert
    x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(1, PARTS):
        x += tl.load(at + i * E, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _keep_best_groups(choice, N_GROUP: tl.constexpr, GROUP: tl.constexpr,
                      TOPK_GROUP: tl.constexpr):
    """choice (BLOCK_T, N_GROUP, GROUP) -> the same with -inf outside each token's TOPK_GROUP
    best groups (a group's score: the sum of its two best values)."""
    s = tl.arange(0, GROUP)
    g = tl.arange(0, N_GROUP)
    best = tl.argmax(choice, 2)  # (BLOCK_T, N_GROUP)
    second = tl.max(tl.where(s[None, None, :] == best[:, :, None], float("-inf"), choice), 2)
    group_score = tl.max(choice, 2) + second
    keep = tl.zeros_like(best)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.argmax(group_score, 1)  # (BLOCK_T,)
        hit = g[None, :] == top[:, None]
        keep = tl.where(hit, 1, keep)
        group_score = tl.where(hit, float("-inf"), group_score)
    return tl.where(keep[:, :, None] > 0, choice, float("-inf"))


@triton.jit
def _route_kernel(Parts, Bias, Ids, Weights, num_tokens, scaling, E: tl.constexpr,
                  PARTS: tl.constexpr, N_GROUP: tl.constexpr, GROUP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORM: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    t_ok = t < num_tokens
    expert = tl.arange(0, N_GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (G, S)
    x = _logits_at(Parts, t[:, None, None], expert[None, :, :], t_ok[:, None, None], E,
                   PARTS)  # (BLOCK_T, N_GROUP, GROUP)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        top = tl.max(tl.max(x, 2), 1)  # (BLOCK_T,)
        den = tl.sum(tl.sum(tl.exp(x - top[:, None, None]), 2), 1)
        scores = tl.exp(x - top[:, None, None]) / den[:, None, None]
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(Bias + expert).to(tl.float32)[None, :, :]
    if N_GROUP > 1:
        choice = _keep_best_groups(choice, N_GROUP, GROUP, TOPK_GROUP)
    flat = tl.reshape(choice, (BLOCK_T, E))
    e = tl.arange(0, E)
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        pick = tl.argmax(flat, 1)  # (BLOCK_T,)
        ids = tl.where(k[None, :] == i, pick[:, None], ids)
        flat = tl.where(e[None, :] == pick[:, None], float("-inf"), flat)
    mask = t_ok[:, None] & (k[None, :] < TOP_K)
    picked = _logits_at(Parts, t[:, None], ids, mask, E, PARTS)  # (BLOCK_T, BLOCK_K)
    if SIGMOID:
        weights = tl.sigmoid(picked)
    else:
        weights = tl.exp(picked - top[:, None]) / den[:, None]
    weights = tl.where(mask, weights, 0.0)
    if RENORM:
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
    out = t[:, None] * TOP_K + k[None, :]
    tl.store(Ids + out, ids.to(tl.int64), mask=mask)
    tl.store(Weights + out, weights * scaling, mask=mask)
