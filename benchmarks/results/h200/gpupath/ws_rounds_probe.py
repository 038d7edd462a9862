"""Rounds with the warp-specialized down GEMM (`MoeLaunch.ws`) against the served tables.

    python3 benchmarks/results/h200/gpupath/ws_rounds_probe.py OUT.json [WS_DOWN.json] [TURNS]

WS_DOWN.json: ws_down_probe.py's sweep. For each of its sizes whose best warp-specialized
launch beat the served down GEMM, the table row of that size takes it
(kernels/moe_launch.py MOE_LAUNCHES, patched in this process only); without the file, the rows
of 1024 tokens and more take MoeLaunch(128, 64, 4, 3, block_major=True, ws=True). Then rounds
(benchmarks/round_roofline.py's worker path, triton+graphs) at B = 16 / 32 / 64, prefixes ~1k
and ~4k, served and patched in turns (TURNS, default 2 each), on one model.
"""
import json
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.round_roofline import add_floor, measure_ceilings, run_backend
from dllm_serve.kernels import moe_launch
from dllm_serve.kernels.moe_launch import MoeLaunch
from dllm_serve.model.loader import random_model
from dllm_serve.tools.tiny_checkpoint import checkpoint_config, preset_arch

K = 8
FALLBACK = MoeLaunch(128, 64, 4, 3, block_major=True, ws=True)


def winners(sweep: dict | None) -> dict[int, MoeLaunch]:
    """tokens -> the best warp-specialized down launch where it beat the served one."""
    if sweep is None:
        return {1024: FALLBACK, 2048: FALLBACK}
    out = {}
    for row in sweep["rows"]:
        ok = [c for c in row["ws"] if c.get("ws") and "us" in c and c["max_diff"] < 0.05]
        if ok:
            top = min(ok, key=lambda c: c["us"])
            print(f"T={row['tokens']}: served {row['served_down_us']:.1f} us, ws "
                  f"{top['us']:.1f} us ({top})", flush=True)
            if top["us"] < row["served_down_us"]:
                out[row["tokens"]] = MoeLaunch(top["block_n"], top["block_k"], 4,
                                               top["stages"], block_major=True, ws=True)
    return out


def patched_table(wins: dict[int, MoeLaunch]) -> tuple:
    table = list(moe_launch.MOE_LAUNCHES)
    for t, launch in wins.items():
        i = next(j for j, (bound, _, _) in enumerate(table) if t * K <= bound)
        bound, up, _ = table[i]
        table[i] = (bound, up, launch)
    return tuple(table)


def main() -> None:
    path = Path(sys.argv[1])
    given = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    sweep = json.loads(given.read_text()) if given is not None and given.exists() else None
    served = moe_launch.MOE_LAUNCHES
    patched = patched_table(winners(sweep))
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
           "served": repr(served), "patched": repr(patched), "rounds": []}
    print("patched table:", patched, flush=True)
    if patched == served:
        print("no warp-specialized launch won: nothing to compare", flush=True)
        path.write_text(json.dumps(out, indent=1))
        return
    dev = torch.device("cuda")
    _, hf = checkpoint_config(preset_arch("llada2-mini-shape", None), "llada2-mini-shape")
    model = random_model(hf, torch.bfloat16, dev, 0)
    ceilings = measure_ceilings(dev)
    out["ceilings"] = ceilings
    args = Namespace(batch_sizes=[16, 32, 64], prefixes=[1024, 4096], warmup=2, iters=5,
                     out=None, profile=[0, 0])
    turns = [("served", served), ("ws", patched)] * int(sys.argv[3] if len(sys.argv) > 3 else 2)
    for turn, (name, table) in enumerate(turns):
        moe_launch.MOE_LAUNCHES = table
        for r in run_backend(hf, model, "triton+graphs", args, dev, torch.bfloat16):
            add_floor(r, model, hf, 2, ceilings)
            print(f"turn {turn} {name}: B={r['batch']} P~{r['prefix']} {r['round_ms']:.3f} ms "
                  f"ratio {r['ratio']:.3f}", flush=True)
            out["rounds"].append({"turn": turn, "table": name,
                                  **{k: r[k] for k in ("batch", "prefix", "round_ms",
                                                       "floor_ms", "ratio")}})
            path.write_text(json.dumps(out, indent=1))
    moe_launch.MOE_LAUNCHES = served
    path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
