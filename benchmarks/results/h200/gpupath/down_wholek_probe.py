"""Is the expert down GEMM faster with each program holding its rows' whole reduction?

A probe, not part of the project (its result is in down_wholek_probe_*.json). The served
`_down_kernel` (kernels/fused_moe.py) gives each program one (block, N tile) and loops over K
= moe_intermediate_size (512 at LLaDA2.0-mini: 4 steps of 128), so programs are short and the
pipeline barely fills. Here a program loads its block's rows of h once, all of K (BLOCK_M, K),
then streams TILES weight tiles (BLOCK_N, K) of its expert, one dot and one store each: a loop
the compiler can pipeline over tiles instead of K steps. Timed against `down_proj` at the
table's launch for each size (median of --iters bursts of 5 launches, as benchmarks/moe_tune.py
times), outputs compared. Routed experts only (no shared expert).

    python3 benchmarks/results/h200/gpupath/down_wholek_probe.py out.json
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
def _down_wholek(H, W2, Y, SortedRows, BlockExpert, NumSlots, stride_we, num_rows, hidden,
                 INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 TILES: tl.constexpr):
    groups = tl.cdiv(tl.cdiv(hidden, BLOCK_N), TILES)
    block = tl.program_id(0) // groups
    group = tl.program_id(0) % groups
    expert = tl.load(BlockExpert + block)
    if block * BLOCK_M < tl.load(NumSlots):
        rows = tl.load(SortedRows + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < num_rows
        k = tl.arange(0, INTER)
        a = tl.load(H + rows[:, None] * INTER + k[None, :], mask=valid[:, None], other=0.0)
        w = W2 + expert.to(tl.int64) * stride_we
        for j in range(TILES):
            n = (group * TILES + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < hidden
            wt = tl.load(w + n[:, None] * INTER + k[None, :], mask=n_ok[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(wt))
            tl.store(Y + rows[:, None] * hidden + n[None, :], acc.to(Y.dtype.element_ty),
                     mask=valid[:, None] & n_ok[None, :])


def wholek(h, w2, blocks, block_n, tiles, warps, stages):
    y = h.new_empty(h.shape[0], HIDDEN)
    groups = triton.cdiv(triton.cdiv(HIDDEN, block_n), tiles)
    _down_wholek[(blocks.max_blocks * groups,)](
        h, w2, y, blocks.sorted_rows, blocks.block_expert, blocks.num_slots, w2.stride(0),
        h.shape[0], HIDDEN, INTER=INTER, BLOCK_M=blocks.block_m, BLOCK_N=block_n, TILES=tiles,
        num_warps=warps, num_stages=stages)
    return y


def burst_us(fn, dev):
    def burst():
        for _ in range(5):
            fn()
    return 1e3 * time_ms(burst, 2, 10, dev) / 5


def variant(h, w2, blocks, ref, dev, bn, tiles, warps, stages):
    """One launch of the whole-K kernel: its error against the served output and its time."""
    v = {"block_n": bn, "tiles": tiles, "warps": warps, "stages": stages}
    try:
        y = wholek(h, w2, blocks, bn, tiles, warps, stages)
        v["max_abs_err"] = (y.float() - ref.float()).abs().max().item()
        v["us"] = burst_us(lambda: wholek(h, w2, blocks, bn, tiles, warps, stages), dev)
    except Exception as exc:
        v["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    print(h.shape[0] // TOP_K, v, flush=True)
    return v


def one_size(tokens, w2, gen, dev):
    ids = torch.rand(tokens, E, generator=gen, device=dev).topk(TOP_K, 1).indices
    blocks = fm.expert_blocks(ids, E)
    h = torch.randn(tokens * TOP_K, INTER, generator=gen, device=dev).bfloat16()
    launch = choose_moe_launches(tokens * TOP_K)[1]
    ref = fm.down_proj(h, w2, blocks, launch)
    base = burst_us(lambda: fm.down_proj(h, w2, blocks, launch), dev)
    row = {"tokens": tokens, "block_m": blocks.block_m, "served_us": base,
           "served": repr(launch),
           "variants": [variant(h, w2, blocks, ref, dev, *c) for c in
                        itertools.product((32, 64), (4, 8, 16), (4, 8), (2, 3))]}
    ok = [v for v in row["variants"] if "us" in v and v["max_abs_err"] < 0.05]
    row["best"] = min(ok, key=lambda v: v["us"]) if ok else None
    print(tokens, "BEST", row["best"], "served", round(base, 1), flush=True)
    return row


def main(out_path):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w2 = 0.02 * torch.randn(E, HIDDEN, INTER, generator=gen, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        results = [one_size(tokens, w2, gen, dev) for tokens in (128, 512, 1024, 2048)]
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
