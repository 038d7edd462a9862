"""Test helpers: a KV cache + reference attention for a model, and hand-built ForwardBatches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dllm_serve.layers.attention import TorchAttention
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class Segment:
    req_slot: int
    seg_start: int  # absolute position of the first token, a multiple of block_size
    token_ids: list[int]


def make_cache(kv_spec: tuple[int, int, int, int], num_reqs: int, max_len: int, page_size: int,
               dtype: torch.dtype = torch.float32) -> tuple[KVCache, TorchAttention]:
    """A KV cache where request slot r owns pages [r*P, (r+1)*P) (P pages of max_len tokens)."""
    layers, heads, kv_heads, head_dim = kv_spec
    pages_per_req = -(-max_len // page_size)
    kv = KVCache(layers, num_reqs * pages_per_req, page_size, kv_heads, head_dim, num_reqs,
                 pages_per_req, dtype, torch.device("cpu"))
    pages = [np.arange(r * pages_per_req, (r + 1) * pages_per_req) for r in range(num_reqs)]
    for slot, p in enumerate(pages):
        kv.map_pages(slot, 0, p)
    return kv, TorchAttention(kv, heads, head_dim, head_dim ** -0.5)


def make_batch(segments: list[Segment], kv: KVCache, attn: TorchAttention,
               block_size: int) -> ForwardBatch:
    """Concatenate the segments' tokens, fill slots and positions, and run `attn.prepare`."""
    ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.int64)
    positions = torch.cat([torch.arange(s.seg_start, s.seg_start + len(s.token_ids))
                           for s in segments])
    token_req = torch.cat([torch.full((len(s.token_ids),), s.req_slot) for s in segments])
    fb = ForwardBatch(
        input_ids=ids, positions=positions, out_cache_loc=kv.slots(token_req, positions),
        req_slots=torch.tensor([s.req_slot for s in segments]),
        seg_starts=torch.tensor([s.seg_start for s in segments]),
        seg_lens=torch.tensor([len(s.token_ids) for s in segments]),
        block_size=block_size, attn=attn,
        seg_starts_cpu=[s.seg_start for s in segments],
        seg_lens_cpu=[len(s.token_ids) for s in segments])
    attn.prepare(fb)
    return fb
