"""Block-diffusion paged attention: one launch for every segment of a batch.

Mask: `layers.attention.block_causal`, the same predicate as the reference. A query at absolute
position q of a segment [seg_start, seg_start + seg_len) sees the keys of its request at
positions k < min((q // block_size + 1) * block_size, seg_start + seg_len): every earlier block
and its own block bidirectionally. Keys are read through the page table:
slot = req_to_page[req, k // page_size] * page_size + k % page_size.

Work split. A *tile* is up to `TQ` consecutive query tokens of one segment, for all `G` query
heads that share one KV head (GQA): BLOCK_M = TQ * G rows (padded to a power of two), so each
K/V tile is loaded once for G heads. TQ is at most TILE_TOKENS (one 32-token block: what a
denoise segment holds) and at most MAX_BLOCK_M // G, so a denoise tile has no empty rows: 128
rows at LLaDA2.0-mini's 16 / 4 heads, 64 at the built-in model's 4 / 2 (where tiles of 64
tokens left half of each denoise tile empty). Grid = (tiles, kv_heads, splits). With splits > 1
(long prefixes at small batch) each program covers one slice of the tile's key range and writes a
normalised partial output and its log2-sum-exp to a workspace; `_combine_kernel` merges them.
Softmax is online (flash-attention style) in fp32, in the log2 domain. Key steps that every row
of a tile sees (all of a denoise block's prefix and block) run without the mask, and with pages
that hold whole steps (the engine's pages are blocks) a step looks its page up once. On an H200
at LLaDA2.0-mini's heads (benchmarks/attention_tune.py, K/V rotated past the L2 cache): B=64
64.7 / 221 us a layer at prefix ~1k / ~4k against 71.9 / 248 with a masked lookup per key,
B=16 28.1 / 67.5 against 29.5 / 75.0 (results/h200/gpupath/attention_tune_unmasked_bf3d949.json).
Each step looks its next step's page up before loading its own K/V (`_attend`): with the lookup
feeding the same step's loads the compiler kept one step's K/V copies in flight, now two. Served
launches at ~1k / ~4k against the step before: B=16 25.4 / 56.1 us against 28.2 / 67.8, B=32 36.4
/ 101.4 against 44.0 / 118.1, B=64 54.0 / 199.1 against 64.7 / 221.3
(results/h200/gpupath/attention_tune_prefetch.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import (
    cdiv,
    check_device,
    floor_pow2,
    interpreted,
    next_pow2,
    num_sms,
)
from dllm_serve.kernels.triton_utils import dot
from dllm_serve.utils.device import to_device

LOG2E = 1.4426950408889634
MAX_BLOCK_M = 128  # query rows (tokens x grouped heads) per tile, at most
TILE_TOKENS = 32  # query tokens per tile, at most
TILE_FIELDS = 5  # Tiles rows: (segment, first token in segment, seg_start, seg_len, token offset)
# The split-K combine: (token, head) rows per program at most, and programs per SM at least where
# the rows allow. 64 rows per program left 8 programs for B=1 at LLaDA2.0-mini's heads (32 tokens
# x 16 heads), each merging 32 splits of 64 x 128 fp32 alone: 190 us per layer on an H200.
COMBINE_MAX_ROWS = 64
COMBINE_PROGRAMS_PER_SM = 4
# Keys per split at least (rounded up to whole steps). The split count is fixed per CUDA-graph
# bucket, before any prefix length is known; a short prefix then spreads over fewer splits and
# the rest exit at once, writing only a -inf log-sum-exp that the merge skips. At B = 1 on an
# H200 (benchmarks/attention_tune.py, results/h200/gpupath/attention_tune_splits_e585189.json)
# a split of ~64 keys was the fastest at prefix ~1k (16 splits: 9.4 us a layer with the merge,
# 32 splits of ~30 keys: 10.6 us) and 32 splits of ~115 keys at ~4k (13.1 us, 16: 14.0). In
# rounds on an H100 (results/h200/gpupath/direct_probe_h100_1304e3f.json, two turns each) B = 2
# at ~1k took 7.99 against 8.04 ms; B = 1 and 4 and every ~4k row within 0.01 ms either way.
MIN_SPLIT_KEYS = 64


@dataclass(frozen=True)
class Launch:
    """Keys per inner step, warps and pipeline stages of one attention launch."""

    block_n: int
    num_warps: int
    num_stages: int


# The launch by tile rows and key-range splits (the one table; a plan's tile rows and split count
# are fixed per bucket, so each bucket has its launch): the first row whose bounds hold the
# plan's. Tiles of <= 64 rows (the built-in model's 2 heads a KV head x 32 tokens): 64 keys, 4
# warps, 2 stages, the fastest at B = 16 / 24 / 32, prefix ~256, 4 / 2 heads of 64 (7.7 / 8.4 /
# 8.8 us a layer against 8.9 / 10.3 / 10.8 for 128-row tiles of 64 tokens with the 8-warp launch:
# results/h200/gpupath/attention_tune_builtin_1354cb5.json). 128-row tiles: with split-K
# (small batches, where the tiles alone leave SMs idle) 32 keys, 8 warps, 3 stages: the fastest
# launch keeping BLOCK_M = 128 at B=16 and 32, prefix ~4k, LLaDA2.0-mini's heads, in
# benchmarks/attention_tune.py on an H200 (results/h200/attention_tune.json: 83 / 144 us per
# layer against 108 / 189 us for 64 keys, 8 warps, 2 stages), and in whole rounds at B=1-32
# (results/h200/perf/roofline_attention_n32.md against roofline.json: equal at B=1, 0.2-0.9 ms
# faster at B=4-32). Once the tiles fill the device (one split: B >= 34 blocks on an H200's
# 132 SMs, and long prefills) 32 keys, 4 warps, 3 stages: each program walks the whole prefix;
# at B=64 it took 86.7 / 285.4 us per layer at prefix ~1k / ~4k against 115.0 / 392.8 for the
# earlier 64 keys, 8 warps, 2 stages, and 122.4 / 430.0 for 32 keys with 8 warps
# (results/h200/gpupath/attention_tune_b64_1844ce3.json).
LAUNCHES: tuple[tuple[int, int, Launch], ...] = (  # (most tile rows, most splits, launch)
    (64, 1 << 30, Launch(block_n=64, num_warps=4, num_stages=2)),
    (MAX_BLOCK_M, 1, Launch(block_n=32, num_warps=4, num_stages=3)),
    (MAX_BLOCK_M, 1 << 30, Launch(block_n=32, num_warps=8, num_stages=3)),
)


def choose_launch(num_splits: int, block_m: int) -> Launch:
    return next(launch for rows, splits, launch in LAUNCHES
                if block_m <= rows and num_splits <= splits)


def choose_combine_rows(num_rows: int, sms: int) -> int:
    """(token, head) rows per combine program for `num_rows` = T * H: the largest power of two
    in [1, COMBINE_MAX_ROWS] leaving at least COMBINE_PROGRAMS_PER_SM programs per SM (1 when
    even one row per program leaves fewer). Shapes only, so fixed per CUDA-graph bucket."""
    return floor_pow2(min(num_rows // (COMBINE_PROGRAMS_PER_SM * sms), COMBINE_MAX_ROWS))


@dataclass
class BlockAttnPlan:
    """Per-forward launch metadata, built once by `plan_block_attention` (on the device)."""

    tiles: torch.Tensor  # (num_tiles, TILE_FIELDS) int32
    tokens_per_tile: int  # TQ
    block_m: int  # query rows per tile: tile_rows(TQ, G)
    num_splits: int  # key-range slices per tile (a power of two)
    num_tokens: int  # T
    block_size: int
    ws_out: torch.Tensor | None  # (splits, T, H, D) fp32 partial outputs, when splits > 1
    ws_lse: torch.Tensor | None  # (splits, T, H) fp32 partial log2-sum-exp
    launch: Launch  # from LAUNCHES by block_m and num_splits
    combine_rows: int  # BLOCK_R of the split-K combine, from choose_combine_rows


def tokens_per_tile(group: int) -> int:
    """TQ: query tokens per tile, TILE_TOKENS or fewer so that TQ * group fits MAX_BLOCK_M."""
    if group > MAX_BLOCK_M // 16:
        raise ValueError(f"{group} query heads per KV head is more than this kernel supports "
                         f"({MAX_BLOCK_M // 16})")
    return min(MAX_BLOCK_M // group, TILE_TOKENS)


def tile_rows(tq: int, group: int) -> int:
    """BLOCK_M: a tile's query rows, TQ tokens x `group` heads padded to a power of two (>= 16,
    the smallest tensor-core product)."""
    return max(16, next_pow2(tq * group))


def plan_tiles(seg_starts: list[int], seg_lens: list[int], tq: int) -> np.ndarray:
    """(num_tiles, TILE_FIELDS) int32: segments cut into tiles of at most tq tokens."""
    lens = np.asarray(seg_lens, dtype=np.int64)
    per_seg = -(-lens // tq)  # (S,)
    seg = np.repeat(np.arange(len(lens)), per_seg)  # (num_tiles,)
    first_tile = np.cumsum(per_seg) - per_seg  # (S,)
    q0 = (np.arange(len(seg)) - first_tile[seg]) * tq
    token_offset = (np.cumsum(lens) - lens)[seg]
    starts = np.asarray(seg_starts, dtype=np.int64)[seg]
    return np.stack([seg, q0, starts, lens[seg], token_offset], axis=1).astype(np.int32)


def plan_block_attention(seg_starts: list[int], seg_lens: list[int], block_size: int,
                         num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                         device: torch.device) -> BlockAttnPlan:
    """Tiles (one host-to-device copy) and, for split-K, the fp32 workspaces."""
    tq = tokens_per_tile(num_heads // num_kv_heads)
    tiles = to_device(plan_tiles(seg_starts, seg_lens, tq), device)
    return plan_over_tiles(tiles, tq, num_splits, int(sum(seg_lens)), block_size, num_heads,
                           num_kv_heads, head_dim, num_sms(device))


def plan_over_tiles(tiles: torch.Tensor, tq: int, num_splits: int, num_tokens: int,
                    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    sms: int) -> BlockAttnPlan:
    """The plan over a device tile table (num_tiles, TILE_FIELDS): launches chosen from the
    shapes, and with splits > 1 the workspaces (splits, T, H, D) and (splits, T, H) fp32."""
    ws_out = ws_lse = None
    if num_splits > 1:
        ws_out = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32,
                             device=tiles.device)
        ws_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32,
                             device=tiles.device)
    block_m = tile_rows(tq, num_heads // num_kv_heads)
    return BlockAttnPlan(tiles, tq, block_m, num_splits, num_tokens, block_size, ws_out, ws_lse,
                         choose_launch(num_splits, block_m),
                         choose_combine_rows(num_tokens * num_heads, sms))


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_page: torch.Tensor, seg_req: torch.Tensor, plan: BlockAttnPlan,
                    page_size: int, scale: float) -> torch.Tensor:
    """q (T, H, D), k_cache/v_cache (slots, KVH, D), req_to_page (R, P), seg_req (S,)
    -> (T, H * D) in q.dtype. The segments' own K/V must already be in the cache."""
    check_device(q, "block_attention")
    if q.stride(-1) != 1:
        q = q.contiguous()
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    out = q.new_empty(t, h * d)
    if t == 0:
        return out
    grid = (plan.tiles.shape[0], kvh, plan.num_splits)
    split = plan.num_splits > 1
    launch = plan.launch
    _attention_kernel[grid](
        q, k_cache, v_cache, out, plan.ws_out if split else out, plan.ws_lse if split else out,
        req_to_page, seg_req, plan.tiles, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), req_to_page.stride(0), t,
        NUM_HEADS=h, G=h // kvh, TQ=plan.tokens_per_tile, HEAD_DIM=d, PAGE=page_size,
        BLOCK=plan.block_size, NUM_SPLITS=plan.num_splits, BLOCK_M=plan.block_m,
        BLOCK_N=launch.block_n, BLOCK_D=next_pow2(max(d, 16)), MIN_KEYS=MIN_SPLIT_KEYS,
        DOT_F32=interpreted(),
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if split:
        rows = plan.combine_rows
        _combine_kernel[(cdiv(t * h, rows),)](
            plan.ws_out, plan.ws_lse, out, out.stride(0), t * h, NUM_HEADS=h, HEAD_DIM=d,
            NUM_SPLITS=plan.num_splits, BLOCK_R=rows, BLOCK_D=next_pow2(max(d, 16)),
            num_warps=4)
    return out


