"""What a small host <-> device copy between two CUDA-graph replays costs the stream (issue 12).

    python benchmarks/host_copy_bench.py --out results/host_copy.json

A graph of one short kernel (about 15 us on an H200) is replayed --iters times back to back, the
host never waiting, alone and with a copy after (or before) each replay, the way the worker
queues its forwards: the step's readout (--rows x --width int64) to pinned host memory, by a
DMA copy (`Tensor.copy_(non_blocking=True)`, what the worker did), by a Triton kernel launched
from Python after the replay, and by the same kernel captured at the end of the graph
(`kernels.host_copy.PublishRing`, what the denoise graphs do); and, for comparison, the staged
row writes from pinned memory to the device by a DMA copy. Reported: device microseconds per
iteration (CUDA events around the whole loop), each copy's cost over the replay alone, and the
host's microseconds per iteration (the Python of the replay and the copy). CUDA only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json  # noqa: E402
from benchmarks.round_roofline import graphed  # noqa: E402
from dllm_serve.kernels.host_copy import PublishRing  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--width", type=int, default=37, help="int64 values a row (32-token blocks)")
    ap.add_argument("--work-us", type=float, default=15.0, help="the graph's kernel, roughly")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_copy_bench measures CUDA streams: run it on a GPU")
    dev = torch.device("cuda")
    dev_buf = torch.arange(ns.rows * ns.width, device=dev, dtype=torch.int64).view(ns.rows, -1)
    host = [torch.empty_like(dev_buf, device="cpu").pin_memory() for _ in range(2)]
    x = torch.randn(1 << 20, device=dev)
    steps = max(1, int(ns.work_us / 0.5))
    ring = PublishRing(ns.rows, ns.width, dev, slots=2)

    def body_of(publish: bool) -> Callable[[], None]:
        def body() -> None:
            for _ in range(steps):
                x.mul_(1.0001)
            if publish:
                ring.publish(dev_buf)
        return body

    replay, published = graphed(body_of(False), dev), graphed(body_of(True), dev)
    cases: dict[str, Callable[[int], None]] = {
        "replay": lambda i: replay(),
        "replay + DMA to host": lambda i: (replay(),
                                           host[i % 2].copy_(dev_buf, non_blocking=True)),
        "replay + kernel to host": lambda i: (replay(), ring.publish(dev_buf)),
        "replay with the kernel in the graph": lambda i: published(),
        "DMA to device + replay": lambda i: (dev_buf.copy_(host[i % 2], non_blocking=True),
                                             replay()),
    }
    for fn in cases.values():  # compile, warm
        fn(0)
    torch.cuda.synchronize()
    trials = []
    for _ in range(ns.trials):
        us = {}
        for name, fn in cases.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for i in range(ns.iters):
                fn(i)
            end.record()
            torch.cuda.synchronize()
            us[name] = start.elapsed_time(end) * 1e3 / ns.iters
        trials.append(us)
        print({k: round(v, 2) for k, v in us.items()}, "us per iteration", flush=True)
    host_us = {}  # the host's side: microseconds of Python per call, nothing else queued
    for name, fn in cases.items():
        torch.cuda.synchronize()
        calls = min(ns.iters, 300)  # few enough that the launch queue never fills
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        host_us[name] = (time.perf_counter() - t0) * 1e6 / calls
        torch.cuda.synchronize()
    print("host us per iteration:", {k: round(v, 2) for k, v in host_us.items()}, flush=True)
    best = {name: min(t[name] for t in trials) for name in cases}
    cost = {name: best[name] - best["replay"] for name in cases if name != "replay"}
    print("cost over the replay alone (best of trials):",
          {k: round(v, 2) for k, v in cost.items()}, "us")
    result = {"benchmark": "host_copy_bench", "config": vars(ns),
              "device": torch.cuda.get_device_name(dev), "trials_us": trials,
              "best_us": best, "copy_cost_us": cost, "host_us": host_us}
    write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
