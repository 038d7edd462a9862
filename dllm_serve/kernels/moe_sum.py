"""The MoE choice sum: each token's top-k expert rows weighted and summed in one pass, with a
decoder layer's addends (shared experts, residual) and the next layer's input norm fused
(kernels/fused_moe.py's final pass). Oracle: `layers.moe.moe_reference`'s combine, then
`add_in_order` and `layers.norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.norm import norm_warps, rms_norm_rows
from dllm_serve.kernels.runtime import next_pow2
from dllm_serve.layers.moe import NormParams

SUM_BLOCK = 1024  # hidden columns per program of the choice sum
# Warps of the choice sum with a norm (a whole row a program): one per 128 columns, up to 16. At
# LLaDA2.0-mini's 2048 columns 16 was the fastest of 1-16 at 32 / 128 / 512 tokens (2.33 / 2.68 /
# 4.45 us against 3.00 / 3.18 / 4.68 at 8; at 2048 25.9 against 27.4; the sum then the RMSNorm
# kernel 3.24 / 3.96 / 6.17 / 29.96 us): sumnorm_probe_188c17b.json. A narrower row (the built-in
# model's 256) leaves most of 16 warps without a column.
SUM_NORM_COLUMNS_PER_WARP = 128
SUM_NORM_MAX_WARPS = 16


def sum_choices(y: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype,
                addends: tuple[torch.Tensor, ...] = (), norm: NormParams | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y (T * K, hidden), topk_weights (T, K) -> (T, hidden) in dtype: each token's K rows
    times their weights, summed in fp32 in choice order (deterministic: no atomics), cast
    once. One pass over y; equal to `(y.view(T, K, hidden).float() * w[:, :, None]).sum(1)
    .to(dtype)` within fp32 rounding (moe_reference's combine). Then each of `addends` (at
    most two, (T, hidden) in dtype) is added in order, each sum rounded to dtype: exactly
    `add_in_order(sum, addends)` (a decoder layer's shared experts and residual, fused into
    this pass instead of two more kernels each reading and writing (T, hidden)). With `norm`
    (weight (hidden,), eps): (out, RMSNorm(out)), the norm computed as kernels/norm.py's (the
    next layer's input norm, or the model's final one, without a launch of its own); each
    program then takes a whole row."""
    (a, hidden), top_k = y.shape, topk_weights.shape[1]
    if len(addends) > 2:
        raise ValueError(f"sum_choices adds at most two tensors, got {len(addends)}")
    out = torch.empty(a // top_k, hidden, dtype=dtype, device=y.device)
    parts = [t.contiguous() for t in addends]
    assert all(t.shape == out.shape and t.dtype == dtype for t in parts)
    first, second = (parts + [out, out])[:2]  # unused pointers: never read
    weights = topk_weights.float().contiguous()
    if norm is None:
        block = min(SUM_BLOCK, next_pow2(hidden))
        _sum_kernel[(a // top_k, triton.cdiv(hidden, block))](
            y, weights, first, second, out, out, out, 0.0, hidden, TOP_K=top_k,
            ADDENDS=len(parts), BLOCK=block, NORM=False, num_warps=4)
        return out
    norm_weight, eps = norm
    if norm_weight.shape != (hidden,):
        raise ValueError(f"sum_choices: norm weight {tuple(norm_weight.shape)} must be "
                         f"({hidden},)")
    normed = torch.empty(a // top_k, hidden, dtype=torch.promote_types(dtype, norm_weight.dtype),
                         device=y.device)
    block = next_pow2(hidden)
    warps = norm_warps(block, SUM_NORM_COLUMNS_PER_WARP, SUM_NORM_MAX_WARPS)
    _sum_kernel[(a // top_k, 1)](
        y, weights, first, second, out, norm_weight, normed, eps, hidden, TOP_K=top_k,
        ADDENDS=len(parts), BLOCK=block, NORM=True, num_warps=warps)
    return out, normed


@triton.jit
def _sum_kernel(Y, Weights, A1, A2, Out, NormW, Normed, eps, hidden, TOP_K: tl.constexpr,
                ADDENDS: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    """out[t, n] = sum over j < TOP_K of weights[t, j] * y[t * TOP_K + j, n], in fp32, in j
    order, cast to out's dtype; then + a1[t, n] and + a2[t, n] (the first ADDENDS of them),
    each sum computed in fp32 and cast (as a PyTorch add of two tensors of that dtype).
    NORM (one program per row, BLOCK >= hidden): also normed[t] = RMSNorm(out[t]) with
    NormW (`rms_norm_rows`)."""
    tok = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = n < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(Weights + tok * TOP_K + j)
        acc += w * tl.load(Y + (tok * TOP_K + j) * hidden + n, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(Out.dtype.element_ty)
    if ADDENDS >= 1:
        out = (out.to(tl.float32) + tl.load(A1 + tok * hidden + n, mask=mask, other=0.0)
               .to(tl.float32)).to(Out.dtype.element_ty)
    if ADDENDS >= 2:
        out = (out.to(tl.float32) + tl.load(A2 + tok * hidden + n, mask=mask, other=0.0)
               .to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + tok * hidden + n, out, mask=mask)
    if NORM:
        normed = rms_norm_rows(out[None, :], NormW, n, hidden, eps)  # (1, BLOCK)
        tl.store(Normed + tok * hidden + n[None, :], normed.to(Normed.dtype.element_ty),
                 mask=mask[None, :])
