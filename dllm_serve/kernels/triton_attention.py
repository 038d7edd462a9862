"""`--attention-backend triton`: the block-diffusion paged attention kernel behind the interface.

`prepare` plans the launch once per ForwardBatch (tiles copied to the device in one transfer,
split-K workspaces allocated); `forward` stores the layer's new K/V at `out_cache_loc` (a torch
index_put) and launches the kernel: nothing in `forward` waits for the device.
"""

from __future__ import annotations

import torch

from dllm_serve.kernels.block_attention import (
    BLOCK_N,
    BlockAttnPlan,
    block_attention,
    plan_block_attention,
    tokens_per_tile,
)
from dllm_serve.kernels.runtime import cdiv, check_device, floor_pow2, num_sms
from dllm_serve.layers.attention import ATTENTION_BACKENDS, AttentionBackend
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch

MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 2 * BLOCK_N
PROGRAMS_PER_SM = 2


def choose_num_splits(num_tiles: int, kv_heads: int, max_keys: int, sms: int) -> int:
    """Key-range splits (a power of two) so that about PROGRAMS_PER_SM programs run per SM,
    each over at least MIN_KEYS_PER_SPLIT keys; 1 when the tiles alone fill the device."""
    wanted = PROGRAMS_PER_SM * sms // (num_tiles * kv_heads)
    useful = max_keys // MIN_KEYS_PER_SPLIT
    return floor_pow2(min(wanted, useful, MAX_SPLITS))


@ATTENTION_BACKENDS.register("triton")
class TritonAttention(AttentionBackend):
    """Block-causal paged attention in one Triton launch per layer (kernels/block_attention)."""

    def __init__(self, kv: KVCache, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(kv, num_heads, head_dim, scale)
        check_device(kv.k[0], "--attention-backend triton")
        self.num_kv_heads = kv.k[0].shape[1]
        tokens_per_tile(num_heads // self.num_kv_heads)  # raises on an unsupported GQA group
        self.sms = num_sms(kv.k[0].device)
        self.num_splits: int | None = None  # None: chosen per batch; tests force a value

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn_meta = plan_block_attention(
            fb.seg_starts_cpu, fb.seg_lens_cpu, fb.block_size, self.num_heads,
            self.num_kv_heads, self.head_dim, self._splits(fb), fb.input_ids.device)

    def _splits(self, fb: ForwardBatch) -> int:
        if self.num_splits is not None:
            return self.num_splits
        tq = tokens_per_tile(self.num_heads // self.num_kv_heads)
        tiles = sum(cdiv(n, tq) for n in fb.seg_lens_cpu)
        max_keys = max((s + n for s, n in zip(fb.seg_starts_cpu, fb.seg_lens_cpu, strict=True)),
                       default=0)
        return choose_num_splits(tiles, self.num_kv_heads, max_keys, self.sms)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        self.store(layer_id, k, v, fb)
        plan: BlockAttnPlan = fb.attn_meta
        return block_attention(q, self.kv.k[layer_id], self.kv.v[layer_id], self.kv.req_to_page,
                               fb.req_slots, plan, self.kv.page_size, self.scale)
