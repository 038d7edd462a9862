"""The expert sort's launch variants (kernels/moe_sort.py) at LLaDA2.0-mini's routing (256
experts, top-8, a skewed draw), each timed in a CUDA graph of 20 back-to-back sorts (median of
15 replays) and checked equal to the oracle `align_by_expert`:

    python3 benchmarks/results/h200/gpupath/sort_probe.py sort_probe.json

Variants: chunk size, warps of the count and place launches, and whether counts and prefix
are one launch (`_count_prefix_kernel`) or two."""
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
from dllm_serve.kernels.runtime import cdiv, next_pow2

E, K = 256, 8


def sort(flat, bm, chunk, cw, pw, fused, slice_, sw):
    a, dev = flat.shape[0], flat.device
    chunks = max(1, cdiv(a, chunk))
    max_blocks = cdiv(a + E * (bm - 1), bm)
    prefix = torch.empty(chunks, E, dtype=torch.int32, device=dev)
    totals = torch.empty(E, dtype=torch.int32, device=dev)
    num_slots = torch.empty(1, dtype=torch.int32, device=dev)
    rows = torch.empty(max_blocks * bm, dtype=torch.int32, device=dev)
    bexp = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    if fused:
        ms._count_prefix_kernel[(E // slice_,)](flat, prefix, totals, a, chunks, E=E, CHUNK=chunk,
                                             SLICE=slice_, num_warps=sw)
    else:
        counts = torch.empty(chunks, E, dtype=torch.int32, device=dev)
        ms._count_kernel[(chunks,)](flat, counts, a, E=E, CHUNK=chunk, num_warps=cw)
        ms._prefix_kernel[(E // slice_,)](counts, prefix, totals, chunks, E=E,
                                          BLOCK_C=max(2, next_pow2(chunks)), SLICE=slice_,
                                          num_warps=sw)
    ms._place_kernel[(chunks + max_blocks,)](flat, prefix, totals, rows, bexp, num_slots, a,
                                             chunks, E=E, CHUNK=chunk, BM=bm, num_warps=pw)
    return rows, bexp, num_slots


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
        flat = ids.flatten()
        ref = align_by_expert(ids, E, bm)
        variants = [(c, 4, pw, fused, 16, 4) for c, pw, fused in
                    itertools.product((64, 128), (2, 4), (False, True))]
        for v in variants:
            try:
                r = sort(flat, bm, *v)
                torch.cuda.synchronize()
                ok = (torch.equal(r[0], ref.sorted_rows) and torch.equal(r[1], ref.block_expert)
                      and torch.equal(r[2], ref.num_slots))
                n = 20
                def burst(flat=flat, bm=bm, v=v, n=n):
                    return [sort(flat, bm, *v) for _ in range(n)]
                f = graphed(burst, dev)
                us = 1e3 * time_ms(f, 3, 15, dev) / n
            except Exception as e:  # noqa: BLE001
                print(t, v, "failed", type(e).__name__, str(e)[:200])
                continue
            row = dict(tokens=t, assignments=a, block_m=bm, chunk=v[0], count_warps=v[1],
                       place_warps=v[2], fused_count_prefix=v[3], slice=v[4],
                       prefix_warps=v[5], equal=ok, us=us)
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
