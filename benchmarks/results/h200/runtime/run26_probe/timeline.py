"""Median time of each hop of a request, from latency_probe.py's stamps (after its warm-up).

    python timeline.py ts.txt
"""

from __future__ import annotations

import ast
import collections
import statistics
import sys

ORDER = ["c_call", "arrival", "s_recv", "s_admit", "s_sent", "w_recv", "w_launched",
         "w_report_last", "s_report_last", "s_out", "f_deliver", "c_ret"]


def timelines(path: str) -> dict[str, dict[str, float]]:
    lines = [line.split() for line in open(path) if line.startswith("TS ")]
    start = next((i for i, f in enumerate(lines) if f[1] == "warm_done"), 0)
    uid_rid: dict[int, str] = {}
    t: dict[str, dict[str, float]] = collections.defaultdict(dict)
    admitted: list[str] = []  # admitted, not yet sent to the worker
    received: list[str] = []  # received by the worker, not yet launched
    for f in lines[start:]:
        kind, now = f[1], float(f[-1])
        if kind == "s_recv":
            t[f[2]].update(s_recv=now, arrival=float(f[3]))
        elif kind == "s_admit":
            uid_rid[int(f[3])] = f[2]
            t[f[2]]["s_admit"] = now
            admitted.append(f[2])
        elif kind in ("c_call", "c_ret", "f_deliver"):
            t[f[2]][kind] = now
        elif kind == "s_sent":
            for rid in admitted:
                t[rid]["s_sent"] = now
            admitted = []
        elif kind == "w_recv":
            received = [uid_rid[u] for u in ast.literal_eval(f[2]) if u in uid_rid]
            for rid in received:
                t[rid]["w_recv"] = now
        elif kind == "w_launched":
            for rid in received:
                t[rid]["w_launched"] = now
            received = []
        elif kind in ("w_report", "s_report"):
            for u in ast.literal_eval(f[2]):
                if u in uid_rid:
                    t[uid_rid[u]][kind + "_last"] = now
        elif kind == "s_out":
            for rid in ast.literal_eval(f[2]):
                t[rid]["s_out"] = now
    return t


def main() -> None:
    t = timelines(sys.argv[1])
    rows = [d for d in t.values() if all(k in d for k in ORDER)]
    print(len(rows), "requests complete of", len(t))
    for a, b in zip(ORDER, ORDER[1:], strict=False):
        v = [(d[b] - d[a]) * 1e3 for d in rows]
        print(f"{a:>14} -> {b:<14} median {statistics.median(v):7.3f} ms  "
              f"mean {statistics.mean(v):7.3f}")
    for name, a, b in (("e2e", "c_call", "c_ret"), ("worker lifetime", "w_launched",
                                                     "w_report_last")):
        print(name, "median", statistics.median((d[b] - d[a]) * 1e3 for d in rows))


if __name__ == "__main__":
    main()
