"""Static metadata of padded forwards: padding, one packed buffer.

Every forward on the bucketed path (CUDA graphs or their eager twin) runs at a *bucket*
(model/buckets.py): a number of blocks N_pad (a prefill of T tokens counts T / K blocks). A
forward of N <= N_pad blocks runs the smallest bucket that holds it; its T = N * K tokens are
padded to T_pad = N_pad * K with *pad blocks*: one-block segments at positions [0, K) of a
reserved request slot (the runner's scratch slot, whose page table points at a scratch page),
so their K/V writes land on that page and their outputs are ignored. Every input lives in static
buffers that `fill_meta` rewrites before a run, so prefix lengths, request slots and the
segment layout change freely while every launch keeps its grid: a bucket's kernels are
compiled (and its graph captured) once, at startup, and never again.

The metadata of one forward is one int64 buffer (one host-to-device copy), fields at fixed
offsets sized for the largest bucket; a bucket uses a prefix of each field (fill_meta writes
that prefix whole; what lies past it is never read by the bucket and may be anything):
  positions (T_max,)   absolute position of each token (pad tokens: 0..K-1)
  token_slot (T_max,)  request slot of each token (pad tokens: the scratch slot)
  seg_req, seg_starts, seg_lens (N_max,)  per segment: real segments, then one per pad block,
                       then unused entries (scratch slot, start 0, length 0)
  ids (T_max,)         token ids (prefill layouts only; pad tokens: the pad id)
  tiles (N_max * tiles_per_block, 5) int32, viewed in the int64 buffer: the attention tile
                       table (kernels/block_attention.plan_tiles), unused rows of length 0.
`MetaWriter` keeps the host copy of one buffer (prefills, and bucketed forwards run without the
worker's row storage; the worker's denoise forwards compute theirs on the device from the rows,
kernels/row_meta.py) and skips a write that would change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dllm_serve.kernels.block_attention import TILE_FIELDS, plan_tiles
from dllm_serve.kernels.runtime import cdiv


@dataclass(frozen=True)
class MetaLayout:
    """Field offsets (in int64 elements) of the packed metadata for buckets up to max_blocks;
    with_ids: the layout carries the token ids too (prefill)."""

    max_blocks: int
    block_size: int
    tiles_per_block: int
    with_ids: bool = False

    @property
    def max_tokens(self) -> int:
        return self.max_blocks * self.block_size

    def offset(self, field: str) -> int:
        return self._offsets[field]

    @cached_property
    def _offsets(self) -> dict[str, int]:
        t, n = self.max_tokens, self.max_blocks
        ids = 2 * t + 3 * n
        return {"positions": 0, "token_slot": t, "seg_req": 2 * t, "seg_starts": 2 * t + n,
                "seg_lens": 2 * t + 2 * n, "ids": ids,
                "tiles": ids + (t if self.with_ids else 0)}

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
              scratch_slot: int, ids: np.ndarray | None = None, pad_id: int = 0) -> None:
    """Write one forward's metadata, padded to `bucket` blocks, into `buf` (int64,
    layout.size): request b's num_blocks[b] blocks from first_starts[b] form one segment;
    ids (T,): their tokens, for layouts with ids (pad tokens get pad_id)."""
    k, n = layout.block_size, sum(num_blocks)
    if n > bucket or bucket > layout.max_blocks:
        raise ValueError(f"{n} blocks do not fit bucket {bucket} (max {layout.max_blocks})")
    pads = bucket - n
    segs = len(num_blocks) + pads
    real = len(num_blocks)  # segments: the real ones, then one pad block each
    starts = np.zeros(segs, np.int64)
    starts[:real] = first_starts
    lens = np.full(segs, k, np.int64)
    lens[:real] = np.asarray(num_blocks, np.int64) * k
    slots = np.full(segs, scratch_slot, np.int64)
    slots[:real] = req_slots
    t_pad = bucket * k

    def put(field: str, values: np.ndarray, fill: int) -> None:
        size = t_pad if field in ("positions", "token_slot", "ids") else bucket
        out = buf[layout.offset(field):layout.offset(field) + size]
        out[:len(values)] = values
        out[len(values):] = fill

    offsets = np.cumsum(lens) - lens  # each segment's first token
    put("positions", np.arange(t_pad) + np.repeat(starts - offsets, lens), 0)
    put("token_slot", np.repeat(slots, lens), scratch_slot)
    put("seg_req", slots, scratch_slot)
    put("seg_starts", starts, 0)
    put("seg_lens", lens, 0)
    if layout.with_ids:
        assert ids is not None and len(ids) == n * k
        put("ids", ids, pad_id)
    tiles = layout.tiles_view(buf, bucket)
    used = plan_tiles(starts, lens, tokens_per_tile)
    tiles[:len(used)] = used
    tiles[len(used):] = 0  # length-0 rows: their programs write nothing
    assert len(lens) <= bucket and len(used) <= len(tiles)


class MetaWriter:
    """The host copy of one metadata buffer and what it was last written with.

    Invariant: `host` holds exactly what fill_meta would write for the last (bucket, slots,
    starts, num_blocks, ids); a write of the same forward (no ids) changes nothing and says so
    (the caller then copies nothing), any other write fills the buffer anew. The worker's
    denoise forwards compute their metadata on the device (kernels/row_meta.py): this serves
    prefills and the bucketed forwards used without the worker's row storage."""

    def __init__(self, layout: MetaLayout, tokens_per_tile: int, scratch_slot: int,
                 pad_id: int = 0) -> None:
        self.layout, self.tpt = layout, tokens_per_tile
        self.scratch_slot, self.pad_id = scratch_slot, pad_id
        self.host = np.zeros(layout.size, dtype=np.int64)
        self.last: tuple[int, list[int], list[int], list[int]] | None = None

    def write(self, bucket: int, req_slots: list[int], first_starts: list[int],
              num_blocks: list[int], ids: np.ndarray | None = None) -> bool:
        """Bring `host` to this forward's metadata; False when it already was."""
        key = (bucket, list(req_slots), list(first_starts), list(num_blocks))
        if ids is None and key == self.last:
            return False
        fill_meta(self.host, self.layout, bucket, req_slots, first_starts, num_blocks, self.tpt,
                  self.scratch_slot, ids, self.pad_id)
        self.last = None if ids is not None else key  # a prefill's ids change every time
        return True
