"""Fused per-head RMSNorm + partial NeoX RoPE on q and k, in place (QK_ROPE_KERNELS "triton").

Oracle: `models.decoder.SelfAttention.norm_rope`'s plain path (RMSNorm of each head, then
`apply_rotary`).
Each program takes ROWS tokens x every head: the head's fp32 statistics, the normalised value
cast to the input dtype times its weight (q heads use the q weight, k heads the k weight), then
the rotation of dims [0, R) in fp32 with the model's cos/sin tables, rounded once. The partner
element of the rotation (d +- R/2) is loaded a second time rather than shuffled in registers.
When k follows q in one buffer (the fused QKV projection's output) one launch covers both.
Given a `KvTarget` the launch that holds k also stores k (as rotated, in the cache dtype) and v
into the paged cache at each token's slot: exactly `AttentionBackend.store`'s writes, without a
launch of their own (kernels/kv_store.py's, ~1.5 us a layer at a denoise round's few rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import check_device, interpreted, next_pow2
from dllm_serve.layers.attention import KvTarget
from dllm_serve.layers.rotary import QK_ROPE_KERNELS


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads directly follow q's in the same buffer, with the same strides."""
    return (q.stride() == k.stride() and q.dtype == k.dtype
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())


@QK_ROPE_KERNELS.register("triton")
def fused_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, v: torch.Tensor | None = None,
                       target: KvTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k (T, KVH, D) (unit stride in D), cos/sin (T, R) -> (q, k), written in
    place: RMSNorm per head when weights are given, then RoPE on dims [0, R). With v (T, KVH,
    D) and a target: also k_cache[loc[t]] = k[t] (the result) and v_cache[loc[t]] = v[t]."""
    check_device(q, "fused_qk_norm_rope")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("fused_qk_norm_rope needs unit stride in the head dim")
    store = None
    if target is not None:
        if v is None:
            raise ValueError("fused_qk_norm_rope stores k and v: give v with the target")
        store = (v if v.stride(-1) == 1 else v.contiguous(), target)
    cos, sin = cos.contiguous(), sin.contiguous()
    if _adjacent(q, k):
        _launch(q, q.shape[1] + k.shape[1], q.shape[1], q_weight, k_weight, eps, cos, sin, store)
    else:
        _launch(q, q.shape[1], q.shape[1], q_weight, k_weight, eps, cos, sin)
        _launch(k, k.shape[1], 0, q_weight, k_weight, eps, cos, sin, store)
    return q, k


def _launch(x: torch.Tensor, heads: int, q_heads: int, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
            sin: torch.Tensor, store: tuple[torch.Tensor, KvTarget] | None = None) -> None:
    """Heads [0, heads) of x's buffer; the first q_heads use q_weight, the rest (k heads)
    k_weight. `store` (v, target): the k heads and v go into the target's caches."""
    t, d, r = x.shape[0], x.shape[2], cos.shape[1]
    if t == 0:
        return
    if d != next_pow2(d) or r % 2 or r > d:
        raise ValueError(f"fused_qk_norm_rope: head_dim {d} must be a power of two and "
                         f"rotary_dim {r} even and <= head_dim")
    norm = q_weight is not None
    rows = 1 if not interpreted() else min(next_pow2(t), 16)
    v, (k_cache, v_cache, loc) = store if store is not None else (x, (x, x, x))
    kv_heads = heads - q_heads
    if store is not None and (v.shape != (t, kv_heads, d) or k_cache.shape[1:] != (kv_heads, d)
                              or k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1):
        raise ValueError(f"fused_qk_norm_rope: v {tuple(v.shape)} and caches "
                         f"{tuple(k_cache.shape)} must hold {kv_heads} heads of {d}, the caches "
                         f"alike with unit stride in the head dim")
    _qk_norm_rope_kernel[(triton.cdiv(t, rows),)](
        x, q_weight if norm else x, k_weight if norm else x, cos, sin, v, k_cache, v_cache, loc,
        t, x.stride(0), x.stride(1), cos.stride(0), v.stride(0), v.stride(1), k_cache.stride(0),
        k_cache.stride(1), eps, NQ=q_heads, NH=heads, D=d, R=r, BLOCK_H=next_pow2(heads),
        BLOCK_KV=next_pow2(max(kv_heads, 1)), ROWS=rows, NORM=norm, STORE=store is not None,
        num_warps=4)


