"""Join the latency probe's events (sitecustomize.py here) by request and print each hop's
mean / p50 / p90 in ms: python3 lat_join.py DIR."""

from __future__ import annotations

import bisect
import glob
import json
import statistics
import sys
from typing import Any

HOPS = [("F_submit", "S_recv"), ("S_recv", "S_admit"), ("S_admit", "W_admit"),
        ("W_admit", "W_first"), ("W_first", "S_out"), ("S_out", "F_deliver")]


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"n": len(v), "mean_ms": round(statistics.mean(v), 3), "p50": round(v[len(v) // 2], 3),
            "p90": round(v[int(0.9 * len(v))], 3)}


def follow(starts: list[float], ends: list[float], within: float = 0.05) -> list[float]:
    """ms from each start to the first end after it (within `within` s)."""
    out = []
    for t in starts:
        k = bisect.bisect_left(ends, t)
        if k < len(ends) and ends[k] - t < within:
            out.append(1e3 * (ends[k] - t))
    return out


def main(d: str) -> dict[str, Any]:
    events = [json.loads(line) for f in glob.glob(f"{d}/ev.*.jsonl") for line in open(f)]
    rid_of = {e[3]: e[2] for e in events if e[1] == "S_admit" and e[2] is not None}
    by: dict[str, dict[str, float]] = {}
    for e in events:
        rid = e[2] if len(e) > 2 and e[2] is not None else (rid_of.get(e[3]) if len(e) > 3
                                                                else None)
        if rid is not None:
            by.setdefault(rid, {}).setdefault(e[1], e[0])
    out = {}
    for a, b in HOPS:
        v = [1e3 * (r[b] - r[a]) for r in by.values() if a in r and b in r]
        if v:
            out[f"{a}->{b}"] = stats(v)
    times = {k: sorted(e[0] for e in events if e[1] == k) for k in ("W_report", "S_report")}
    subs = sorted(r["F_submit"] for r in by.values() if "F_submit" in r)
    dels = sorted(r["F_deliver"] for r in by.values() if "F_deliver" in r)
    for name, v in (("F_deliver->next F_submit", follow(dels, subs)),
                    ("W_report->S_report", follow(times["W_report"], times["S_report"]))):
        if v:
            out[name] = stats(v)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1))
