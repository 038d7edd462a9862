"""Do the expert GEMMs run faster with the weight tile as the MMA's M operand (swap-AB)?

A probe, not part of the project (its result is in swap_ab_probe_*.json). The served kernels
(kernels/fused_moe.py) multiply a block's BLOCK_M token rows (16-64) by a weight tile: with
BLOCK_M < 64 an H200's warpgroup MMA (M = 64 per warpgroup) does not apply. Here each program
computes the transposed tile instead, (BLOCK_N weight rows) x (BLOCK_M tokens) = W_tile @
x_rows^T, so the weight rows are M (64 or 128) and the tokens N, and stores it transposed.
Same blocks, same program orders (block-major or N-major) as the served kernels; routed experts
only. Timed against up_proj / down_proj at the table's launches (median of 10 bursts of 5
launches), outputs compared.

    python3 benchmarks/results/h200/gpupath/swap_ab_probe.py out.json
"""

import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.round_roofline import time_ms  # noqa: E402
from dllm_serve.kernels import fused_moe as fm  # noqa: E402
from dllm_serve.kernels.moe_launch import choose_moe_launches  # noqa: E402

E, HIDDEN, INTER, TOP_K = 256, 2048, 512, 8


@triton.jit
def _tile(SortedRows, BlockExpert, NumSlots, all_blocks, n_cols, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_MAJOR: tl.constexpr):
    if BLOCK_MAJOR:
        n_tiles = tl.cdiv(n_cols, BLOCK_N)
        block = tl.program_id(0) // n_tiles
        n_tile = tl.program_id(0) % n_tiles
    else:
        block = tl.program_id(0) % all_blocks
        n_tile = tl.program_id(0) // all_blocks
    expert = tl.load(BlockExpert + block)
    expert = tl.where(block * BLOCK_M < tl.load(NumSlots), expert, -1)
    rows = tl.load(SortedRows + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, rows, n_tile * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _up_swap(X, W13, H, SortedRows, BlockExpert, NumSlots, stride_we, all_blocks, num_rows,
             hidden, inter, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_MAJOR: tl.constexpr):
    expert, rows, n = _tile(SortedRows, BlockExpert, NumSlots, all_blocks, inter, BLOCK_M,
                            BLOCK_N, BLOCK_MAJOR)
    if expert >= 0:
        valid = rows < num_rows
        n_ok = n < inter
        tokens = rows // TOP_K
        w = W13 + expert.to(tl.int64) * stride_we
        gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(X + tokens[None, :] * hidden + kk[:, None], mask=valid[None, :],
                         other=0.0)  # (BLOCK_K, BLOCK_M)
            wg = tl.load(w + n[:, None] * hidden + kk[None, :], mask=n_ok[:, None], other=0.0)
            wu = tl.load(w + (inter + n[:, None]) * hidden + kk[None, :], mask=n_ok[:, None],
                         other=0.0)  # (BLOCK_N, BLOCK_K)
            gate += tl.dot(wg, xt)
            up += tl.dot(wu, xt)
        h = gate * tl.sigmoid(gate) * up  # (BLOCK_N, BLOCK_M)
        tl.store(H + rows[None, :] * inter + n[:, None], h.to(H.dtype.element_ty),
                 mask=valid[None, :] & n_ok[:, None])


@triton.jit
def _down_swap(H, W2, Y, SortedRows, BlockExpert, NumSlots, stride_we, all_blocks, num_rows,
               hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_MAJOR: tl.constexpr):
    expert, rows, n = _tile(SortedRows, BlockExpert, NumSlots, all_blocks, hidden, BLOCK_M,
                            BLOCK_N, BLOCK_MAJOR)
    if expert >= 0:
        valid = rows < num_rows
        n_ok = n < hidden
        w = W2 + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            ht = tl.load(H + rows[None, :] * inter + kk[:, None], mask=valid[None, :],
                         other=0.0)  # (BLOCK_K, BLOCK_M)
            wt = tl.load(w + n[:, None] * inter + kk[None, :], mask=n_ok[:, None], other=0.0)
            acc += tl.dot(wt, ht)
        tl.store(Y + rows[None, :] * hidden + n[:, None], acc.to(Y.dtype.element_ty),
                 mask=valid[None, :] & n_ok[:, None])


def up_swap(x, w13, blocks, c):
    h = x.new_empty(x.shape[0] * TOP_K, INTER)
    nb = blocks.max_blocks
    _up_swap[(nb * triton.cdiv(INTER, c["bn"]),)](
        x, w13, h, blocks.sorted_rows, blocks.block_expert, blocks.num_slots, w13.stride(0), nb,
        h.shape[0], HIDDEN, INTER, TOP_K=TOP_K, BLOCK_M=blocks.block_m, BLOCK_N=c["bn"],
        BLOCK_K=c["bk"], BLOCK_MAJOR=c["bm"], num_warps=c["w"], num_stages=c["s"])
    return h


def down_swap(h, w2, blocks, c):
    y = h.new_empty(h.shape[0], HIDDEN)
    nb = blocks.max_blocks
    _down_swap[(nb * triton.cdiv(HIDDEN, c["bn"]),)](
        h, w2, y, blocks.sorted_rows, blocks.block_expert, blocks.num_slots, w2.stride(0), nb,
        h.shape[0], HIDDEN, INTER, BLOCK_M=blocks.block_m, BLOCK_N=c["bn"], BLOCK_K=c["bk"],
        BLOCK_MAJOR=c["bm"], num_warps=c["w"], num_stages=c["s"])
    return y


def burst_us(fn, dev):
    def burst():
        for _ in range(5):
            fn()
    return 1e3 * time_ms(burst, 2, 10, dev) / 5


def best_of(fn, ref, configs, dev):
    """Every config of one swapped kernel: error against the served output, time; the best."""
    rows = []
    for c in configs:
        v = dict(c)
        try:
            v["max_abs_err"] = (fn(c).float() - ref.float()).abs().max().item()
            v["us"] = burst_us(lambda c=c: fn(c), dev)
        except Exception as exc:
            v["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        rows.append(v)
    ok = [v for v in rows if "us" in v and v["max_abs_err"] < 0.05]
    return rows, (min(ok, key=lambda v: v["us"]) if ok else None)


def one_size(tokens, w13, w2, gen, dev, configs):
    ids = torch.rand(tokens, E, generator=gen, device=dev).topk(TOP_K, 1).indices
    blocks = fm.expert_blocks(ids, E)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=dev).bfloat16()
    up_l, down_l = choose_moe_launches(tokens * TOP_K)
    h = fm.up_proj(x, w13, blocks, TOP_K, up_l)
    y = fm.down_proj(h, w2, blocks, down_l)
    row = {"tokens": tokens, "block_m": blocks.block_m,
           "served_up_us": burst_us(lambda: fm.up_proj(x, w13, blocks, TOP_K, up_l), dev),
           "served_down_us": burst_us(lambda: fm.down_proj(h, w2, blocks, down_l), dev)}
    print(tokens, "served", row["served_up_us"], row["served_down_us"], flush=True)
    row["up"], row["best_up"] = best_of(lambda c: up_swap(x, w13, blocks, c), h,
                                        configs, dev)
    row["down"], row["best_down"] = best_of(lambda c: down_swap(h, w2, blocks, c), y,
                                            configs, dev)
    for kind in ("up", "down"):
        print(tokens, kind, "BEST", row[f"best_{kind}"], "served", row[f"served_{kind}_us"],
              flush=True)
    return row


def main(out_path):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = 0.02 * torch.randn(E, 2 * INTER, HIDDEN, generator=gen, device=dev, dtype=torch.bfloat16)
    w2 = 0.02 * torch.randn(E, HIDDEN, INTER, generator=gen, device=dev, dtype=torch.bfloat16)
    configs = [dict(bn=bn, bk=bk, w=w, s=s, bm=bm) for bn, bk, w, s, bm in
               itertools.product((64, 128), (64, 128), (4, 8), (3,), (False, True))]
    with torch.inference_mode():
        results = [one_size(t, w13, w2, gen, dev, configs) for t in (128, 512, 1024, 2048)]
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
