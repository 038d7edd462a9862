"""Saved round tables against their serial floor (benchmarks/round_cost.py), no GPU needed.

    python benchmarks/serial_floor.py benchmarks/results/h200/gpupath/roofline_e585189.json
    python benchmarks/serial_floor.py a.json b.json --out floors.json

For each row of a round_roofline.py JSON (its prefixes, experts touched and the ceilings
measured in that run), the model's shapes rebuilt on the meta device: the floor, the serial
floor (the LM head over the rows the round's step read: half the block's rows in tables saved
before `asked_rows` was), and per stage kind (attention, mlp, head, embed) the milliseconds
and the bound. Then issue 15's ratio goals (1.3 at B <= 32, 1.5 at B = 64): the round time
a goal allows and the share of it the serial floor takes, the speed each row's kernels must
reach relative to ideal ones (every stage at its own bound, compute and loads fully
overlapped) for the goal to hold; and the share each row reached. The JSON written by --out
holds every row with these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks.common import write_json
from benchmarks.round_cost import meta_model, round_cost, serial_floor_s, stage_costs
from dllm_serve.tools.tiny_checkpoint import PRESETS, checkpoint_config, preset_arch

GOALS = {1: 1.3, 4: 1.3, 16: 1.3, 32: 1.3, 64: 1.5}  # issue 15: batch size -> ratio to floor


DTYPES = {2: torch.bfloat16, 4: torch.float32}  # a table's itemsize -> the dtype it ran in


def preset_model(preset: str, itemsize: int) -> nn.Module:
    """The preset's model on the meta device in the table's dtype: its shapes, no memory."""
    _, hf = checkpoint_config(preset_arch(preset, None), preset)
    return meta_model(hf, DTYPES[itemsize])


def floors(row: dict[str, Any], model: nn.Module, ceilings: tuple[float, float],
           itemsize: int) -> dict[str, Any]:
    """One saved row -> its floor, serial floor, stage kinds and goal figures (ms)."""
    touched = {int(k): v for k, v in row["experts_touched"].items()}
    args = (model, row["prefixes"], row["block"], touched, itemsize)
    # tables before asked_rows was saved: the benchmark's blocks are half-masked
    asked = row.get("asked_rows", len(row["prefixes"]) * row["block"] // 2)
    stages = stage_costs(*args, asked)
    kinds: dict[str, float] = defaultdict(float)
    for name, cost in stages.items():
        kinds[name.split(".")[-1]] += 1e3 * cost.floor_s(*ceilings)
    out = {"batch": row["batch"], "prefix": row["prefix"], "round_ms": row["round_ms"],
           "floor_ms": 1e3 * round_cost(*args).floor_s(*ceilings),
           "serial_floor_ms": 1e3 * serial_floor_s(stages, *ceilings),
           "stage_ms": dict(kinds),
           "compute_bound_ms": sum(1e3 * c.floor_s(*ceilings) for c in stages.values()
                                   if c.bound(*ceilings) == "compute")}
    goal = GOALS.get(row["batch"])
    if goal is not None:
        out.update(goal=goal, goal_ms=goal * out["floor_ms"],
                   needed=out["serial_floor_ms"] / (goal * out["floor_ms"]))
    out["achieved"] = out["serial_floor_ms"] / row["round_ms"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", help="round_roofline.py JSON files")
    parser.add_argument("--preset", default="llada2-mini-shape", choices=PRESETS)
    parser.add_argument("--backend", default="triton+graphs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = []
    for path in args.tables:
        saved = json.loads(Path(path).read_text())
        itemsize = saved.get("itemsize", 2)  # tables before it was saved: bf16 on a GPU
        model = preset_model(args.preset, itemsize)
        ceil = saved["ceilings"]
        ceilings = (ceil["bytes_per_s"], ceil["flops"])
        print(f"{path}: {saved['device']} at {saved['commit'][:7]}, "
              f"{ceilings[0] / 1e12:.2f} TB/s, {ceilings[1] / 1e12:.0f} TFLOP/s")
        print("  B prefix | round  floor  serial (x floor) | attention mlp head (compute-bound)"
              " | goal ms  serial/goal  serial/round")
        for row in saved["rows"]:
            if row["backend"] != args.backend:
                continue
            f = floors(row, model, ceilings, itemsize)
            s = f["stage_ms"]
            goal = (f"{f['goal_ms']:6.2f}  {f['needed']:10.2f}" if "goal" in f
                    else " " * 18)
            print(f"  {f['batch']:2d} ~{f['prefix']:4d} | {f['round_ms']:6.2f} "
                  f"{f['floor_ms']:5.2f} {f['serial_floor_ms']:6.2f} "
                  f"({f['serial_floor_ms'] / f['floor_ms']:.2f}) | {s.get('attention', 0):5.2f} "
                  f"{s.get('mlp', 0):5.2f} {s.get('head', 0):4.2f} ({f['compute_bound_ms']:.2f})"
                  f" | {goal}  {f['achieved']:12.2f}")
            results.append({"table": path, "device": saved["device"],
                            "commit": saved["commit"], **f})
    write_json(args.out, {"rows": results})


if __name__ == "__main__":
    main()
