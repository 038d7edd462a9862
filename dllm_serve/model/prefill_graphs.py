"""Prefill forwards at a bucket of tokens: padded, warmed up or captured at startup.

A prefill forward caches whole prompt blocks of one or more requests (one segment each) and
computes no logits. Its token count is padded up to a prefill bucket (graph_layout.py: powers of
two up to 256 tokens, then steps of 256 up to the prefill budget) with pad blocks on the scratch
slot, so a new prompt length never meets an uncompiled kernel, and with CUDA graphs a prefill
costs one metadata copy and one replay instead of hundreds of launches. The token ids travel
inside the packed metadata (the layout's `ids` field): one host-to-device copy per prefill.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from dllm_serve.kernels.runtime import cdiv
from dllm_serve.kernels.triton_attention import TritonAttention
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.buckets import pick_bucket, prefill_buckets
from dllm_serve.model.cuda_graph import BucketedForwards
from dllm_serve.model.graph_layout import MetaLayout


class PrefillGraphs(BucketedForwards):
    def __init__(self, model: nn.Module, kv: KVCache, attn: TritonAttention, block_size: int,
                 max_tokens: int, pad_id: int, scratch_slot: int) -> None:
        """max_tokens: the most tokens of one prefill (a multiple of block_size)."""
        buckets = prefill_buckets(block_size, max_tokens)
        layout = MetaLayout(buckets[-1], block_size, cdiv(block_size, attn.tokens_per_tile),
                            with_ids=True)
        super().__init__(model, kv, attn, layout, buckets, scratch_slot, pad_id, None)

    def replay_each(self) -> None:
        """Replay every captured bucket once on pad-only metadata (its writes land on the
        scratch page): CUDA uploads a graph at its first launch, so without this the first
        prefill of each bucket after ready paid for it (on an H100, warm Triton cache, the first
        4096-token prefill took 0.40 ms of host launch against 0.22-0.28 ms for the later ones).
        `ModelRunner.warm_up` collects the compiles' garbage just before this, so these replays,
        not the first prefill after ready, pay the 2-3 ms of CPU time the first launch after
        that collection costs (results/h200/gpupath/README.md, sessions 31-33). Prefill graphs
        only: a denoise graph's step moves the worker's row state."""
        for bucket in sorted(self.buckets, reverse=True):
            static = self.forwards[bucket]
            if static.graph is not None:
                self.fill_padding(bucket)
                static.graph.replay()

    @property
    def max_tokens(self) -> int:
        return self.layout.max_tokens

    def bucket_tokens(self, tokens: int) -> int | None:
        """The padded token count of a prefill of `tokens` tokens (None: too long)."""
        bucket = pick_bucket(cdiv(tokens, self.layout.block_size), self.buckets)
        return None if bucket is None else bucket * self.layout.block_size

    def run_prefill(self, slots: list[int], seg_starts: list[int],
                    token_ids: list[np.ndarray]) -> bool:
        """Cache row i's tokens at [seg_starts[i], + len(token_ids[i])) of the request in
        slots[i] (whole blocks, pages mapped); False (nothing run) when no bucket holds them."""
        k = self.layout.block_size
        lens = [len(t) for t in token_ids]
        bucket = pick_bucket(sum(lens) // k, self.buckets)
        if bucket is None or any(n % k for n in lens):
            return False
        self.fill(bucket, slots, seg_starts, [n // k for n in lens], np.concatenate(token_ids))
        self.run(self.forwards[bucket])
        return True
