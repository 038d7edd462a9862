"""Probe (run 43): benchmarks/runtime_bench.py (same arguments) with each timed window's raw
worker trace analysed, to see where the device's idle goes: the gaps between device items by
size (count, % of the span) and by the kinds of the items on either side (since run 47), the
rows per forward, the host's work per loop iteration (p50 / p90 / p99 ms), the
denoise launch call's host time, and the six longest gaps with the host and GC records near
them. Written to $PROBE_OUT (default gaps.json) after each window.

    PROBE_OUT=gaps.json python3 benchmarks/results/h200/runtime/gap_probe.py \
        --suite default-model --settings fdfo --concurrency 16 64 --prompts-per-slot 8 --repeats 2
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import benchmarks.runtime_bench as rb  # noqa: E402

OUT = os.environ.get("PROBE_OUT", "gaps.json")
results: list[dict[str, Any]] = []
BINS = ((0, 0.01), (0.01, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.5), (0.5, 2), (2, 1e9))
orig = rb.summarize


def percentiles(values: list[float]) -> dict[int, float]:
    v = sorted(values)
    return {p: round(v[int(p / 100 * (len(v) - 1))], 3) for p in (50, 90, 99)} if v else {}


def near(records: list[dict[str, Any]], item: dict[str, Any], gap: float) -> list[dict]:
    """The host, GC and prefill records within a few ms of the item's launch."""
    return [dict(kind=h["kind"], dt0=round(1e3 * (h["t0"] - item["t0"]), 3),
                 ms=round(1e3 * (h["t1"] - h["t0"]), 3), wait=round(h.get("wait_ms", 0), 3),
                 ph=[round(p, 3) for p in h.get("phases_ms", [])])
            for h in records if h["kind"] in ("host", "gc", "prefill")
            and abs(h["t0"] - item["t0"]) < max(0.004, 2e-3 * gap)][:12]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = orig(records)
    items = [r for r in records if r["kind"] in ("prefill", "denoise")]
    host = [r for r in records if r["kind"] == "host"]
    gaps = sorted(((r["gap_ms"], i) for i, r in enumerate(items) if i), reverse=True)
    span = sum(r["gpu_ms"] for r in items) + sum(g for g, _ in gaps)
    hist = {}
    for lo, hi in BINS:
        sel = [g for g, _ in gaps if lo <= g < hi]
        hist[f"{lo}-{hi}"] = [len(sel), round(100 * sum(sel) / span, 2)]
    top = [{"gap": round(g, 3), "rows": items[i]["rows"], "prev_rows": items[i - 1]["rows"],
            "launch_ms": round(1e3 * (items[i]["t1"] - items[i]["t0"]), 3), "index": i,
            "of": len(items), "near": near(records, items[i], g)} for g, i in gaps[:6]]
    by_kind: dict[str, float] = {}
    for i, r in enumerate(items[1:], 1):  # idle before an item, by its and the last one's kind
        key = f"{items[i - 1]['kind']}->{r['kind']}"
        by_kind[key] = by_kind.get(key, 0.0) + r["gap_ms"]
    results.append({
        "forwards": out.get("forwards"), "idle": out.get("idle_fraction"),
        "gap_pct_by_kinds": {k: round(100 * v / span, 3) for k, v in by_kind.items()},
        "rows_pct": percentiles([float(r["rows"]) for r in items if r["kind"] == "denoise"]),
        "gap_hist_count_pct": hist,
        "host_iter_ms_pct": percentiles([1e3 * (h["t1"] - h["t0"]) - h["wait_ms"]
                                         for h in host]),
        "launch_ms_pct": percentiles([1e3 * (r["t1"] - r["t0"]) for r in items
                                      if r["kind"] == "denoise"]),
        "top_gaps": top})
    Path(OUT).write_text(json.dumps(results, indent=1))
    return out


if __name__ == "__main__":
    rb.summarize = summarize
    rb.main(sys.argv[1:])
