"""Worker-side timing of every round, for benchmarks (benchmarks/engine_gpu.py).

With DLLM_SERVE_ROUND_TRACE=FILE in its environment the worker appends one JSON line per work
item to FILE: kind ("prefill" | "denoise"), t0 and t1 (time.monotonic(), comparable across
processes on Linux) around the item, forwards, blocks (active blocks after the round), and
forward_ms, the device time of its denoise forwards (CUDA events around each forward: a graph
replay or an eager forward); its first line (kind "worker") says whether CUDA graphs are in use
and for which buckets. The worker runs one item at a time and each item ends with a host
sync, so the device has no work between one item's t1 and the next one's t0: the time between
items is device idle time. `summarize` turns the records of a time window into the numbers the
benchmark reports.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import IO, Any

import torch

from dllm_serve.managers.messages import DenoiseWork, PrefillWork
from dllm_serve.model.forward_timer import ForwardTimer

TRACE_ENV = "DLLM_SERVE_ROUND_TRACE"
Run = Callable[[PrefillWork | DenoiseWork], Any]


def traced(run: Run, runner: Any) -> Run:
    """`run` (Worker.run), timed into $DLLM_SERVE_ROUND_TRACE when it is set."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return run
    runner.timer = ForwardTimer(runner.device)
    out: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the worker)
    graphs = runner.graphs
    now = time.monotonic()
    out.write(json.dumps({"kind": "worker", "t0": now, "t1": now,
                          "cuda_graphs": graphs is not None,
                          "graph_buckets": graphs.buckets if graphs is not None else []}) + "\n")

    def timed(work: PrefillWork | DenoiseWork) -> Any:
        t0 = time.monotonic()
        result = run(work)
        if isinstance(work, PrefillWork) and runner.device.type == "cuda":
            torch.cuda.synchronize()  # a prefill returns without waiting for the device
        t1 = time.monotonic()
        forwards, ms = runner.timer.drain()
        record = {"kind": "prefill" if isinstance(work, PrefillWork) else "denoise",
                  "t0": t0, "t1": t1, "forwards": getattr(result, "forwards", 1),
                  "blocks": len(getattr(result, "block_ids", ())), "forward_ms": ms,
                  "timed_forwards": forwards}
        out.write(json.dumps(record) + "\n")
        return result

    return timed


def read_trace(path: str, start: float, end: float, kinds: tuple[str, ...] = ("prefill",
               "denoise")) -> list[dict[str, Any]]:
    """The records of `kinds` that ran inside [start, end] (monotonic seconds)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["kind"] in kinds and r["t0"] >= start and r["t1"] <= end]


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Rounds/s, forwards/s and where the time went, over the span from the first item's start
    to the last item's end: idle_fraction is the share of that span between items (the
    device certainly idle), forward_fraction the share inside denoise forwards."""
    if not records:
        return {}
    span = max(r["t1"] for r in records) - min(r["t0"] for r in records)
    busy = sum(r["t1"] - r["t0"] for r in records)
    rounds = [r for r in records if r["kind"] == "denoise"]
    forwards = sum(r["forwards"] for r in rounds)
    forward_s = sum(r["forward_ms"] for r in rounds) / 1e3
    round_s = sum(r["t1"] - r["t0"] for r in rounds)
    return {
        "span_s": span, "rounds": len(rounds), "forwards": forwards,
        "prefills": len(records) - len(rounds),
        "rounds_per_s": len(rounds) / span if span > 0 else 0.0,
        "forwards_per_s": forwards / span if span > 0 else 0.0,
        "idle_fraction": max(0.0, span - busy) / span if span > 0 else 0.0,
        "forward_fraction": forward_s / span if span > 0 else 0.0,
        "round_ms_mean": 1e3 * round_s / max(1, len(rounds)),
        "forward_ms_mean": 1e3 * forward_s / max(1, forwards),
        "gap_ms_mean": 1e3 * max(0.0, span - busy) / max(1, len(records) - 1),
        "in_round_host_ms_per_forward": 1e3 * (round_s - forward_s) / max(1, forwards),
    }
