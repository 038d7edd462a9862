"""Static metadata for CUDA-graph denoise forwards: buckets, padding, one packed buffer.

A graph is captured per *bucket*: a number of active blocks N_pad. A round with N <= N_pad
blocks replays the smallest bucket that holds it; its T = N * K tokens are padded to
T_pad = N_pad * K with *pad blocks*: one-block segments at positions [0, K) of a reserved
request slot (the runner's scratch slot, whose page table points at a scratch page), so their
K/V writes land on that page and their outputs are ignored. Every input of the graph lives in
static buffers that `fill` rewrites before a replay, so prefix lengths, request slots and the
segment layout change freely between replays while every launch keeps its grid.

The metadata of one forward is one int64 buffer (one host-to-device copy), fields at fixed
offsets sized for the largest bucket; a bucket uses a prefix of each field:
  positions (T_max,)   absolute position of each token (pad tokens: 0..K-1)
  token_slot (T_max,)  request slot of each token (pad tokens: the scratch slot)
  seg_req, seg_starts, seg_lens (N_max,)  per segment: real segments, then one per pad block,
                       then unused entries (scratch slot, start 0, length 0)
  tiles (N_max * tiles_per_block, 5) int32, viewed in the int64 buffer: the attention tile
                       table (kernels/block_attention.plan_tiles), unused rows of length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dllm_serve.kernels.block_attention import TILE_FIELDS, plan_tiles
from dllm_serve.kernels.runtime import cdiv

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def graph_buckets(max_blocks: int) -> list[int]:
    """Bucket sizes up to max_blocks (max_blocks itself always one of them)."""
    return sorted({b for b in BUCKETS if b < max_blocks} | {max_blocks})


def pick_bucket(num_blocks: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding num_blocks blocks; None when none does."""
    return next((b for b in buckets if b >= num_blocks), None)


@dataclass(frozen=True)
class MetaLayout:
    """Field offsets (in int64 elements) of the packed metadata for buckets up to max_blocks."""

    max_blocks: int
    block_size: int
    tiles_per_block: int

    @property
    def max_tokens(self) -> int:
        return self.max_blocks * self.block_size

    def offset(self, field: str) -> int:
        t, n = self.max_tokens, self.max_blocks
        return {"positions": 0, "token_slot": t, "seg_req": 2 * t, "seg_starts": 2 * t + n,
                "seg_lens": 2 * t + 2 * n, "tiles": 2 * t + 3 * n}[field]

    @property
    def max_tiles(self) -> int:
        return self.max_blocks * self.tiles_per_block

    @property
    def size(self) -> int:
        """int64 elements of the whole buffer (the int32 tile table rounded up)."""
        return self.offset("tiles") + cdiv(self.max_tiles * TILE_FIELDS, 2)

    def tiles_view(self, buf: np.ndarray, bucket: int) -> np.ndarray:
        """(bucket * tiles_per_block, TILE_FIELDS) int32 view into the int64 buffer `buf`."""
        flat = buf[self.offset("tiles"):].view(np.int32)
        return flat[:bucket * self.tiles_per_block * TILE_FIELDS].reshape(-1, TILE_FIELDS)


def fill_meta(buf: np.ndarray, layout: MetaLayout, bucket: int, req_slots: list[int],
              first_starts: list[int], num_blocks: list[int], tokens_per_tile: int,
              scratch_slot: int) -> None:
    """Write one denoise forward's metadata, padded to `bucket` blocks, into `buf` (int64,
    layout.size): request b's num_blocks[b] blocks from first_starts[b] form one segment."""
    k, n = layout.block_size, sum(num_blocks)
    if n > bucket or bucket > layout.max_blocks:
        raise ValueError(f"{n} blocks do not fit bucket {bucket} (max {layout.max_blocks})")
    pads = bucket - n
    starts = list(first_starts) + [0] * pads
    lens = [b * k for b in num_blocks] + [k] * pads
    slots = list(req_slots) + [scratch_slot] * pads
    t_pad, segs = bucket * k, len(lens)

    def put(field: str, values: np.ndarray, fill: int) -> None:
        size = t_pad if field in ("positions", "token_slot") else bucket
        out = buf[layout.offset(field):layout.offset(field) + size]
        out[:len(values)] = values
        out[len(values):] = fill

    put("positions", np.concatenate([np.arange(s, s + m) for s, m in zip(starts, lens,
                                                                         strict=True)]), 0)
    put("token_slot", np.repeat(slots, lens), scratch_slot)
    put("seg_req", np.asarray(slots), scratch_slot)
    put("seg_starts", np.asarray(starts), 0)
    put("seg_lens", np.asarray(lens), 0)
    tiles = layout.tiles_view(buf, bucket)
    used = plan_tiles(starts, lens, tokens_per_tile)
    tiles[:len(used)] = used
    tiles[len(used):] = 0  # length-0 rows: their programs write nothing
    assert segs <= bucket and len(used) <= len(tiles)
