"""A denoise forward's metadata computed on the device from its rows, in one launch.

With one block per row (managers/resident_batch.py), the metadata a bucketed denoise forward
reads (model/graph_layout.py) is a function of each row's request key and block start, which the
worker's row storage already holds on the device (`row_req`, `row_start`, written by the row
inbox). Row r of a bucket of N rows (K tokens a block, TPB attention tiles a block) gives:
  positions[r*K + j] = start[r] + j,  token_slot[r*K + j] = req[r]    (j < K)
  seg_req[r] = req[r],  seg_starts[r] = start[r]
  tiles[r*TPB + t, START] = start[r]                                   (t < TPB)
(the other fields, seg_lens = K and the tiles' other columns, do not depend on the rows and are
written once). A row that holds no block (a hole, graph padding) has the free key, which is the
runner's scratch slot, and start 0: exactly a pad block's metadata. So the forward's graph runs
this first and the host writes and copies no metadata at all.
Oracle: `write_row_meta_reference` (the CPU path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import check_device, next_pow2

TILE_START = 2  # the seg_start column of a tile row (kernels/block_attention.TILE_FIELDS)


@dataclass(frozen=True)
class RowMetaFields:
    """Views of one metadata buffer for buckets up to max_blocks rows: positions and
    token_slot (max_blocks * K,) int64, seg_req and seg_starts (max_blocks,) int64, tiles
    (max_blocks * TPB, TILE_FIELDS) int32."""

    positions: torch.Tensor
    token_slot: torch.Tensor
    seg_req: torch.Tensor
    seg_starts: torch.Tensor
    tiles: torch.Tensor


def write_row_meta(req: torch.Tensor, start: torch.Tensor, out: RowMetaFields, rows: int,
                   block_size: int) -> None:
    """Rows [0, rows) of `out` := the metadata of row r's block (req[r], start[r]); req and
    start (>= rows,) int64 with unit stride."""
    check_device(req, "write_row_meta")
    tpb = out.tiles.shape[0] // out.seg_req.shape[0]
    _row_meta_kernel[(rows,)](req, start, out.positions, out.token_slot, out.seg_req,
                              out.seg_starts, out.tiles, out.tiles.stride(0), K=block_size,
                              BLOCK_K=next_pow2(block_size), TPB=tpb,
                              BLOCK_T=next_pow2(tpb), START=TILE_START, num_warps=1)


def write_row_meta_reference(req: torch.Tensor, start: torch.Tensor, out: RowMetaFields,
                             rows: int, block_size: int) -> None:
    """`write_row_meta` in PyTorch ops (no host sync)."""
    k, r_req, r_start = block_size, req[:rows], start[:rows]
    tpb = out.tiles.shape[0] // out.seg_req.shape[0]
    arange = torch.arange(k, device=req.device)
    out.positions[:rows * k].view(rows, k).copy_(r_start[:, None] + arange[None, :])
    out.token_slot[:rows * k].view(rows, k).copy_(r_req[:, None].expand(rows, k))
    out.seg_req[:rows].copy_(r_req)
    out.seg_starts[:rows].copy_(r_start)
    out.tiles[:rows * tpb, TILE_START].view(rows, tpb).copy_(r_start[:, None].expand(rows, tpb))


@triton.jit
def _row_meta_kernel(Req, Start, Positions, TokenSlot, SegReq, SegStarts, Tiles, stride_tile,
                     K: tl.constexpr, BLOCK_K: tl.constexpr, TPB: tl.constexpr,
                     BLOCK_T: tl.constexpr, START: tl.constexpr):
    r = tl.program_id(0)
    req = tl.load(Req + r)
    start = tl.load(Start + r)
    j = tl.arange(0, BLOCK_K)
    j_ok = j < K
    tl.store(Positions + r * K + j, start + j, mask=j_ok)
    tl.store(TokenSlot + r * K + j, req + j * 0, mask=j_ok)
    tl.store(SegReq + r, req)
    tl.store(SegStarts + r, start)
    t = tl.arange(0, BLOCK_T)
    tl.store(Tiles + (r * TPB + t) * stride_tile + START, (start + t * 0).to(tl.int32),
             mask=t < TPB)
