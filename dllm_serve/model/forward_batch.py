"""`ForwardBatch`: everything one model forward needs, built once and passed down explicitly.

Vocabulary (used everywhere in the engine):
- a *segment* is a run of whole blocks of one request at absolute positions
  [seg_start, seg_start + seg_len); seg_start is a multiple of block_size.
  A prefill segment holds prompt blocks; a denoise segment holds one block being denoised.
- tokens of all segments are concatenated: T = sum(seg_lens).
- every token's K/V is written to the KV slot `out_cache_loc` before attention, then each query
  attends to its request's cached positions under `layers.attention.block_causal` (key block <=
  query block), so earlier blocks are read from the cache and the own block bidirectionally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Attention(Protocol):
    """What a forward needs of its attention backend (layers/attention.AttentionBackend is
    the interface; this module stays a leaf that layers/ and model/ both import)."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, stored: bool = False) -> torch.Tensor: ...

    def kv_target(self, layer_id: int, fb: ForwardBatch) -> Any:
        """layers.attention.KvTarget for a kernel that stores the layer's K/V, or None."""


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute positions (RoPE and the mask use them)
    out_cache_loc: torch.Tensor  # (T,) int64, KV slot written by each token
    req_slots: torch.Tensor  # (S,) int64, row of each segment's request in the page table
    seg_starts: torch.Tensor  # (S,) int64, absolute start of each segment
    seg_lens: torch.Tensor  # (S,) int64
    block_size: int
    attn: Attention
    # Rows of input_ids whose logits are wanted (None: no logits, e.g. a pure prefill).
    logits_index: torch.Tensor | None = None
    # Host copies, so that backends plan without a device sync.
    seg_starts_cpu: list[int] = field(default_factory=list)
    seg_lens_cpu: list[int] = field(default_factory=list)
    # Backend-owned metadata, filled by `attn.prepare(self)`.
    attn_meta: Any = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_segments(self) -> int:
        return len(self.seg_lens_cpu)
