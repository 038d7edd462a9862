"""K and V of every token into the paged cache in one launch (the Triton attention's store,
when the q/k norm + RoPE kernel did not store them: kernels/rope.py, the served path, does).

Oracle: `AttentionBackend.store` (two index_puts): k_cache[loc[t], h] = k[t, h] and the same
for v, cast to the cache dtype. k and v may be strided views (heads of the fused QKV buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import check_device, interpreted, next_pow2


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k, v (T, KVH, D) with unit stride in D; caches (slots, KVH, D) contiguous; loc (T,)."""
    check_device(k, "store_kv")
    t, kvh, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    rows = 1 if not interpreted() else min(next_pow2(t), 32)
    _store_kv_kernel[(triton.cdiv(t, rows),)](
        k, v, k_cache, v_cache, loc, t, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), KVH=kvh, D=d, BLOCK_H=next_pow2(kvh),
        BLOCK_D=next_pow2(d), ROWS=rows, num_warps=2)


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, Loc, n_tokens, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_ct, stride_ch, KVH: tl.constexpr, D: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < n_tokens
    mask = t_ok[:, None, None] & (h < KVH)[None, :, None] & (d < D)[None, None, :]
    t64 = t.to(tl.int64)[:, None, None]
    slot = tl.load(Loc + t, mask=t_ok, other=0).to(tl.int64)[:, None, None]
    dst = slot * stride_ct + h[None, :, None] * stride_ch + d[None, None, :]
    k = tl.load(K + t64 * stride_kt + h[None, :, None] * stride_kh + d[None, None, :], mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    v = tl.load(V + t64 * stride_vt + h[None, :, None] * stride_vh + d[None, None, :], mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)
