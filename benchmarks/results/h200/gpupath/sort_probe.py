"""The expert sort's launch variants (kernels/moe_sort.py) at LLaDA2.0-mini's routing (256
experts, top-8, a skewed draw), each timed in a CUDA graph of 20 back-to-back sorts (median of
15 replays) and checked equal to the oracle `align_by_expert`:

    python3 benchmarks/results/h200/gpupath/sort_probe.py sort_probe.json

Variants: chunk size, warps of the placing launch, and whether counts and prefix are one launch
(`_count_prefix_kernel`) or two, set through moe_sort's launch constants (its count and prefix
launches take 4 warps). The first run of session (4) also swept the count launch's warps and the
fused launch's expert slice and warps, from a copy of the launch code."""
import itertools
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.round_roofline import graphed, time_ms
from dllm_serve.kernels import moe_sort as ms
from dllm_serve.kernels.moe_align import align_by_expert, choose_block_m

E, K = 256, 8


def sort(ids, bm, chunk, place_warps, fused):
    """`sort_by_expert` with its launch constants set to one variant (restored after)."""
    saved = ms.CHUNK, ms.PLACE_WARPS, ms.FUSED_CHUNKS
    ms.CHUNK, ms.PLACE_WARPS, ms.FUSED_CHUNKS = chunk, place_warps, (1 << 30) if fused else 0
    try:
        return ms.sort_by_expert(ids, E, bm)
    finally:
        ms.CHUNK, ms.PLACE_WARPS, ms.FUSED_CHUNKS = saved


def main(out):
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    res = []
    for t in (32, 128, 512, 2048):
        a = t * K
        bm = choose_block_m(a, E)
        # skewed routing: experts drawn from a Zipf-like weight, K distinct per token
        w = 1.0 / torch.arange(1, E + 1).float() ** 0.6
        ids = torch.multinomial(w.expand(t, E), K, generator=g).to(dev)
        ref = align_by_expert(ids, E, bm)
        variants = list(itertools.product((64, 128), (2, 4), (False, True)))
        for v in variants:
            try:
                r = sort(ids, bm, *v)
                torch.cuda.synchronize()
                ok = (torch.equal(r.sorted_rows, ref.sorted_rows)
                      and torch.equal(r.block_expert, ref.block_expert)
                      and torch.equal(r.num_slots, ref.num_slots))
                n = 20
                def burst(ids=ids, bm=bm, v=v, n=n):
                    return [sort(ids, bm, *v) for _ in range(n)]
                f = graphed(burst, dev)
                us = 1e3 * time_ms(f, 3, 15, dev) / n
            except Exception as e:  # noqa: BLE001
                print(t, v, "failed", type(e).__name__, str(e)[:200])
                continue
            row = dict(tokens=t, assignments=a, block_m=bm, chunk=v[0], count_warps=4,
                       place_warps=v[1], fused_count_prefix=v[2], slice=ms.EXPERT_SLICE,
                       prefix_warps=4, equal=ok, us=us)
            res.append(row)
        rows = sorted((r for r in res if r["tokens"] == t), key=lambda r: r["us"])
        base = next(r for r in rows if r["chunk"] == 128 and r["count_warps"] == 4
                    and r["place_warps"] == 4 and not r["fused_count_prefix"])
        print(f"T={t} 128-chunks, 4 place warps, two launches: {base['us']:.2f} us; best:")
        for r in rows[:8]:
            print("  ", {k: r[k] for k in ("chunk", "count_warps", "place_warps",
                                            "fused_count_prefix", "slice", "prefix_warps",
                                            "equal", "us")})
        print("   all equal:", all(r["equal"] for r in rows))
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
