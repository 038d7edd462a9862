"""Attention for block diffusion: the mask predicate, the backend interface, and the reference.

The mask is written once, here, as a predicate over absolute positions of one request:
a query at position q sees a key at position k iff `k // block_size <= q // block_size`
(its own block bidirectionally and every earlier block), and only keys that exist
(k < seg_start + seg_len). Every fast kernel is tested against `TorchAttention`, which
builds its mask from this same predicate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.utils.registry import Registry


def block_causal(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """True where a query at q_pos may attend to a key at k_pos (same request)."""
    return torch.div(k_pos, block_size, rounding_mode="floor") <= torch.div(
        q_pos, block_size, rounding_mode="floor")


class KvTarget(NamedTuple):
    """Where one layer's new K/V go: k_cache, v_cache (slots, KVH, D), loc (T,) each token's
    slot. A fused kernel that writes them (the Triton q/k norm + RoPE) takes this."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    loc: torch.Tensor


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the cache (unless a fused kernel already did, through
    `kv_target`), then attends through the page table."""

    def __init__(self, kv: KVCache, num_heads: int, head_dim: int, scale: float) -> None:
        self.kv = kv
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build per-forward metadata into `fb.attn_meta` (once per forward, not per layer)."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, stored: bool = False) -> torch.Tensor:
        """q (T, H, D), k and v (T, KVH, D) -> (T, H * D). Stores k, v at fb.out_cache_loc
        first, unless `stored` (a kernel wrote them to `kv_target`'s places)."""

    def kv_target(self, layer_id: int, fb: ForwardBatch) -> KvTarget | None:
        """Where `store` puts layer `layer_id`'s new K/V, for a kernel that writes them (then
        `forward(..., stored=True)`); None: nothing to store."""
        return KvTarget(self.kv.k[layer_id], self.kv.v[layer_id], fb.out_cache_loc)

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> None:
        self.kv.k[layer_id][fb.out_cache_loc] = k.to(self.kv.k[layer_id].dtype)
        self.kv.v[layer_id][fb.out_cache_loc] = v.to(self.kv.v[layer_id].dtype)


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend")


@dataclass
class PaddedMeta:
    q_index: torch.Tensor  # (S, Qmax) token row of each query; padding points at row 0
    q_valid: torch.Tensor  # (S, Qmax) bool
    k_slot: torch.Tensor  # (S, Kmax) KV slot of each key position; padding points at slot 0
    mask: torch.Tensor  # (S, 1, Qmax, Kmax) bool, from `block_causal`


@ATTENTION_BACKENDS.register("torch")
class TorchAttention(AttentionBackend):
    """Plain PyTorch reference: pad segments to (S, Qmax) x (S, Kmax) and run SDPA."""

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn_meta = build_padded_meta(fb, self.kv)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, stored: bool = False) -> torch.Tensor:
        if not stored:
            self.store(layer_id, k, v, fb)
        meta: PaddedMeta = fb.attn_meta
        qs = q[meta.q_index].transpose(1, 2)  # (S, H, Qmax, D)
        ks = self.kv.k[layer_id][meta.k_slot].transpose(1, 2).to(q.dtype)  # (S, KVH, Kmax, D)
        vs = self.kv.v[layer_id][meta.k_slot].transpose(1, 2).to(q.dtype)
        rep = self.num_heads // ks.shape[1]
        if rep > 1:
            ks = ks.repeat_interleave(rep, dim=1)
            vs = vs.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.mask, scale=self.scale)
        out = out.transpose(1, 2).flatten(2)  # (S, Qmax, H * D)
        result = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        result[meta.q_index[meta.q_valid]] = out[meta.q_valid]
        return result


def build_padded_meta(fb: ForwardBatch, kv: KVCache) -> PaddedMeta:
    device = fb.input_ids.device
    starts, lens = fb.seg_starts_cpu, fb.seg_lens_cpu
    q_max, k_max = max(lens), max(s + n for s, n in zip(starts, lens, strict=True))
    offsets = torch.tensor([0] + list(lens[:-1]), device=device).cumsum(0)  # (S,)
    i = torch.arange(q_max, device=device)
    q_valid = i[None, :] < fb.seg_lens[:, None]  # (S, Qmax)
    q_index = torch.where(q_valid, offsets[:, None] + i[None, :], 0)
    q_pos = fb.seg_starts[:, None] + i[None, :]  # (S, Qmax)
    k_pos = torch.arange(k_max, device=device)[None, :].expand(len(lens), -1)  # (S, Kmax)
    k_valid = k_pos < (fb.seg_starts + fb.seg_lens)[:, None]
    k_slot = kv.slots(fb.req_slots[:, None], torch.where(k_valid, k_pos, 0))
    k_slot = torch.where(k_valid, k_slot, 0)
    mask = block_causal(q_pos[:, :, None], k_pos[:, None, :], fb.block_size) & k_valid[:, None, :]
    # Padding queries see key 0 so that softmax stays finite; their rows are dropped.
    mask |= (~q_valid[:, :, None]) & (k_pos[:, None, :] == 0)
    return PaddedMeta(q_index, q_valid, k_slot, mask[:, None])
