"""Read the worker's trace ($DLLM_SERVE_ROUND_TRACE, dllm_serve/managers/round_trace.py) and
summarise a time window of it: how busy the device was and how much host time each forward
cost.

Device items (prefill, denoise = forward + step) carry gpu_ms and gap_ms (device idle since the
previous item's end), both from CUDA events, so the device timeline of a window is exact:
span = sum of gpu_ms + sum of gap_ms (the first item's gap excluded: it reaches back before the
window). busy_fraction = gpu time / span, idle_fraction = gaps / span. Host records give the
worker loop's host work per iteration (its time minus the time it waited for the device).
"""

from __future__ import annotations

import json
from typing import Any


def read_trace(path: str, start: float, end: float,
               kinds: tuple[str, ...] = ("prefill", "denoise", "host")) -> list[dict[str, Any]]:
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
    return {
        "span_s": span_ms / 1e3, "forwards": len(denoise), "prefills": len(items) - len(denoise),
        "forwards_per_s": 1e3 * len(denoise) / span_ms if span_ms > 0 else 0.0,
        "busy_fraction": gpu_ms / span_ms if span_ms > 0 else 0.0,
        "idle_fraction": gap_ms / span_ms if span_ms > 0 else 0.0,
        "forward_ms_mean": sum(r["gpu_ms"] for r in denoise) / n,
        "gap_ms_mean": gap_ms / max(1, len(items) - 1),
        "rows_mean": sum(r["rows"] for r in denoise) / n,
        "host_ms_per_forward": host_ms / n,
    }
