"""Read the worker's trace ($DLLM_SERVE_ROUND_TRACE, dllm_serve/managers/round_trace.py) and
summarise a time window of it: how busy the device was and how much host time each forward
cost.

Device items (prefill, denoise = forward + step) carry gpu_ms and gap_ms (device idle since the
previous item's end), both from CUDA events, so the device timeline of a window is exact:
span = sum of gpu_ms + sum of gap_ms (the first item's gap excluded: it reaches back before the
window). busy_fraction = gpu time / span, idle_fraction = gaps / span. Host records give the
worker loop's host work per iteration (its time minus the time it waited for the device).
GC records (the cyclic collector's pauses of the worker's host, each inside some iteration)
give its time per forward and its longest pause. `long_gap_fraction`: the part of the span
idle in gaps over LONG_GAP_MS (the host stalled) rather than in the short ones (the host a
little behind every forward).
`stalls` finds items far slower than the median round (a Triton compile inside serving shows up
as an item of seconds): worst_item_ratio = the slowest item's gpu_ms / the median denoise item's.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

LONG_GAP_MS = 0.5


KINDS = ("prefill", "denoise", "host", "gc")


def read_trace(path: str, start: float, end: float,
               kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """The records of `kinds` whose host interval lies inside [start, end] (monotonic s)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["kind"] in kinds and r["t0"] >= start and r["t1"] <= end]


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    items = [r for r in records if r["kind"] in ("prefill", "denoise")]
    if not items:
        return {}
    denoise = [r for r in items if r["kind"] == "denoise"]
    gpu_ms = sum(r["gpu_ms"] for r in items)
    gap_ms = sum(r["gap_ms"] for r in items[1:])
    span_ms = gpu_ms + gap_ms
    host = [r for r in records if r["kind"] == "host"]
    host_ms = sum(1e3 * (r["t1"] - r["t0"]) - r["wait_ms"] for r in host)
    n = max(1, len(denoise))
    phases = [sum(r.get("phases_ms", [0.0] * 3)[i] for r in host) for i in range(3)]
    messages = host_ms - sum(phases) + sum(r["wait_ms"] for r in host)
    gaps = [r["gap_ms"] for r in items[1:]]
    pauses = [1e3 * (r["t1"] - r["t0"]) for r in records if r["kind"] == "gc"]
    return {
        "span_s": span_ms / 1e3, "forwards": len(denoise), "prefills": len(items) - len(denoise),
        "forwards_per_s": 1e3 * len(denoise) / span_ms if span_ms > 0 else 0.0,
        "busy_fraction": gpu_ms / span_ms if span_ms > 0 else 0.0,
        "idle_fraction": gap_ms / span_ms if span_ms > 0 else 0.0,
        "forward_ms_mean": sum(r["gpu_ms"] for r in denoise) / n,
        "gap_ms_mean": gap_ms / max(1, len(items) - 1),
        "gap_ms_max": max(gaps, default=0.0),
        "long_gap_fraction": (sum(g for g in gaps if g > LONG_GAP_MS) / span_ms
                              if span_ms > 0 else 0.0),
        "gc_ms_per_forward": sum(pauses) / n, "gc_pause_ms_max": max(pauses, default=0.0),
        "gc_collections": len(pauses),
        "rows_mean": sum(r["rows"] for r in denoise) / n,
        "host_ms_per_forward": host_ms / n,
        # host_ms_per_forward split: changes (prefill launches among them), launch, collect
        # (without the wait), messages (receive + send)
        "host_split_ms_per_forward": {
            "changes": phases[0] / n, "launch": phases[1] / n,
            "collect": (phases[2] - sum(r["wait_ms"] for r in host)) / n, "messages": messages / n},
        **{k: v for k, v in stalls(items).items() if k != "slow"},
    }


def stalls(records: list[dict[str, Any]], factor: float = 3.0, per_kind: bool = False,
           prefill_factor: float | None = None) -> dict[str, Any]:
    """The median denoise item (a round), the slowest item of any kind, their ratio, and the
    items slower than `factor` x the median round ("slow"); with per_kind, each prefill item
    is held to `prefill_factor` (default `factor`) x the median prefill item instead (a
    prefill of thousands of tokens takes several rounds of a small model's time without any
    stall)."""
    items = [r for r in records if r["kind"] in ("prefill", "denoise")]
    rounds = [r["gpu_ms"] for r in items if r["kind"] == "denoise"]
    if not rounds:
        return {}
    median = statistics.median(rounds)
    bound = {"denoise": factor * median, "prefill": factor * median}
    if per_kind and any(r["kind"] == "prefill" for r in items):
        bound["prefill"] = (prefill_factor or factor) * statistics.median(
            r["gpu_ms"] for r in items if r["kind"] == "prefill")
    worst = max(items, key=lambda r: r["gpu_ms"])
    return {"median_round_ms": median, "worst_item_ms": worst["gpu_ms"],
            "worst_item_kind": worst["kind"],
            "worst_item_ratio": worst["gpu_ms"] / median if median > 0 else 0.0,
            "slow": [r for r in items if r["gpu_ms"] > bound[r["kind"]]]}
