"""Attention for training: no KV cache, one dense mask per batch, SDPA.

The model hands every layer's q (T, H, D) and k, v (T, KVH, D) to `fb.attn.forward`, with T =
R * N tokens of R equally long rows; this backend attends within each row under the boolean
mask (R, 1, N, N) that `training_batch` stores in `fb.attn_meta` (built by
objective.bd3_mask from the same block-causal predicate as the engine's attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_serve.layers.attention import AttentionBackend
from dllm_serve.model.forward_batch import ForwardBatch


class TrainingAttention(AttentionBackend):
    """Same `forward` contract as the engine's backends; stores nothing (there is no cache)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float) -> None:
        # No KVCache: `store` is never called, so the base class's cache stays unset.
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale

    def prepare(self, fb: ForwardBatch) -> None:
        """Nothing to plan: the mask arrives ready in fb.attn_meta."""

    def kv_target(self, layer_id: int, fb: ForwardBatch) -> None:
        """No cache: a fused kernel stores nothing."""
        return None

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, stored: bool = False) -> torch.Tensor:
        mask: torch.Tensor = fb.attn_meta  # (R, 1, N, N) bool
        rows, n = mask.shape[0], mask.shape[-1]
        dtype = v.dtype  # bf16 under autocast: q and k leave the fp32 qk-norm/RoPE in fp32

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.to(dtype).view(rows, n, -1, self.head_dim).transpose(1, 2)  # (R, h, N, D)

        qs, ks, vs = heads(q), heads(k), heads(v)
        rep = self.num_heads // ks.shape[1]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2).reshape(rows * n, self.num_heads * self.head_dim)


def training_batch(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                   attn: TrainingAttention, block_size: int) -> ForwardBatch:
    """ids, positions (R, N) and mask (R, 1, N, N) -> a ForwardBatch of R segments of N tokens.

    The cache fields are empty: the model only reads input_ids, positions and attn.
    """
    rows, n = ids.shape
    dev = ids.device
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    return ForwardBatch(
        input_ids=ids.reshape(-1), positions=positions.reshape(-1), out_cache_loc=empty,
        req_slots=torch.arange(rows, device=dev), seg_starts=torch.zeros_like(ids[:, 0]),
        seg_lens=torch.full((rows,), n, device=dev), block_size=block_size, attn=attn,
        seg_starts_cpu=[0] * rows, seg_lens_cpu=[n] * rows, attn_meta=mask)