@triton.jit
def _tile_rows(Tiles, SegReq, tile, G: tl.constexpr, TQ: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Per row of a tile: token row in T, head within the group, validity, key limit."""
    meta = Tiles + tile * 5
    seg = tl.load(meta)
    q0 = tl.load(meta + 1)
    seg_start = tl.load(meta + 2)
    seg_len = tl.load(meta + 3)
    token_offset = tl.load(meta + 4)
    req = tl.load(SegReq + seg)
    r = tl.arange(0, BLOCK_M)
    tok = q0 + r // G  # (BLOCK_M,) token index within the segment
    valid = (r < TQ * G) & (tok < seg_len)
    seg_end = seg_start + seg_len
    limit = tl.minimum(((seg_start + tok) // BLOCK + 1) * BLOCK, seg_end)  # keys < limit
    last = tl.minimum(q0 + TQ, seg_len) - 1
    kv_hi = tl.minimum(((seg_start + last) // BLOCK + 1) * BLOCK, seg_end)
    return req, token_offset + tok, r % G, valid, limit, kv_hi


@triton.jit
def _key_slots(PageTable, req, start, hi, stride_pt, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Cache rows (BLOCK_N,) int64 of keys start + arange(BLOCK_N), start a multiple of
    BLOCK_N; the page lookups are masked past `hi` (a step past the range: rows unused). When a
    page holds whole steps (PAGE a multiple of BLOCK_N: the engine's pages are blocks, 32 keys
    in LLaDA2) the step's keys are consecutive rows of one page: one scalar lookup instead of
    one per key."""
    kpos = start + tl.arange(0, BLOCK_N)
    if PAGE % BLOCK_N == 0:
        page = tl.load(PageTable + req * stride_pt + start // PAGE, mask=start < hi, other=0)
        return page.to(tl.int64) * PAGE + start % PAGE + tl.arange(0, BLOCK_N)
    else:
        page = tl.load(PageTable + req * stride_pt + kpos // PAGE, mask=kpos < hi, other=0)
        return page.to(tl.int64) * PAGE + kpos % PAGE


@triton.jit
def _step(q, K, V, slot, kvh, start, hi, limit, m, l_sum, acc, stride_kt, stride_kh,
          stride_vt, stride_vh, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N), whose cache rows are `slot`
    (BLOCK_N,). Unless MASKED every key of the step is below hi and below every valid row's
    limit: no key mask, and scores are finite (the tile's padding rows have q = 0)."""
    kpos = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kin = kpos < hi
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        kv_mask = kin[:, None] & (d[None, :] < HEAD_DIM)
    else:
        kv_mask = d[None, :] < HEAD_DIM  # (1, BLOCK_D)
    k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask,
                other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask,
                other=0.0)
    s = dot(q, tl.trans(k), DOT_F32) * scale_log2  # (BLOCK_M, BLOCK_N)
    if MASKED:
        seen = kin[None, :] & (kpos[None, :] < limit[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m - m_ref)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
    return m_new, l_sum, acc


@triton.jit
def _attend(q, K, V, PageTable, req, kvh, lo, hi, limit, seen_by_all, stride_kt, stride_kh,
            stride_vt, stride_vh, stride_pt, scale_log2, PAGE: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax of q against keys [lo, hi) -> (row max, row sum, unnormalised out).
    The whole steps below `seen_by_all` (keys every valid row sees: a denoise block's prefix
    and the block itself) run without the mask; the rest (a prefill tile's own blocks, the
    last partial step) with it. Each step looks up the next step's pages before it loads its
    own K/V (`slot` is carried): no load in a step's K/V addresses comes from that step, so the
    compiler keeps several steps' K/V copies in flight (num_stages) instead of one, which is
    what a page lookup feeding the same step's loads allowed."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    mid = lo + tl.maximum(tl.minimum(seen_by_all, hi) - lo, 0) // BLOCK_N * BLOCK_N
    slot = _key_slots(PageTable, req, lo, hi, stride_pt, PAGE, BLOCK_N)
    for start in range(lo, mid, BLOCK_N):
        here = slot
        slot = _key_slots(PageTable, req, start + BLOCK_N, hi, stride_pt, PAGE, BLOCK_N)
        m, l_sum, acc = _step(q, K, V, here, kvh, start, hi, limit, m, l_sum, acc, stride_kt,
                              stride_kh, stride_vt, stride_vh, scale_log2, HEAD_DIM, BLOCK_N,
                              BLOCK_D, False, DOT_F32)
    for start in range(mid, hi, BLOCK_N):
        here = slot
        slot = _key_slots(PageTable, req, start + BLOCK_N, hi, stride_pt, PAGE, BLOCK_N)
        m, l_sum, acc = _step(q, K, V, here, kvh, start, hi, limit, m, l_sum, acc, stride_kt,
                              stride_kh, stride_vt, stride_vh, scale_log2, HEAD_DIM, BLOCK_N,
                              BLOCK_D, True, DOT_F32)
    return m, l_sum, acc


@triton.jit
def _attention_kernel(Q, K, V, Out, WsOut, WsLse, PageTable, SegReq, Tiles, scale_log2,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_ot, stride_pt, num_tokens, NUM_HEADS: tl.constexpr,
                      G: tl.constexpr, TQ: tl.constexpr, HEAD_DIM: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      MIN_KEYS: tl.constexpr, DOT_F32: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, t, hq, valid, limit, kv_hi = _tile_rows(Tiles, SegReq, tile, G, TQ, BLOCK, BLOCK_M)
    head = kvh * G + hq  # (BLOCK_M,)
    d = tl.arange(0, BLOCK_D)
    row_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    chunk = tl.cdiv(tl.maximum(tl.cdiv(kv_hi, NUM_SPLITS), MIN_KEYS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_hi)
    seen_by_all = tl.min(tl.where(valid, limit, kv_hi), 0)
    m, l_sum, acc = _attend(q, K, V, PageTable, req, kvh, lo, hi, limit, seen_by_all,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, scale_log2,
                            PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, DOT_F32)
    has_keys = l_sum > 0.0
    out = acc / tl.where(has_keys, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(Out + t[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_mask)
    else:
        row = (split * num_tokens + t) * NUM_HEADS + head  # (BLOCK_M,) workspace row
        wrote = valid & (tl.zeros([BLOCK_M], tl.int32) + lo < kv_hi)  # past the keys: no out
        tl.store(WsOut + row[:, None] * HEAD_DIM + d[None, :], out,
                 mask=wrote[:, None] & (d[None, :] < HEAD_DIM))
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l_sum, 1.0)), float("-inf"))
        tl.store(WsLse + row, lse, mask=valid)


@triton.jit
def _combine_kernel(WsOut, WsLse, Out, stride_ot, num_rows, NUM_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Merge the splits' partial outputs of BLOCK_R (token, head) rows. A split whose lse is
    -inf saw no keys and wrote no output: its rows are not read."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) = t * H + h
    rmask = r < num_rows
    d = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (d[None, :] < HEAD_DIM)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(WsLse + s * num_rows + r, mask=rmask,
                                      other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(WsLse + s * num_rows + r, mask=rmask, other=float("-inf"))
        w = tl.exp2(lse - top)
        o = tl.load(WsOut + (s * num_rows + r)[:, None] * HEAD_DIM + d[None, :],
                    mask=mask & (lse > float("-inf"))[:, None], other=0.0)
        acc += w[:, None] * o
        den += w
    out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    t = r // NUM_HEADS
    h = r % NUM_HEADS
    tl.store(Out + t[:, None] * stride_ot + h[:, None] * HEAD_DIM + d[None, :],
             out.to(Out.dtype.element_ty), mask=mask)
