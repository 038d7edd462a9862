"""The expert sort's two paths timed on the GPU, for moe_sort.ONE_PROGRAM_PAIRS (issue 15).

    python benchmarks/moe_sort_bench.py --out results/moe_sort.json

`sort_by_expert` (kernels/moe_sort.py) at T tokens x top-k random distinct experts (A = T * k
assignments) with each path forced: the one-program launch and the five launches. Each is
timed as the model runs it, inside a CUDA graph: --calls calls captured in one graph, the
graph replayed --iters times between CUDA events, the median per call reported (so launch
latency counts as it does in a captured forward, not the host's dispatch). Both paths'
outputs are checked equal first. Prints per A the two times and which is faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json
from dllm_serve.kernels import moe_sort
from dllm_serve.kernels.fused_moe import choose_block_m

PATHS = {"one_program": 1 << 62, "five_launches": -1}  # ONE_PROGRAM_PAIRS forcing each path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def graph_us(fn: Any, calls: int, iters: int) -> float:
    """Microseconds per call of fn, `calls` of them captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def measure(ns: argparse.Namespace, tokens: int) -> dict[str, Any]:
    e, k = ns.experts, ns.top_k
    ids = torch.rand(tokens, e, device="cuda").topk(k, dim=-1).indices  # distinct per token
    block_m = choose_block_m(tokens * k, e)
    row: dict[str, Any] = {"tokens": tokens, "assignments": tokens * k, "block_m": block_m}
    outs = {}
    for name, bound in PATHS.items():
        moe_sort.ONE_PROGRAM_PAIRS = bound
        out = moe_sort.sort_by_expert(ids, e, block_m)
        outs[name] = (out.sorted_rows.clone(), out.block_expert.clone(), out.num_slots.clone())
        row[f"{name}_us"] = graph_us(lambda: moe_sort.sort_by_expert(ids, e, block_m),
                                     ns.calls, ns.iters)
    row["equal"] = all(torch.equal(a, b) for a, b in zip(*outs.values(), strict=True))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    default = moe_sort.ONE_PROGRAM_PAIRS
    try:
        rows = [measure(ns, t) for t in ns.tokens]
    finally:
        moe_sort.ONE_PROGRAM_PAIRS = default
    for r in rows:
        best = min(PATHS, key=lambda n: r[f"{n}_us"])
        print(f"A={r['assignments']:5d}: one program {r['one_program_us']:7.1f} us, five "
              f"launches {r['five_launches_us']:7.1f} us -> {best}; outputs equal {r['equal']}")
    result = {"benchmark": "moe_sort_bench", "config": vars(ns),
              "one_program_pairs": default, "rows": rows}
    if ns.out:
        write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