@triton.jit
def _normed(x, rstd, w, dtype: tl.constexpr):
    """RMSNorm's rounding steps: (x * rstd) in the input dtype, times the weight, rounded."""
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _qk_norm_rope_kernel(X, QW, KW, Cos, Sin, V, KCache, VCache, Loc, n_tokens, stride_t,
                         stride_h, stride_c, stride_vt, stride_vh, stride_ct, stride_ch, eps,
                         NQ: tl.constexpr, NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, ROWS: tl.constexpr,
                         NORM: tl.constexpr, STORE: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    partner = tl.where(d < R // 2, d + R // 2, tl.where(d < R, d - R // 2, d))  # (D,)
    mask = (t < n_tokens)[:, None, None] & (h < NH)[None, :, None] & (d < D)[None, None, :]
    base = X + t.to(tl.int64)[:, None, None] * stride_t + h[None, :, None] * stride_h
    x = tl.load(base + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 2) / D + eps)[:, :, None]  # (ROWS, BLOCK_H, 1)
        is_q = (h < NQ)[None, :, None]
        w = tl.where(is_q, tl.load(QW + d)[None, None, :], tl.load(KW + d)[None, None, :])
        wp = tl.where(is_q, tl.load(QW + partner)[None, None, :],
                      tl.load(KW + partner)[None, None, :])
        x = _normed(x, rstd, w.to(tl.float32), X.dtype.element_ty)
        xp = _normed(xp, rstd, wp.to(tl.float32), X.dtype.element_ty)
    in_rot = (d < R)[None, None, :]
    trig = t.to(tl.int64)[:, None, None] * stride_c + tl.where(d < R, d, 0)[None, None, :]
    c_mask = (t < n_tokens)[:, None, None] & in_rot
    c = tl.load(Cos + trig, mask=c_mask, other=1.0).to(tl.float32)
    s = tl.load(Sin + trig, mask=c_mask, other=0.0).to(tl.float32)
    rot = tl.where((d < R // 2)[None, None, :], x * c - xp * s, x * c + xp * s)
    out = tl.where(in_rot, rot, x).to(X.dtype.element_ty)
    tl.store(base + d[None, None, :], out, mask=mask)
    if STORE:
        _store_kv_rows(out, V, KCache, VCache, Loc, t, h - NQ, d, n_tokens, stride_vt, stride_vh,
                       stride_ct, stride_ch, mask & (h >= NQ)[None, :, None], NH - NQ, BLOCK_KV,
                       D)


@triton.jit
def _store_kv_rows(k, V, KCache, VCache, Loc, t, kh, d, n_tokens, stride_vt, stride_vh,
                   stride_ct, stride_ch, k_mask, NKV: tl.constexpr, BLOCK_KV: tl.constexpr,
                   D: tl.constexpr):
    """k (ROWS, BLOCK_H, D) in X's dtype, its kv head kh (BLOCK_H,) valid where k_mask, into
    k_cache[loc[t], kh]; v[t] (NKV heads) into v_cache[loc[t]]; both cast to the cache dtype."""
    t_ok = t < n_tokens
    slot = tl.load(Loc + t, mask=t_ok, other=0).to(tl.int64)[:, None, None]  # (ROWS, 1, 1)
    at = slot * stride_ct + d[None, None, :]
    tl.store(KCache + at + tl.maximum(kh, 0)[None, :, None] * stride_ch,
             k.to(KCache.dtype.element_ty), mask=k_mask)
    vh = tl.arange(0, BLOCK_KV)
    v_mask = t_ok[:, None, None] & (vh < NKV)[None, :, None] & (d < D)[None, None, :]
    v = tl.load(V + t.to(tl.int64)[:, None, None] * stride_vt + vh[None, :, None] * stride_vh
                + d[None, None, :], mask=v_mask)
    tl.store(VCache + at + vh[None, :, None] * stride_ch, v.to(VCache.dtype.element_ty),
             mask=v_mask)
