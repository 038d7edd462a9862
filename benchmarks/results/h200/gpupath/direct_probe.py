"""The experts' direct layout (kernels/moe_align.py `direct_blocks`: no sort below
DIRECT_MAX_TOKENS tokens) and the attention's least keys per split (kernels/block_attention.py
MIN_SPLIT_KEYS) in whole rounds, and what routing balance costs the expert GEMMs:

    python3 benchmarks/results/h200/gpupath/direct_probe.py OUT.json [--rounds-only|--moe-only]

1. Rounds (benchmarks/round_roofline.py's worker path, triton+graphs) at B = 1 / 2 / 4, prefixes
   ~1k and ~4k, settings (DIRECT_MAX_TOKENS, MIN_SPLIT_KEYS) = (0, 1) (before: always sort,
   every split a step), (32, 64) (after), (32, 1) (the direct layout alone), twice in turns,
   on one model.
2. `fused_experts` alone (LLaDA2.0-mini's experts, random weights, in a CUDA graph of 10 calls)
   at T = 32 / 512 / 1024 / 2048 tokens: a random top-8 draw per token against a balanced one
   (every expert exactly T * 8 / 256 assignments), so the expert blocks' padding shows; and at
   T >= 512 (random draw), with tried_persistent_tiles_1304e3f.patch applied (not landed), the
   table's launches against persistent ones (MoeLaunch.persistent = 1-4 programs per SM looping
   over the tiles in use) for the up or the down GEMM.
"""
import dataclasses
import json
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.round_roofline import (
    add_floor,
    graphed,
    measure_ceilings,
    run_backend,
    time_ms,
)
from dllm_serve.kernels import block_attention, moe_align
from dllm_serve.kernels.fused_moe import fused_experts
from dllm_serve.kernels.moe_launch import choose_moe_launches
from dllm_serve.model.loader import random_model
from dllm_serve.tools.tiny_checkpoint import checkpoint_config, preset_arch

E, K, HIDDEN, INTER = 256, 8, 2048, 512


def rounds(out: dict) -> None:
    dev = torch.device("cuda")
    _, hf = checkpoint_config(preset_arch("llada2-mini-shape", None), "llada2-mini-shape")
    model = random_model(hf, torch.bfloat16, dev, 0)
    ceilings = measure_ceilings(dev)
    out["ceilings"] = ceilings
    args = Namespace(batch_sizes=[1, 2, 4], prefixes=[1024, 4096], warmup=2, iters=7,
                     out=None, profile=[0, 0])
    settings = [(0, 1), (32, 64), (32, 1)] * 2
    for turn, (direct, min_keys) in enumerate(settings):
        moe_align.DIRECT_MAX_TOKENS = direct
        block_attention.MIN_SPLIT_KEYS = min_keys
        rows = run_backend(hf, model, "triton+graphs", args, dev, torch.bfloat16)
        for r in rows:
            add_floor(r, model, hf, 2, ceilings)
            print(f"turn {turn} direct<={direct} min_keys={min_keys}: B={r['batch']} "
                  f"P~{r['prefix']} {r['round_ms']:.3f} ms ratio {r['ratio']:.3f}", flush=True)
            out["rounds"].append({"turn": turn, "direct_max_tokens": direct,
                                  "min_split_keys": min_keys,
                                  **{k: r[k] for k in ("batch", "prefix", "round_ms",
                                                       "floor_ms", "ratio", "startup_s")}})
    moe_align.DIRECT_MAX_TOKENS = 32
    block_attention.MIN_SPLIT_KEYS = 64
    del model
    torch.cuda.empty_cache()


def moe(out: dict) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (0.02 * torch.randn(E, 2 * INTER, HIDDEN, generator=g)).to(dev, torch.bfloat16)
    w2 = (0.02 * torch.randn(E, HIDDEN, INTER, generator=g)).to(dev, torch.bfloat16)
    for t in (32, 512, 1024, 2048):
        x = torch.randn(t, HIDDEN, generator=g).to(dev, torch.bfloat16)
        weights = torch.full((t, K), 1.0 / K, device=dev)
        draws = {"random": torch.rand(t, E, generator=g).topk(K, dim=1).indices,
                 "balanced": (torch.arange(t)[:, None] * K + torch.arange(K)) % E}
        up, down = choose_moe_launches(t * K)
        variants = [("table", (up, down))]
        persistent = "persistent" in {f.name for f in dataclasses.fields(up)}
        if t >= 512 and persistent:
            for p in (1, 2, 3, 4):
                variants += [(f"up_persistent{p}", (dataclasses.replace(up, persistent=p), down)),
                             (f"down_persistent{p}",
                              (up, dataclasses.replace(down, persistent=p)))]
        for name, ids in draws.items():
            ids = ids.to(dev)
            counts = torch.bincount(ids.flatten(), minlength=E)
            for direct in ((0, 32) if t <= 32 else (32,)):
                moe_align.DIRECT_MAX_TOKENS = direct
                for label, launches in variants if name == "random" else variants[:1]:
                    n = 10
                    f = graphed(lambda ids=ids, x=x, w=weights, n=n, ln=launches: [
                        fused_experts(x, w13, w2, ids, w, launches=ln) for _ in range(n)], dev)
                    us = 1e3 * time_ms(f, 3, 15, dev) / n
                    row = {"tokens": t, "routing": name, "direct_max_tokens": direct,
                           "launches": label, "us_per_call": us,
                           "max_count": int(counts.max()),
                           "experts_used": int((counts > 0).sum())}
                    print(row, flush=True)
                    out["moe"].append(row)
    moe_align.DIRECT_MAX_TOKENS = 32


def main() -> None:
    path = sys.argv[1]
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
           "rounds": [], "moe": []}
    if "--rounds-only" not in sys.argv:
        moe(out)
        Path(path).write_text(json.dumps(out, indent=1))
    if "--moe-only" not in sys.argv:
        rounds(out)
    Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
