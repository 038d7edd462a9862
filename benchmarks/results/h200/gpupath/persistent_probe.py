"""Persistent GEMMs whose K loop runs on across tiles (MoeLaunch.persistent for the expert
GEMMs, HeadLaunch.persistent for the fused LM head), in rounds.

    git apply benchmarks/results/h200/gpupath/tried_flat_persistent_632e3e4.patch
    python3 benchmarks/moe_tune.py --tokens 512 1024 2048 ... --persistent 0 1 2 3 --out mt.json
    python3 benchmarks/results/h200/gpupath/persistent_probe.py mt.json OUT.json [TURNS]

1. Experts: for each size the sweep measured (T = 512 / 1024 / 2048 tokens: the denoise
   buckets of 16 / 32 / 64 blocks), the best persistent launch of each kernel replaces the
   table's launch when the sweep timed it faster (kernels/moe_launch.py MOE_LAUNCHES, patched in
   this process only).
2. LM head (kernels/lm_head.py, LLaDA2.0-mini's 157,184 x 2,048 head, half the rows asked as in
   a half-masked round): the served launch of more than 64 rows against persistent ones at T =
   512 / 1024 / 2048, each in a CUDA graph of 10 calls; the fastest replaces HEAD_LAUNCHES' last
   row if it wins at all three sizes.
3. Rounds (benchmarks/round_roofline.py's worker path, triton+graphs) at B = 1 / 4 / 16 /
   32 / 64, prefixes ~1k and ~4k, with the tables as served and as patched, twice in turns,
   on one model (the served tables once when nothing was patched).
"""
import json
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.moe_tune import launch_of
from benchmarks.round_roofline import add_floor, graphed, measure_ceilings, run_backend, time_ms
from dllm_serve.kernels import lm_head, moe_launch
from dllm_serve.model.loader import random_model
from dllm_serve.tools.tiny_checkpoint import checkpoint_config, preset_arch

K = 8


def patched_table(sweep: dict) -> tuple:
    """MOE_LAUNCHES with each swept size's kernel launch replaced by its best persistent one
    where that one was faster than the table's own launch in the sweep."""
    rows = sweep["rows"]
    table = list(moe_launch.MOE_LAUNCHES)
    for t in sorted({r["tokens"] for r in rows}):
        i = next(j for j, (bound, _, _) in enumerate(table) if t * K <= bound)
        bound, up, down = table[i]
        new = {"up": up, "down": down}
        for kernel, served in (("up", up), ("down", down)):
            ok = [r for r in rows if r["tokens"] == t and r["kernel"] == kernel and "us" in r
                  and r["max_abs_err"] < 0.05]
            own = [r["us"] for r in ok if launch_of(r) == served]
            pers = [r for r in ok if r.get("persistent", 0) > 0]
            if pers:
                top = min(pers, key=lambda r: r["us"])
                base = own[0] if own else min(r["us"] for r in ok if not r.get("persistent"))
                print(f"T={t} {kernel}: table {served} {base:.1f} us; persistent "
                      f"{launch_of(top)} {top['us']:.1f} us", flush=True)
                if top["us"] < base:
                    new[kernel] = launch_of(top)
        table[i] = (bound, new["up"], new["down"])
    return tuple(table)


V, H, MASK = 157184, 2048, 156895
HEAD_VARIANTS = [lm_head.HeadLaunch(*v) for v in (
    (128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1), (128, 128, 64, 8, 4, 1),
    (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 2), (128, 128, 64, 4, 4, 1),
    (64, 256, 64, 8, 4, 1), (128, 256, 32, 8, 5, 1))]


