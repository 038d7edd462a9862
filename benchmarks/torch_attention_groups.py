"""The plain PyTorch attention (`TorchAttention`, the CPU path) with its segments padded in one
group against in groups of similar key length (`length_groups`), at the built-in model's
attention shape (4 heads, 2 KV heads, head dim 64, 32-token blocks, 6 layers) and FDFO-like
batches: 16 denoise blocks whose prefixes mix prompts of 64-160 tokens with 0-128 generated.

    python benchmarks/torch_attention_groups.py --costs 1000000000 0 128 256 512 1024

Per GROUP_COST (1e9: never split): ms of attention per forward (the metadata once, then six
layers), one thread, the mean over --repeats passes of 20 batches; and the groups per forward.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_kernels_attention import Shape, forward_batch, scattered_cache  # noqa: E402

from benchmarks.common import git_commit, write_json  # noqa: E402
from dllm_serve.layers import attention  # noqa: E402
from dllm_serve.layers.attention import TorchAttention  # noqa: E402

SHAPE = Shape(heads=4, kv_heads=2, head_dim=64, block=32, page=32)
LAYERS = 6


def batches(count: int, rows: int, seed: int) -> list[list[tuple[int, int]]]:
    rng = random.Random(seed)
    return [[((rng.randint(2, 5) + rng.randint(0, 4)) * SHAPE.block, SHAPE.block)
             for _ in range(rows)] for _ in range(count)]


def measure(cost: int, cases: list[list[tuple[int, int]]], repeats: int) -> dict[str, Any]:
    attention.GROUP_COST = cost
    gen = torch.Generator().manual_seed(0)
    total, groups, n = 0.0, 0, 0
    for _ in range(repeats):
        for segs in cases:
            kv = scattered_cache(SHAPE, segs, torch.float32, gen)
            t = sum(length for _, length in segs)
            q = torch.randn(t, SHAPE.heads, SHAPE.head_dim, generator=gen)
            k = torch.randn(t, SHAPE.kv_heads, SHAPE.head_dim, generator=gen)
            v = torch.randn(t, SHAPE.kv_heads, SHAPE.head_dim, generator=gen)
            attn = TorchAttention(kv, SHAPE.heads, SHAPE.head_dim, SHAPE.head_dim ** -0.5)
            start = time.perf_counter()
            fb = forward_batch(kv, segs, SHAPE.block, attn)
            for _ in range(LAYERS):
                attn.forward(0, q, k, v, fb)
            total += time.perf_counter() - start
            groups += len(fb.attn_meta)
            n += 1
    return {"group_cost": cost, "ms_per_forward": 1e3 * total / n, "groups_per_forward": groups / n}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", type=int, nargs="+", default=[10 ** 9, 128, 256, 512])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = batches(20, ns.rows, seed=0)
    saved = attention.GROUP_COST
    try:
        rows = [measure(c, cases, ns.repeats) for c in ns.costs]
    finally:
        attention.GROUP_COST = saved
    for r in rows:
        print(f"GROUP_COST {r['group_cost']:>10d}: {r['ms_per_forward']:7.2f} ms of attention a "
              f"forward, {r['groups_per_forward']:.2f} groups")
    write_json(ns.out, {"benchmark": "torch_attention_groups", "git_commit": git_commit(),
                        "config": vars(ns), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
