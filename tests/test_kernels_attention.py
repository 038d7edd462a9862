"""The Triton block-diffusion attention equals `TorchAttention` (built from `block_causal`).

Random K/V in a paged pool whose pages are scattered at random, ragged prefixes, batch 1 and
many, prefill segments of several blocks mixed with denoise blocks, GQA groups 1-4, forced
split-K. Small shapes run everywhere (the Triton interpreter on the CPU); `gpu` tests run the
LLaDA2.0-mini shapes in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from dllm_serve.kernels.triton_attention import TritonAttention, choose_num_splits
from dllm_serve.layers.attention import AttentionBackend, TorchAttention
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    page: int


Seg = tuple[int, int]  # (seg_start, seg_len) of one request; every segment its own request


def scattered_cache(shape: Shape, segs: list[Seg], dtype: torch.dtype,
                    gen: torch.Generator) -> KVCache:
    """One layer of K/V, random everywhere; request r owns randomly scattered pages."""
    need = [-(-(s + n) // shape.page) for s, n in segs]
    num_pages = sum(need) + 7
    kv = KVCache(1, num_pages, shape.page, shape.kv_heads, shape.head_dim, len(segs),
                 max(need), dtype, DEVICE)
    perm = torch.randperm(num_pages, generator=gen).numpy()
    ends = np.cumsum(need)
    for slot, (e, n) in enumerate(zip(ends, need, strict=True)):
        kv.map_pages(slot, 0, perm[e - n:e])
    for t in (kv.k[0], kv.v[0]):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return kv


def forward_batch(kv: KVCache, segs: list[Seg], block: int, attn: AttentionBackend
                  ) -> ForwardBatch:
    starts, lens = [s for s, _ in segs], [n for _, n in segs]
    positions = torch.cat([torch.arange(s, s + n) for s, n in segs]).to(DEVICE)
    req = torch.repeat_interleave(torch.arange(len(segs)), torch.tensor(lens)).to(DEVICE)
    fb = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64, device=DEVICE),
        positions=positions, out_cache_loc=kv.slots(req, positions),
        req_slots=torch.arange(len(segs), device=DEVICE),
        seg_starts=torch.tensor(starts, device=DEVICE), seg_lens=torch.tensor(lens, device=DEVICE),
        block_size=block, attn=attn, seg_starts_cpu=starts, seg_lens_cpu=lens)
    attn.prepare(fb)
    return fb


def run_both(shape: Shape, segs: list[Seg], dtype: torch.dtype, splits: int | None,
             seed: int = 0, combine_rows: int | None = None, poison: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton output, reference). poison: the split-K workspace starts as NaN, so a partial
    output the merge reads without its split having written it shows."""
    gen = torch.Generator().manual_seed(seed)
    kv = scattered_cache(shape, segs, dtype, gen)
    t = sum(n for _, n in segs)
    q = torch.randn(t, shape.heads, shape.head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(t, shape.kv_heads, shape.head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(t, shape.kv_heads, shape.head_dim, generator=gen).to(DEVICE, dtype)
    scale = shape.head_dim ** -0.5
    ref_attn = TorchAttention(kv, shape.heads, shape.head_dim, scale)
    fast_attn = TritonAttention(kv, shape.heads, shape.head_dim, scale)
    fast_attn.num_splits = splits
    ref = ref_attn.forward(0, q, k, v, forward_batch(kv, segs, shape.block, ref_attn))
    fb = forward_batch(kv, segs, shape.block, fast_attn)
    if combine_rows is not None:
        fb.attn_meta = replace(fb.attn_meta, combine_rows=combine_rows)
    if poison and fb.attn_meta.ws_out is not None:
        fb.attn_meta.ws_out.fill_(float("nan"))
    return fast_attn.forward(0, q, k, v, fb), ref


def tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-5 if DEVICE.type == "cpu" else 5e-3  # tf32 dots on the GPU
    return 2e-2


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tolerance(dtype), f"relative error {err:.2e}"


SMALL = Shape(heads=4, kv_heads=2, head_dim=16, block=8, page=16)
MIXED: list[Seg] = [(0, 24), (40, 8), (0, 8), (16, 16), (96, 8), (8, 8)]


@pytest.mark.parametrize("shape", [SMALL, Shape(8, 2, 32, 8, 8), Shape(6, 2, 16, 8, 16),
                                   Shape(4, 4, 16, 16, 32), Shape(8, 2, 16, 32, 64)],
                         ids=["g2", "g4", "g3", "g1", "g4-page64"])
def test_mixed_prefill_and_denoise_segments(shape: Shape) -> None:
    segs = [(s * shape.block // 8, n * shape.block // 8) for s, n in MIXED]
    assert_close(*run_both(shape, segs, torch.float32, splits=1), torch.float32)


@pytest.mark.parametrize("splits", [None, 2, 4])
@pytest.mark.parametrize("shape", [SMALL, Shape(8, 2, 16, 32, 64)], ids=["page16", "page64"])
def test_split_k_over_ragged_prefixes(splits: int | None, shape: Shape) -> None:
    """Split-K over prefixes of several pages; page 64 holds whole key steps (one page lookup
    a step), page 16 does not (one lookup a key)."""
    segs = [(s * shape.block // 8, n * shape.block // 8)
            for s, n in [(200, 8), (0, 8), (72, 8), (136, 16)]]
    assert_close(*run_both(shape, segs, torch.float32, splits), torch.float32)


@pytest.mark.parametrize("splits", [4, 8])
def test_split_k_over_a_prefill_tile(splits: int) -> None:
    """A prefill tile spanning many blocks, split: most splits start past the keys its first
    rows see, so their unmasked steps must be none (not a negative count that re-reads keys)."""
    assert_close(*run_both(SMALL, [(0, 128), (40, 8)], torch.float32, splits), torch.float32)


@pytest.mark.parametrize("min_keys", [1, 64])
def test_splits_past_a_short_prefix_write_nothing(min_keys: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each split takes at least MIN_SPLIT_KEYS keys (whole steps), so over a short prefix the
    last splits get none: they store no partial output (the workspace stays NaN) and the merge
    reads none of theirs. min_keys 1: every split one step of keys."""
    import dllm_serve.kernels.block_attention as ba

    monkeypatch.setattr(ba, "MIN_SPLIT_KEYS", min_keys)
    shape = Shape(8, 2, 16, 32, 64)
    segs = [(160, 32), (0, 32), (64, 32)]  # 192 keys at most: 3 of 8 splits at 64 keys
    out, ref = run_both(shape, segs, torch.float32, splits=8, poison=True)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("combine_rows", [1, 2, 64])
def test_split_k_combine_rows_per_program(combine_rows: int) -> None:
    """40 tokens x 4 heads = 160 (token, head) rows: one row per combine program, two, and
    64 (the last program's rows past 160 masked)."""
    segs = [(200, 8), (0, 8), (72, 8), (136, 16)]
    assert_close(*run_both(SMALL, segs, torch.float32, 8, combine_rows=combine_rows),
                 torch.float32)


def test_choose_combine_rows_fills_an_h200() -> None:
    """B=1 at LLaDA2.0-mini's heads (32 x 16 rows) takes one row per program; larger buckets
    take more rows while at least 4 programs per SM remain, up to 64."""
    from dllm_serve.kernels.block_attention import choose_combine_rows

    rows = {b: choose_combine_rows(b * 32 * 16, 132) for b in (1, 4, 16, 32, 256)}
    assert rows == {1: 1, 4: 2, 16: 8, 32: 16, 256: 64}
    for b, r in rows.items():
        assert r == 1 or -(-b * 32 * 16 // r) >= 4 * 132


def test_batch_one_long_prefix() -> None:
    assert_close(*run_both(SMALL, [(520, 8)], torch.float32, splits=None), torch.float32)


def test_bf16_storage() -> None:
    assert_close(*run_both(SMALL, MIXED, torch.bfloat16, splits=2, seed=1), torch.bfloat16)


def test_choose_num_splits() -> None:
    assert choose_num_splits(num_tiles=1, kv_heads=4, sms=132) == 32
    assert choose_num_splits(num_tiles=16, kv_heads=4, sms=132) == 4
    assert choose_num_splits(num_tiles=64, kv_heads=4, sms=132) == 1


def test_launch_per_bucket_on_an_h200() -> None:
    """LLaDA2.0-mini's denoise buckets (one tile per block, 4 KV heads, 132 SMs): split-K up to
    33 blocks takes the 8-warp launch, one split (34 blocks up, long prefills) the 4-warp one;
    both launches are checked against the reference above (splits=1 and splits > 1)."""
    from dllm_serve.kernels.block_attention import choose_launch

    warps = {b: choose_launch(choose_num_splits(b, 4, 132), 128).num_warps
             for b in (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 128, 256)}
    assert warps == {1: 8, 2: 8, 4: 8, 8: 8, 16: 8, 24: 8, 32: 8, 40: 4, 48: 4, 64: 4,
                     128: 4, 256: 4}


def test_tiles_hold_one_block_without_empty_rows() -> None:
    """A tile holds at most 32 tokens (a denoise block) and at most 128 rows, padded to a power
    of two: G = 4 (LLaDA2.0-mini) 32 tokens in 128 rows as before, G = 2 (the built-in model)
    32 in 64 (it had 64 tokens, half of each denoise tile empty), G = 1 32 in 32, G = 8 16 in
    128; tiles of <= 64 rows take their own launch (64 keys, 4 warps, 2 stages)."""
    from dllm_serve.kernels.block_attention import choose_launch, tile_rows, tokens_per_tile

    geometry = {g: (tokens_per_tile(g), tile_rows(tokens_per_tile(g), g)) for g in (1, 2, 4, 8)}
    assert geometry == {1: (32, 32), 2: (32, 64), 4: (32, 128), 8: (16, 128)}
    assert tile_rows(8, 1) == 16  # the smallest product
    for splits in (1, 4, 32):
        assert choose_launch(splits, 64).block_n == 64
        assert choose_launch(splits, 64).num_warps == 4
        assert choose_launch(splits, 128).block_n == 32
    with pytest.raises(ValueError, match="heads per KV head"):
        tokens_per_tile(16)


MINI = Shape(heads=16, kv_heads=4, head_dim=128, block=32, page=32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,prefix", [(1, 4096), (4, 1024), (16, 4096), (64, 1024)])
def test_llada2_mini_denoise_round(batch: int, prefix: int) -> None:
    rng = np.random.default_rng(batch)
    starts = (rng.integers(prefix // 2, prefix, batch) // 32 * 32).tolist()
    segs = [(s, 32) for s in starts]
    assert_close(*run_both(MINI, segs, torch.bfloat16, splits=None), torch.bfloat16)


@pytest.mark.gpu
def test_llada2_mini_prefill_chunks_with_denoise() -> None:
    segs = [(0, 4096), (1024, 2048), (3000 // 32 * 32, 32), (64, 32), (0, 32)]
    assert_close(*run_both(MINI, segs, torch.bfloat16, splits=None), torch.bfloat16)
