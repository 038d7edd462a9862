"""A denoise forward's metadata from its rows (kernels/row_meta.py): the kernel equals its
PyTorch reference, and both equal what the host writes for the same layout (fill_meta)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dllm_serve.kernels.block_attention import TILE_FIELDS
from dllm_serve.kernels.row_meta import RowMetaFields, write_row_meta, write_row_meta_reference
from dllm_serve.model.graph_layout import MetaLayout, fill_meta

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCRATCH = 9


def fields(buf: torch.Tensor, layout: MetaLayout) -> RowMetaFields:
    def field(name: str, size: int) -> torch.Tensor:
        return buf[layout.offset(name):layout.offset(name) + size]

    tiles = buf[layout.offset("tiles"):].view(torch.int32)[:layout.max_tiles * TILE_FIELDS]
    return RowMetaFields(field("positions", layout.max_tokens),
                         field("token_slot", layout.max_tokens),
                         field("seg_req", layout.max_blocks),
                         field("seg_starts", layout.max_blocks),
                         tiles.view(-1, TILE_FIELDS))


@pytest.mark.parametrize(("k", "tpb"), [(4, 1), (6, 2), (32, 1)])
def test_kernel_equals_reference_and_leaves_other_rows(k: int, tpb: int) -> None:
    gen = torch.Generator().manual_seed(k)
    layout = MetaLayout(8, k, tpb)
    base = torch.randint(0, 1000, (layout.size,), generator=gen).to(DEVICE)
    req = torch.randint(0, SCRATCH + 1, (8,), generator=gen).to(DEVICE)
    start = (torch.randint(0, 50, (8,), generator=gen) * k).to(DEVICE)
    got, want = base.clone(), base.clone()
    write_row_meta(req, start, fields(got, layout), 5, k)
    write_row_meta_reference(req, start, fields(want, layout), 5, k)
    assert torch.equal(got, want)
    f = fields(want, layout)
    assert f.positions[:5 * k].tolist() == [int(start[r]) + j for r in range(5) for j in range(k)]
    assert f.seg_req[5:].tolist() == base[layout.offset("seg_req") + 5:][:3].tolist()


@pytest.mark.parametrize("bucket", [1, 4, 8])
def test_row_meta_equals_the_hosts_metadata(bucket: int) -> None:
    """Rows of one block each (holes and graph padding: the scratch slot at start 0): the
    fields computed from (req, start) equal fill_meta's for the same layout, once the fields
    no row changes were written (a forward of pad blocks)."""
    k, tpt = 8, 4
    layout = MetaLayout(8, k, -(-k // tpt))
    rng = np.random.default_rng(bucket)
    n = bucket - 1 if bucket > 1 else 1
    slots = rng.integers(0, SCRATCH, n)
    starts = rng.integers(0, 40, n) * k
    if n > 2:
        slots[1], starts[1] = SCRATCH, 0  # a hole
    host = np.zeros(layout.size, dtype=np.int64)
    fill_meta(host, layout, bucket, slots.tolist(), starts.tolist(), [1] * n, tpt, SCRATCH)
    dev = np.zeros(layout.size, dtype=np.int64)
    fill_meta(dev, layout, layout.max_blocks, [], [], [], tpt, SCRATCH)  # pads: fixed fields
    buf = torch.from_numpy(dev).to(DEVICE)
    req = torch.tensor([*slots, *[SCRATCH] * (8 - n)], device=DEVICE)
    start = torch.tensor([*starts, *[0] * (8 - n)], device=DEVICE)
    write_row_meta(req, start, fields(buf, layout), bucket, k)
    got, want = fields(buf, layout), fields(torch.from_numpy(host).to(DEVICE), layout)
    t = bucket * k
    for name, size in (("positions", t), ("token_slot", t), ("seg_req", bucket),
                       ("seg_starts", bucket), ("tiles", bucket * layout.tiles_per_block)):
        assert torch.equal(getattr(got, name)[:size], getattr(want, name)[:size]), name
    lens = slice(layout.offset("seg_lens"), layout.offset("seg_lens") + bucket)
    assert buf[lens].tolist() == host[lens].tolist()
