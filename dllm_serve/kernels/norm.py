"""Fused RMSNorm and residual add + RMSNorm (NORM_KERNELS "triton"); oracle `layers.norm`.

One pass per row: the residual add (rounded to the input dtype, as torch's add is), the fp32
mean of squares, the normalised value cast back to the input dtype, then the weight. Rows are
contiguous in their last dim; ROWS rows per program (1 on the GPU, where a row of 2048 fills
the program; many in the interpreter, where each program costs a Python loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import as_rows, check_device, interpreted, next_pow2
from dllm_serve.layers.norm import NORM_KERNELS


@NORM_KERNELS.register("triton")
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x (..., dim) -> RMSNorm(x); with residual: (RMSNorm(residual + x), residual + x)."""
    check_device(x, "fused_rms_norm")
    shape, dim = x.shape, x.shape[-1]
    xs = as_rows(x)
    n = xs.shape[0]
    out = torch.empty(n, dim, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res = as_rows(residual) if residual is not None else xs
    h = torch.empty_like(xs) if residual is not None else xs
    if n:
        rows = 1 if not interpreted() else min(next_pow2(n), 32)
        block = next_pow2(dim)
        _rms_norm_kernel[(triton.cdiv(n, rows),)](
            xs, res, weight, out, h, n, xs.stride(0), res.stride(0), h.stride(0), eps, N=dim,
            BLOCK_N=block, ROWS=rows, HAS_RESIDUAL=residual is not None,
            num_warps=norm_warps(block))
    if residual is None:
        return out.view(shape)
    return out.view(shape), h.view(shape)


@triton.jit
def _rms_norm_kernel(X, Res, W, Out, H, n_rows, stride_x, stride_r, stride_h, eps,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    c = tl.arange(0, BLOCK_N)
    mask = (r < n_rows)[:, None] & (c < N)[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(Res + r64[:, None] * stride_r + c[None, :], mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + r64[:, None] * stride_h + c[None, :], x, mask=mask)
    out = rms_norm_rows(x, W, c, N, eps)
    tl.store(Out + r64[:, None] * N + c[None, :], out.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_rows(x, W, c, N, eps):
    """x (ROWS, BLOCK_N) in the input dtype, 0 in columns c >= N -> (ROWS, BLOCK_N) fp32:
    the fp32 mean of squares, the normalised value cast back to x's dtype, times the weight
    W[c] (to be cast to the output dtype). The one RMSNorm of the kernels here and of the MoE
    choice sum's fused norm (moe_sum.py)."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)  # (ROWS,)
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
    return normed * w[None, :]


def norm_warps(block: int, columns_per_warp: int = 256, most: int = 8) -> int:
    """Warps of a program normalising one row of `block` columns: one per `columns_per_warp`,
    1 to `most`."""
    return max(1, min(most, block // columns_per_warp))
