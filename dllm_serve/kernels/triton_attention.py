"""`--attention-backend triton`: the block-diffusion paged attention kernel behind the interface.

`prepare` plans the launch once per ForwardBatch (tiles copied to the device in one transfer,
split-K workspaces allocated); `forward` stores the layer's new K/V at `out_cache_loc` (one
fused launch, kernels/kv_store.py; none when the q/k norm + RoPE kernel stored them) and
launches the kernel: nothing in `forward` waits for the
device. `static_plan` gives CUDA graphs a plan over a caller-filled tile table: the split count
depends only on the tile count (never on key lengths), so a graph captured for one batch size
stays valid for any prefix lengths, which the kernel reads from the tile table.
"""

from __future__ import annotations

import torch

from dllm_serve.kernels.block_attention import (
    BlockAttnPlan,
    block_attention,
    plan_block_attention,
    plan_over_tiles,
    tokens_per_tile,
)
from dllm_serve.kernels.kv_store import store_kv
from dllm_serve.kernels.runtime import cdiv, check_device, floor_pow2, num_sms
from dllm_serve.layers.attention import ATTENTION_BACKENDS, AttentionBackend
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch

MAX_SPLITS = 32
PROGRAMS_PER_SM = 2


def choose_num_splits(num_tiles: int, kv_heads: int, sms: int) -> int:
    """Key-range splits (a power of two) so that about PROGRAMS_PER_SM programs run per SM;
    1 when the tiles alone fill the device. Splits past a short prefix's keys exit at once."""
    wanted = PROGRAMS_PER_SM * sms // max(1, num_tiles * kv_heads)
    return floor_pow2(min(wanted, MAX_SPLITS))


@ATTENTION_BACKENDS.register("triton")
class TritonAttention(AttentionBackend):
    """Block-causal paged attention in one Triton launch per layer (kernels/block_attention)."""

    def __init__(self, kv: KVCache, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(kv, num_heads, head_dim, scale)
        check_device(kv.k[0], "--attention-backend triton")
        self.num_kv_heads = kv.k[0].shape[1]
        self.tokens_per_tile = tokens_per_tile(num_heads // self.num_kv_heads)  # checks GQA
        self.sms = num_sms(kv.k[0].device)
        self.num_splits: int | None = None  # None: chosen per batch; tests force a value

    def prepare(self, fb: ForwardBatch) -> None:
        tiles = sum(cdiv(n, self.tokens_per_tile) for n in fb.seg_lens_cpu)
        fb.attn_meta = plan_block_attention(
            fb.seg_starts_cpu, fb.seg_lens_cpu, fb.block_size, self.num_heads,
            self.num_kv_heads, self.head_dim, self._splits(tiles), fb.input_ids.device)

    def static_plan(self, tiles: torch.Tensor, num_tokens: int, block_size: int
                    ) -> BlockAttnPlan:
        """A plan over `tiles` (max_tiles, 5) int32, which the caller fills before each launch
        (unused rows: segment length 0), for batches of `num_tokens` tokens (CUDA graphs)."""
        return plan_over_tiles(tiles, self.tokens_per_tile, self._splits(tiles.shape[0]),
                               num_tokens, block_size, self.num_heads, self.num_kv_heads,
                               self.head_dim, self.sms)

    def _splits(self, num_tiles: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return choose_num_splits(num_tiles, self.num_kv_heads, self.sms)

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> None:
        store_kv(k, v, self.kv.k[layer_id], self.kv.v[layer_id], fb.out_cache_loc)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, stored: bool = False) -> torch.Tensor:
        if not stored:
            self.store(layer_id, k, v, fb)
        plan: BlockAttnPlan = fb.attn_meta
        return block_attention(q, self.kv.k[layer_id], self.kv.v[layer_id], self.kv.req_to_page,
                               fb.req_slots, plan, self.kv.page_size, self.scale)
