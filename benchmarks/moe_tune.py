"""Launch sweep of the fused MoE grouped GEMMs at a model's expert shapes, for MOE_LAUNCHES.

    python benchmarks/moe_tune.py --out results/moe_tune.json

One MoE layer's routed experts (random weights, random top-k routing: every token picks
top_k distinct experts uniformly) at T tokens for each --tokens. `_up_kernel` (x -> h) and
`_down_kernel` (h -> y) are timed separately (kernels/fused_moe.py `up_proj`, `down_proj`:
median over --iters of --launches back-to-back launches between CUDA events, the expert sort
done beforehand) under each candidate MoeLaunch, and each output is checked against the
default launch's. The search is staged by default (block_n x block_k at the default warps
and stages, then warps x stages at the best tile, then both program orders at the best launch:
~2 minutes of compiles on an H200 at five sizes) or --search full (every combination). A
launch the compiler or the device refuses is recorded with its error. Per kernel and size it
prints the best launch, its time and the bytes floor (the touched experts' weights over
--bandwidth), then the whole `fused_experts` call under the best launches against
DEFAULT_LAUNCH, and a MOE_LAUNCHES literal to paste into kernels/moe_launch.py. On the CPU it
runs only under TRITON_INTERPRET=1 (a smoke test at --preset tiny; the times mean nothing
there).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json
from benchmarks.round_roofline import time_ms
from dllm_serve.kernels import fused_moe as fm
from dllm_serve.kernels.moe_launch import DEFAULT_LAUNCH, MoeLaunch
from dllm_serve.kernels.runtime import interpreted
from dllm_serve.tools.tiny_checkpoint import checkpoint_config, preset_arch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KERNELS = ("up", "down")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llada2-mini-shape",
                   help="expert shapes of a dllm_serve/tools/tiny_checkpoint.py preset "
                        "(llada2-mini-shape, sdar-30b-a3b-shape, tiny)")
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--block-k", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--block-m", type=int, nargs="+", default=[0],
                   help="rows per expert block to sweep (0: choose_block_m's)")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--block-major", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                   help="program orders to try at the best launch (1: a block's N tiles "
                        "together, 0: an N tile's blocks together)")
    p.add_argument("--search", choices=["staged", "full"], default="staged")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions (median)")
    p.add_argument("--launches", type=int, default=5, help="back-to-back launches per timing")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="B/s for the bytes floor")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="JSON results")
    return p.parse_args(argv)


@dataclass(frozen=True)
class ExpertShape:
    experts: int
    hidden: int
    inter: int  # moe_intermediate_size
    top_k: int


def preset_shape(preset: str) -> ExpertShape:
    _, config = checkpoint_config(preset_arch(preset), preset)
    return ExpertShape(config["num_experts"], config["hidden_size"],
                       config["moe_intermediate_size"], config["num_experts_per_tok"])


class Case:
    """One layer's routed experts at T tokens: x (T, hidden), the shared weights, random
    routing sorted into expert blocks, and h (A, I) from the default launch (the down input)."""

    def __init__(self, shape: ExpertShape, tokens: int, w13: torch.Tensor, w2: torch.Tensor,
                 block_m: int = 0) -> None:
        dev, dtype = w13.device, w13.dtype
        gen = torch.Generator(device="cpu").manual_seed(tokens)
        self.shape, self.tokens, self.w13, self.w2 = shape, tokens, w13, w2
        self.x = torch.randn(tokens, shape.hidden, generator=gen).to(dev, dtype)
        scores = torch.rand(tokens, shape.experts, generator=gen)
        self.ids = scores.topk(shape.top_k, dim=1).indices.to(dev)  # (T, K) distinct experts
        self.weights = torch.randn(tokens, shape.top_k, generator=gen).softmax(1).to(dev)
        self.blocks = fm.expert_blocks(self.ids, shape.experts, block_m or None)
        self.h = self.up(DEFAULT_LAUNCH)
        touched = int(self.ids.unique().numel())
        per_expert = shape.hidden * shape.inter * w13.element_size()
        self.weight_bytes = {"up": 2 * touched * per_expert, "down": touched * per_expert}

    def up(self, launch: MoeLaunch) -> torch.Tensor:
        return fm.up_proj(self.x, self.w13, self.blocks, self.shape.top_k, launch)

    def down(self, launch: MoeLaunch) -> torch.Tensor:
        return fm.down_proj(self.h, self.w2, self.blocks, launch)

    def experts(self, launches: tuple[MoeLaunch, MoeLaunch]) -> torch.Tensor:
        return fm.fused_experts(self.x, self.w13, self.w2, self.ids, self.weights, launches,
                                block_m=self.blocks.block_m)


def time_us(fn: Callable[[], Any], ns: argparse.Namespace, device: torch.device) -> float:
    """Microseconds per call: `ns.launches` calls back to back, median of `ns.iters`."""
    def burst() -> None:
        for _ in range(ns.launches):
            fn()
    return 1e3 * time_ms(burst, 2, ns.iters, device) / ns.launches


def measure(ns: argparse.Namespace, case: Case, kernel: str, launch: MoeLaunch,
            reference: torch.Tensor) -> dict[str, Any]:
    """One row: the launch's error against the default launch's output and its time."""
    run = case.up if kernel == "up" else case.down
    row: dict[str, Any] = {"tokens": case.tokens, "kernel": kernel, "block_m": case.blocks.block_m,
                           **asdict(launch)}
    try:
        row["max_abs_err"] = (run(launch).float() - reference).abs().max().item()
        if fm.fell_back(kernel, case.blocks.block_m, launch):
            raise RuntimeError("does not fit the device (the kernel ran DEFAULT_LAUNCH)")
        row["us"] = time_us(lambda: run(launch), ns, case.x.device)
        row["tb_s"] = case.weight_bytes[kernel] / (row["us"] * 1e-6) / 1e12
    except Exception as exc:  # a launch the compiler or the device refuses
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(row, flush=True)
    return row


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest row whose output matches the default launch's (bf16 rounding allowed)."""
    ok = [r for r in rows if "us" in r and r["max_abs_err"] < 0.05]
    return min(ok, key=lambda r: r["us"]) if ok else None


