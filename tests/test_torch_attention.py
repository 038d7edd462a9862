"""`TorchAttention` (the plain PyTorch reference) pads its segments in groups of similar key
length (`length_groups`); grouped or not, each query's output is softmax attention over the
keys `block_causal` lets it see, computed here position by position from the cache."""

from __future__ import annotations

import pytest
import torch
from test_kernels_attention import SMALL, Seg, forward_batch, scattered_cache

from dllm_serve.layers import attention
from dllm_serve.layers.attention import TorchAttention, block_causal, length_groups


def naive(kv, q: torch.Tensor, segs: list[Seg], block: int, scale: float) -> torch.Tensor:
    """(T, H * D): every query of every segment against its visible keys, read from the
    cache (its own request's slot: segment r is request r)."""
    heads, out, t = q.shape[1], [], 0
    for r, (start, n) in enumerate(segs):
        k_pos = torch.arange(start + n)
        slots = kv.slots(torch.tensor(r), k_pos)
        k, v = kv.k[0][slots], kv.v[0][slots]  # (K, KVH, D)
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        for i in range(n):
            seen = block_causal(torch.tensor(start + i), k_pos, block)
            scores = torch.einsum("hd,khd->hk", q[t + i], k[seen]) * scale
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[seen]).flatten())
        t += n
    return torch.stack(out)


@pytest.mark.parametrize("cost", [0, 10 ** 9], ids=["grouped", "one-group"])
def test_grouped_padding_equals_attention_position_by_position(cost: int,
                                                                monkeypatch) -> None:
    """Short and long prefixes mixed (denoise blocks and a prefill segment of three blocks):
    with groups free (cost 0: split wherever the padding shrinks) and with one group, the
    output equals the position-by-position attention."""
    monkeypatch.setattr(attention, "GROUP_COST", cost)
    shape = SMALL
    segs: list[Seg] = [(0, 8), (200, 8), (16, 8), (240, 8), (8, 8), (0, 24), (216, 8), (96, 8)]
    gen = torch.Generator().manual_seed(3)
    kv = scattered_cache(shape, segs, torch.float32, gen)
    t = sum(n for _, n in segs)
    q = torch.randn(t, shape.heads, shape.head_dim, generator=gen)
    k = torch.randn(t, shape.kv_heads, shape.head_dim, generator=gen)
    v = torch.randn(t, shape.kv_heads, shape.head_dim, generator=gen)
    attn = TorchAttention(kv, shape.heads, shape.head_dim, shape.head_dim ** -0.5)
    fb = forward_batch(kv, segs, shape.block, attn)
    assert len(fb.attn_meta) == (1 if cost else 3)
    out = attn.forward(0, q, k, v, fb)  # stores k, v first: the naive pass reads them back
    ref = naive(kv, q, segs, shape.block, shape.head_dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_length_groups_partition_by_key_length(monkeypatch) -> None:
    """Groups partition the segments, each a run of consecutive key lengths, at most
    MAX_GROUPS of them; equal lengths (or a split that saves less than a group costs) stay one
    group in the batch's order; a few long prefixes among many short ones get their own."""
    ends = [300, 40, 48, 310, 40, 56, 48, 40, 305, 64, 40, 48]
    groups = length_groups(ends)
    assert sorted(i for g in groups for i in g) == list(range(len(ends)))
    assert 2 <= len(groups) <= attention.MAX_GROUPS
    spans = [(min(ends[i] for i in g), max(ends[i] for i in g)) for g in groups]
    assert all(hi < lo for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False))
    assert {ends[i] for i in groups[-1]} == {300, 305, 310}
    assert length_groups([64] * 16) == [list(range(16))]
    assert length_groups([40, 80]) == [[0, 1]]  # saves 40 padded positions: not worth a group
    assert length_groups([]) == [[]] and length_groups([7]) == [[0]]
    monkeypatch.setattr(attention, "MAX_GROUPS", 2)
    assert len(length_groups(ends)) == 2
