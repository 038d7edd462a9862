"""Launch-configuration sweep of the block-diffusion attention kernel (LLaDA2.0-mini's heads by
default; --heads / --kv-heads / --head-dim for another model's: the built-in model's 4 / 2 / 64).

    python benchmarks/attention_tune.py --out results/attention_tune.json

One layer's attention for a denoise round: B blocks of 32 query tokens, 16 query heads over 4 KV
heads of 128 (by default), each request's prefix drawn in [0.9 P, P], pages scattered in the pool.
Per launch configuration (query rows per tile, keys per step, warps, pipeline stages, key-range
splits, --splits forcing the split count) it reports the time per launch (median over --iters
replays of a CUDA graph of --launches back-to-back launches, the plan built beforehand: as in a
round; launched from Python, a small batch's launches timed the host, 50-100 us against the ~8 us a
layer the kernel takes in a round at B = 1) and the achieved KV bandwidth and FLOP rate. The
launches cycle through copies of the K/V (together >= 256 MB, at most 256; a graph uses --launches
of them) so that each reads its K/V from memory as in a round, where the expert weights evict it
from L2 (small batches with short prefixes stay partly in L2: 20 launches at B = 1, ~1k are ~40
MB). With one copy in L2 a launch that reads each K/V more than once, such as half tiles per
program, looked faster than it is in a round (results/h200/gpupath/tried_half_tiles_6f696b1.patch).
It checks the output against the default configuration's. The kernel's launch constants are module
globals (MAX_BLOCK_M, TILE_TOKENS and the LAUNCHES table in kernels/block_attention.py,
PROGRAMS_PER_SM in triton_attention.py); this script sets them for each row (--block-m: a tile's
rows, so block_m / G tokens a tile; one launch for every split count) and restores them.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json
from benchmarks.round_roofline import graphed, time_ms
from dllm_serve.kernels import block_attention as ba
from dllm_serve.kernels import triton_attention as ta
from dllm_serve.kernels.runtime import cdiv, num_sms

BLOCK = 32  # tokens per denoise block (LLaDA2)
KV_ROTATION_BYTES = 256 << 20  # K/V copies cycled through: past an H200's 50 MB L2
MAX_COPIES = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16, help="query heads (LLaDA2.0-mini: 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (LLaDA2.0-mini: 4)")
    p.add_argument("--head-dim", type=int, default=128, help="(LLaDA2.0-mini: 128)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    p.add_argument("--prefixes", type=int, nargs="+", default=[4096])
    p.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--splits", type=int, nargs="+", default=[0],
                   help="key-range splits to sweep (0: from --programs-per-sm, as served)")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions (median)")
    p.add_argument("--launches", type=int, default=20, help="back-to-back launches per timing")
    p.add_argument("--page", type=int, default=BLOCK,
                   help="KV page size in tokens (the engine's default: the block size)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="JSON results")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


class Case:
    """One round's attention inputs: q (T, H, D), caches (slots, KVH, D), scattered pages."""

    def __init__(self, batch: int, prefix: int, page: int, heads: Heads,
                 device: torch.device) -> None:
        self.shape = heads
        kvh, hd = heads.kv_heads, heads.head_dim
        rng = np.random.default_rng(batch * 31 + prefix)
        self.page = page
        low = int(0.9 * prefix) // BLOCK
        self.prefixes = (rng.integers(low, prefix // BLOCK + 1, batch) * BLOCK).tolist()
        self.prefix_asked = prefix
        pages = [cdiv(p + BLOCK, page) for p in self.prefixes]
        width = max(pages)
        pool = rng.permutation(sum(pages))
        table = np.zeros((batch, width), dtype=np.int64)
        ends = np.cumsum(pages)
        for b, (end, n) in enumerate(zip(ends, pages, strict=True)):
            table[b, :n] = pool[end - n:end]
        gen = torch.Generator(device="cpu").manual_seed(batch + prefix)
        slots = sum(pages) * page
        k = torch.randn(slots, kvh, hd, generator=gen).to(device, torch.bfloat16)
        v = torch.randn(slots, kvh, hd, generator=gen).to(device, torch.bfloat16)
        copies = max(1, min(MAX_COPIES, cdiv(KV_ROTATION_BYTES, 2 * k.numel() * k.element_size())))
        self.kv = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
        self.q = torch.randn(batch * BLOCK, heads.heads, hd, generator=gen).to(device,
                                                                              torch.bfloat16)
        self.table = torch.from_numpy(table).to(device)
        self.seg_req = torch.arange(batch, device=device)
        self.device = device
        keys = sum(p + BLOCK for p in self.prefixes)
        self.kv_bytes = 2 * keys * kvh * hd * 2
        self.flops = 4 * BLOCK * heads.heads * hd * keys  # QK^T and PV over visible keys

    def plan(self, splits: int) -> ba.BlockAttnPlan:
        h = self.shape
        return ba.plan_block_attention(self.prefixes, [BLOCK] * len(self.prefixes), BLOCK,
                                       h.heads, h.kv_heads, h.head_dim, splits, self.device)

    def tiles(self) -> int:
        """Tiles of the batch under the kernel's current tile size."""
        return len(self.prefixes) * cdiv(BLOCK, ba.tokens_per_tile(self.shape.group))

    def run(self, plan: ba.BlockAttnPlan, launches: int = 1) -> torch.Tensor:
        """The attention (and split-K combine) `launches` times back to back: the device queue
        stays full, so the time per launch is the kernels' and not the host's."""
        for i in range(launches):
            k, v = self.kv[i % len(self.kv)]
            out = ba.block_attention(self.q, k, v, self.table, self.seg_req, plan, self.page,
                                     self.shape.head_dim ** -0.5)
        return out


def set_launch(block_m: int, block_n: int, warps: int, stages: int) -> None:
    """Tiles of block_m rows (block_m // G tokens) under this one launch."""
    ba.MAX_BLOCK_M, ba.TILE_TOKENS = block_m, block_m
    ba.LAUNCHES = ((block_m, 1 << 30, ba.Launch(block_n, warps, stages)),)


def kernel_constants() -> tuple[Any, ...]:
    return ba.MAX_BLOCK_M, ba.TILE_TOKENS, ba.LAUNCHES


def restore_constants(saved: tuple[Any, ...]) -> None:
    ba.MAX_BLOCK_M, ba.TILE_TOKENS, ba.LAUNCHES = saved


def sweep_case(ns: argparse.Namespace, case: Case, sms: int) -> list[dict[str, Any]]:
    default = kernel_constants()
    kvh = case.shape.kv_heads
    reference = case.run(case.plan(ta.choose_num_splits(case.tiles(), kvh, sms))).float()
    default_pps = ta.PROGRAMS_PER_SM
    rows = []
    grid = itertools.product(ns.block_m, ns.block_n, ns.warps, ns.stages, ns.programs_per_sm,
                             ns.splits)
    for block_m, block_n, warps, stages, pps, forced in grid:
        set_launch(block_m, block_n, warps, stages)
        ta.PROGRAMS_PER_SM = pps
        splits = forced or ta.choose_num_splits(case.tiles(), kvh, sms)
        row = {**vars(case.shape), "batch": len(case.prefixes), "prefix": max(case.prefixes),
               "prefix_asked": case.prefix_asked, "block_m": block_m,
               "block_n": block_n, "warps": warps, "stages": stages, "programs_per_sm": pps,
               "splits": splits}
        try:
            plan = case.plan(splits)
            row["max_abs_err"] = (case.run(plan).float() - reference).abs().max().item()
            burst = graphed(lambda plan=plan: case.run(plan, ns.launches), case.device)
            ms = time_ms(burst, 3, ns.iters, case.device)
            row["us"] = 1e3 * ms / ns.launches
            row["kv_tb_s"] = case.kv_bytes / (row["us"] * 1e-6) / 1e12
            row["tflop_s"] = case.flops / (row["us"] * 1e-6) / 1e12
        except Exception as exc:  # a configuration the compiler or the device refuses
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(row, flush=True)
    restore_constants(default)
    ta.PROGRAMS_PER_SM = default_pps
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    sms = num_sms(device)
    heads = Heads(ns.heads, ns.kv_heads, ns.head_dim)
    rows = []
    with torch.inference_mode():
        for batch, prefix in itertools.product(ns.batch_sizes, ns.prefixes):
            rows += sweep_case(ns, Case(batch, prefix, ns.page, heads, device), sms)
    for batch, prefix in itertools.product(ns.batch_sizes, ns.prefixes):
        ok = [r for r in rows if r["batch"] == batch and r["prefix_asked"] == prefix
              and "us" in r and r["max_abs_err"] < 0.05]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            print(f"best B={batch} P~{prefix}: {best}")
    result = {"benchmark": "attention_tune", "config": vars(ns), "rows": rows,
              "default": {"max_block_m": ba.MAX_BLOCK_M, "tile_tokens": ba.TILE_TOKENS,
                          "launches": [{"max_block_m": rows, "max_splits": splits,
                                        **vars(launch)}
                                       for rows, splits, launch in ba.LAUNCHES]}}
    write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