def launch_of(row: dict[str, Any]) -> MoeLaunch:
    return MoeLaunch(row["block_n"], row["block_k"], row["num_warps"], row["num_stages"],
                     bool(row.get("block_major", False)))


def default_or_first(values: list[int], default: int) -> int:
    return default if default in values else values[0]


def sweep_kernel(ns: argparse.Namespace, case: Case, kernel: str) -> list[dict[str, Any]]:
    """Every candidate (full), or (staged) tile shapes, then warps x stages at the best, then
    the program orders at the best; DEFAULT_LAUNCH always, for the comparison."""
    reference = (case.h if kernel == "up" else case.down(DEFAULT_LAUNCH)).float()
    done: dict[MoeLaunch, dict[str, Any]] = {}

    def run_all(launches: list[MoeLaunch]) -> None:
        for launch in launches:
            if launch not in done:
                done[launch] = measure(ns, case, kernel, launch, reference)

    if ns.search == "full":
        run_all([DEFAULT_LAUNCH] + [MoeLaunch(*c[:4], bool(c[4])) for c in
                                    itertools.product(ns.block_n, ns.block_k, ns.warps, ns.stages,
                                                      ns.block_major)])
        return list(done.values())
    warps = default_or_first(ns.warps, DEFAULT_LAUNCH.num_warps)
    stages = default_or_first(ns.stages, DEFAULT_LAUNCH.num_stages)
    run_all([DEFAULT_LAUNCH] + [MoeLaunch(n, k, warps, stages)
                                for n, k in itertools.product(ns.block_n, ns.block_k)])
    top = best(list(done.values()))
    if top is not None:
        run_all([MoeLaunch(top["block_n"], top["block_k"], w, s)
                 for w, s in itertools.product(ns.warps, ns.stages)])
    top = best(list(done.values()))
    if top is not None:
        run_all([replace(launch_of(top), block_major=bool(b)) for b in ns.block_major])
    return list(done.values())


