"""Attention for block diffusion: the mask predicate, the backend interface, and the reference.

The mask is written once, here, as a predicate over absolute positions of one request:
a query at position q sees a key at position k iff `k // block_size <= q // block_size`
(its own block bidirectionally and every earlier block), and only keys that exist
(k < seg_start + seg_len). Every fast kernel is tested against `TorchAttention`, which
builds its mask from this same predicate.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
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
    """One padded group of segments."""

    q_index: torch.Tensor  # (S, Qmax) token row of each query; padding points at row 0
    q_valid: torch.Tensor  # (S, Qmax) bool
    k_slot: torch.Tensor  # (S, Kmax) KV slot of each key position; padding points at slot 0
    mask: torch.Tensor  # (S, 1, Qmax, Kmax) bool, from `block_causal`


@ATTENTION_BACKENDS.register("torch")
class TorchAttention(AttentionBackend):
    """Plain PyTorch reference: segments padded to (S, Qmax) x (S, Kmax) and run through SDPA,
    in a few groups of similar key length (`length_groups`) so that a batch mixing short and
    long prefixes does not pad every segment to the longest."""

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn_meta = build_padded_meta(fb, self.kv)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, stored: bool = False) -> torch.Tensor:
        if not stored:
            self.store(layer_id, k, v, fb)
        result = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        meta: PaddedMeta
        for meta in fb.attn_meta:
            qs = q[meta.q_index].transpose(1, 2)  # (S, H, Qmax, D)
            ks = self.kv.k[layer_id][meta.k_slot].transpose(1, 2).to(q.dtype)  # (S, KVH, Kmax, D)
            vs = self.kv.v[layer_id][meta.k_slot].transpose(1, 2).to(q.dtype)
            rep = self.num_heads // ks.shape[1]
            if rep > 1:
                ks = ks.repeat_interleave(rep, dim=1)
                vs = vs.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.mask,
                                                 scale=self.scale)
            out = out.transpose(1, 2).flatten(2)  # (S, Qmax, H * D)
            result[meta.q_index[meta.q_valid]] = out[meta.q_valid]
        return result


MAX_GROUPS = 3
# one more group's fixed cost, in padded (segment x key) positions: 128-256 measured best on a
# CPU (benchmarks/torch_attention_groups.py)
GROUP_COST = 256


def length_groups(ends: list[int]) -> list[list[int]]:
    """The segments (by their key ends, seg_start + seg_len) in at most MAX_GROUPS groups of
    consecutive key lengths: the split that minimizes the padded area (each group's segments x
    its longest end) plus GROUP_COST per group after the first. One group: all segments, in
    their order (the unsplit batch)."""
    n = len(ends)
    if n < 2:
        return [list(range(n))]
    order = np.argsort(ends, kind="stable")
    e = np.asarray(ends, dtype=np.int64)[order]
    a = np.arange(1, n)  # a split after the a smallest
    tail = (n - a) * e[-1]
    two = a * e[a - 1] + tail + GROUP_COST
    best, cuts = int(n * e[-1]), []
    if two.min() < best:
        best, cuts = int(two.min()), [int(a[two.argmin()])]
    if MAX_GROUPS >= 3 and n >= 3:  # splits after a < b of the smallest
        aa, bb = a[:, None], a[None, :]
        three = aa * e[aa - 1] + (bb - aa) * e[bb - 1] + tail[None, :] + 2 * GROUP_COST
        three = np.where(aa < bb, three, np.iinfo(np.int64).max)
        i, j = np.unravel_index(three.argmin(), three.shape)
        if three[i, j] < best:
            cuts = [int(a[i]), int(a[j])]
    if not cuts:
        return [list(range(n))]
    bounds = [0, *cuts, n]
    return [order[lo:hi].tolist() for lo, hi in zip(bounds, bounds[1:], strict=False)]


def build_padded_meta(fb: ForwardBatch, kv: KVCache) -> list[PaddedMeta]:
    """One padded group per `length_groups` group of the batch's segments."""
    ends = [s + n for s, n in zip(fb.seg_starts_cpu, fb.seg_lens_cpu, strict=True)]
    groups = length_groups(ends)
    if len(groups) == 1:
        return [_padded(fb, kv, None)]
    return [_padded(fb, kv, g) for g in groups]


def _padded(fb: ForwardBatch, kv: KVCache, segs: list[int] | None) -> PaddedMeta:
    """The padded batch of segments `segs` (None: all of them, in order)."""
    device = fb.input_ids.device
    every = range(len(fb.seg_lens_cpu))
    pick = every if segs is None else segs
    lens = [fb.seg_lens_cpu[i] for i in pick]
    starts = [fb.seg_starts_cpu[i] for i in pick]
    first_token = list(itertools.accumulate(fb.seg_lens_cpu, initial=0))
    q_max, k_max = max(lens), max(s + n for s, n in zip(starts, lens, strict=True))
    offsets = torch.tensor([first_token[i] for i in pick], device=device)  # (S,)
    if segs is None:
        seg_lens, seg_starts, req_slots = fb.seg_lens, fb.seg_starts, fb.req_slots
    else:
        index = torch.tensor(segs, device=device)
        seg_lens, seg_starts, req_slots = (fb.seg_lens[index], fb.seg_starts[index],
                                           fb.req_slots[index])
    i = torch.arange(q_max, device=device)
    q_valid = i[None, :] < seg_lens[:, None]  # (S, Qmax)
    q_index = torch.where(q_valid, offsets[:, None] + i[None, :], 0)
    q_pos = seg_starts[:, None] + i[None, :]  # (S, Qmax)
    k_pos = torch.arange(k_max, device=device)[None, :].expand(len(lens), -1)  # (S, Kmax)
    k_valid = k_pos < (seg_starts + seg_lens)[:, None]
    k_slot = kv.slots(req_slots[:, None], torch.where(k_valid, k_pos, 0))
    k_slot = torch.where(k_valid, k_slot, 0)
    mask = block_causal(q_pos[:, :, None], k_pos[:, None, :], fb.block_size) & k_valid[:, None, :]
    # Padding queries see key 0 so that softmax stays finite; their rows are dropped.
    mask |= (~q_valid[:, :, None]) & (k_pos[:, None, :] == 0)
    return PaddedMeta(q_index, q_valid, k_slot, mask[:, None])