def head_sweep(out: dict) -> tuple:
    """HEAD_LAUNCHES, its last row replaced by the fastest persistent launch if that beats the
    served one at every size."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (0.02 * torch.randn(V, H, device=dev, generator=gen)).bfloat16()
    served = lm_head.HEAD_LAUNCHES[-1][1]
    totals = {v: 0.0 for v in [served, *HEAD_VARIANTS]}
    wins = {v: True for v in HEAD_VARIANTS}
    for t in (512, 1024, 2048):
        h = torch.randn(t, H, device=dev, generator=gen).bfloat16()
        rows = torch.rand(t, device=dev, generator=gen) < 0.5
        ref = lm_head.head_greedy(h, w, MASK, rows, launch=served)
        times = {}
        for v in totals:
            try:
                x, p = lm_head.head_greedy(h, w, MASK, rows, launch=v)
                same = bool(torch.equal(x, ref[0]) and torch.equal(p, ref[1]))
                f = graphed(lambda v=v, h=h, rows=rows: [
                    lm_head.head_greedy(h, w, MASK, rows, launch=v) for _ in range(10)], dev)
                times[v] = 1e3 * time_ms(f, 3, 15, dev) / 10
            except Exception as exc:  # noqa: BLE001
                print(t, v, "failed", type(exc).__name__, str(exc)[:160], flush=True)
                same, times[v] = False, float("inf")
            row = {"rows": t, "launch": repr(v), "us": times[v], "same_as_served": same}
            out["head"].append(row)
            print(row, flush=True)
            totals[v] += times[v]
        for v in HEAD_VARIANTS:
            wins[v] = wins[v] and times[v] < times[served]
    winners = [v for v in HEAD_VARIANTS if wins[v]]
    table = list(lm_head.HEAD_LAUNCHES)
    if winners:
        table[-1] = (table[-1][0], min(winners, key=totals.__getitem__))
    return tuple(table)


def main() -> None:
    given = Path(sys.argv[1])
    sweep = json.loads(given.read_text()) if given.exists() else {"rows": []}  # no sweep: served
    path = Path(sys.argv[2])
    served = moe_launch.MOE_LAUNCHES
    patched = patched_table(sweep)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
           "served": repr(served), "patched": repr(patched), "head": [], "rounds": []}
    print("patched table:", patched, flush=True)
    head_served = lm_head.HEAD_LAUNCHES
    head_patched = head_sweep(out)
    out["head_patched"] = repr(head_patched)
    print("patched head table:", head_patched, flush=True)
    dev = torch.device("cuda")
    _, hf = checkpoint_config(preset_arch("llada2-mini-shape", None), "llada2-mini-shape")
    model = random_model(hf, torch.bfloat16, dev, 0)
    ceilings = measure_ceilings(dev)
    out["ceilings"] = ceilings
    args = Namespace(batch_sizes=[1, 4, 16, 32, 64], prefixes=[1024, 4096], warmup=2, iters=5,
                     out=None, profile=[0, 0])
    turns = [("served", served, head_served), ("patched", patched, head_patched)] * 2
    turns = turns[:int(sys.argv[3]) if len(sys.argv) > 3 else 4]  # fewer turns: less time
    if patched == served and head_patched == head_served:
        print("no persistent launch won: the served tables' rounds once", flush=True)
        turns = turns[:1]
    for turn, (name, table, head) in enumerate(turns):
        moe_launch.MOE_LAUNCHES, lm_head.HEAD_LAUNCHES = table, head
        for r in run_backend(hf, model, "triton+graphs", args, dev, torch.bfloat16):
            add_floor(r, model, hf, 2, ceilings)
            print(f"turn {turn} {name}: B={r['batch']} P~{r['prefix']} {r['round_ms']:.3f} ms "
                  f"ratio {r['ratio']:.3f}", flush=True)
            out["rounds"].append({"turn": turn, "table": name,
                                  **{k: r[k] for k in ("batch", "prefix", "round_ms",
                                                       "floor_ms", "ratio", "startup_s")}})
            path.write_text(json.dumps(out, indent=1))
    moe_launch.MOE_LAUNCHES, lm_head.HEAD_LAUNCHES = served, head_served
    path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