def summarize(ns: argparse.Namespace, case: Case, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best launch per kernel with its bytes floor; the whole call, best against default."""
    out: dict[str, Any] = {"tokens": case.tokens, "block_m": case.blocks.block_m}
    for kernel in KERNELS:
        top = best([r for r in rows if r["kernel"] == kernel])
        floor_us = case.weight_bytes[kernel] / ns.bandwidth * 1e6
        default = next((r for r in rows if r["kernel"] == kernel
                        and "us" in r and launch_of(r) == DEFAULT_LAUNCH), None)
        out[kernel] = {"best": top, "floor_us": floor_us,
                       "default_us": default["us"] if default else None}
        if top is not None:
            print(f"T={case.tokens} block_m={case.blocks.block_m} {kernel}: best "
                  f"{launch_of(top)} {top['us']:.1f} us (default {out[kernel]['default_us']}, "
                  f"floor {floor_us:.1f} us)", flush=True)
    if out["up"]["best"] and out["down"]["best"]:
        chosen = (launch_of(out["up"]["best"]), launch_of(out["down"]["best"]))
        out["fused_experts_us"] = {
            "best": time_us(lambda: case.experts(chosen), ns, case.x.device),
            "default": time_us(lambda: case.experts((DEFAULT_LAUNCH, DEFAULT_LAUNCH)), ns,
                               case.x.device)}
        print(f"T={case.tokens} block_m={case.blocks.block_m} fused_experts: "
              f"{out['fused_experts_us']}", flush=True)
    return out


def table_literal(summaries: list[dict[str, Any]], top_k: int) -> str:
    """MOE_LAUNCHES rows for kernels/moe_launch.py: bound T * top_k per measured T, the last
    row open-ended; a size with no valid launch keeps DEFAULT_LAUNCH."""
    lines = ["MOE_LAUNCHES: tuple[tuple[int, MoeLaunch, MoeLaunch], ...] = ("]
    for i, s in enumerate(summaries):
        bound = "1 << 30" if i == len(summaries) - 1 else str(s["tokens"] * top_k)
        up, down = (launch_of(s[k]["best"]) if s[k]["best"] else DEFAULT_LAUNCH for k in KERNELS)
        lines += [f"    ({bound},  # T = {s['tokens']}: up, down", f"     {up},", f"     {down}),"]
    return "\n".join(lines + [")"])


def check_runnable(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("moe_tune: --device cuda but CUDA is not available")
    if device.type != "cuda" and not interpreted():
        raise SystemExit("moe_tune times CUDA kernels: run it on a GPU, or on the CPU as a smoke "
                         "test only, with TRITON_INTERPRET=1 and a small --preset tiny")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    check_runnable(device)
    shape = preset_shape(ns.preset)
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = DTYPES[ns.dtype]
    w13 = 0.02 * torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=gen,
                             device=device, dtype=dtype)
    w2 = 0.02 * torch.randn(shape.experts, shape.hidden, shape.inter, generator=gen,
                            device=device, dtype=dtype)
    rows, summaries = [], []
    with torch.inference_mode():
        for tokens, block_m in itertools.product(sorted(ns.tokens), ns.block_m):
            case = Case(shape, tokens, w13, w2, block_m)
            case_rows = [r for kernel in KERNELS for r in sweep_kernel(ns, case, kernel)]
            rows += case_rows
            summaries.append(summarize(ns, case, case_rows))
    table = table_literal(summaries, shape.top_k)
    print(table)
    result = {"benchmark": "moe_tune", "config": vars(ns), "shape": asdict(shape),
              "default": asdict(DEFAULT_LAUNCH), "rows": rows, "summary": summaries,
              "table": table}
    write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
