"""The cyclic garbage collector's pauses in each process of an Engine while it serves a burst
of queued requests (what `--clients engine` runs of benchmarks/runtime_bench.py send: every
prompt at once).

    python benchmarks/gc_pauses.py [--requests 1024] [--bursts 3] [--max-new-tokens 32]
        [--out R.json]

Every process of the run (this one, which holds the Engine's front, and the scheduler and
worker it spawns) records each collection: a `sitecustomize` module on the children's
PYTHONPATH installs the same gc callback in them. --bursts bursts run one after another (a full
collection comes once enough objects have survived, which one burst may not reach). Reported
per process and generation, from the Engine's ready to the last burst's last answer:
collections, total and longest pause (ms), and
the objects the full collections found tracked. The scheduler or the worker paused is the
device idle once the worker's admitted blocks run out. Runs with any tree that has an Engine,
so an older commit (`git archive`) is measured with the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT_ENV = "DLLM_SERVE_GC_PAUSES_OUT"

# the children's hook: one JSON line per collection, appended to $OUT_ENV
HOOK = '''
import gc, json, os, sys, time
def _hook(phase, info, _t=[0.0]):
    if phase == "start":
        _t[0] = time.perf_counter()
        return
    ms = 1e3 * (time.perf_counter() - _t[0])
    mp = sys.modules.get("multiprocessing")  # loaded by then in every process of an Engine
    try:
        rec = {"t": time.monotonic(), "proc": mp.current_process().name if mp else "?",
               "gen": info["generation"], "ms": ms,
               "tracked": len(gc.get_objects()) if info["generation"] == 2 else None}
        with open(os.environ["OUT_ENV"], "a") as f:
            f.write(json.dumps(rec) + "\\n")
    except Exception:  # interpreter shutdown: nothing to record
        pass
gc.callbacks.append(_hook)
'''.replace("OUT_ENV", OUT_ENV)


def install(log: Path) -> Path:
    """Write the hook as a sitecustomize module, put it on PYTHONPATH for the children and
    install it here; returns its folder."""
    folder = Path(tempfile.mkdtemp(prefix="gc-pauses-"))
    (folder / "sitecustomize.py").write_text(HOOK)
    os.environ[OUT_ENV] = str(log)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(folder), str(Path(__file__).resolve().parents[1]),
         *filter(None, [os.environ.get("PYTHONPATH")])])
    exec(HOOK, {})  # this process: the front
    return folder


def summarize(records: list[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    """Per process and generation: collections, total and longest pause, objects tracked."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        if not start <= r["t"] <= end:
            continue
        row = rows.setdefault((r["proc"], r["gen"]), {
            "process": r["proc"], "generation": r["gen"], "collections": 0, "total_ms": 0.0,
            "longest_ms": 0.0, "tracked_max": None})
        row["collections"] += 1
        row["total_ms"] += r["ms"]
        row["longest_ms"] = max(row["longest_ms"], r["ms"])
        if r["tracked"] is not None:
            row["tracked_max"] = max(row["tracked_max"] or 0, r["tracked"])
    return sorted(rows.values(), key=lambda x: (x["process"], x["generation"]))


def serve_bursts(args: argparse.Namespace) -> tuple[float, float, list[float]]:
    """(ready, last answer, each burst's seconds) of --bursts bursts through an Engine."""
    from benchmarks.common import gsm8k_questions
    from dllm_serve.engine import Engine

    prompts = gsm8k_questions(args.requests)
    with Engine(device=args.device, log_level="warning",
                max_running_requests=args.max_running_requests) as engine:
        start, bursts = time.monotonic(), []
        for _ in range(args.bursts):
            t0 = time.monotonic()
            engine.generate(prompts, {"max_new_tokens": args.max_new_tokens})
            bursts.append(time.monotonic() - t0)
        end = time.monotonic()
    return start, end, bursts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-running-requests", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from benchmarks.common import git_commit, write_json

    log = Path(tempfile.mkdtemp(prefix="gc-pauses-log-")) / "gc.jsonl"
    hook = install(log)
    try:
        start, end, bursts = serve_bursts(args)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    finally:
        shutil.rmtree(hook, ignore_errors=True)
        shutil.rmtree(log.parent, ignore_errors=True)
    rows = summarize(records, start, end)
    for r in rows:
        print(f"{r['process']:22s} gen{r['generation']}: {r['collections']:4d} collections, "
              f"{r['total_ms']:8.1f} ms in all, longest {r['longest_ms']:7.1f} ms"
              + (f", {r['tracked_max']} objects tracked" if r["tracked_max"] else ""))
    write_json(args.out, {"benchmark": "gc_pauses", "commit": git_commit(),
                          "config": vars(args), "burst_s": bursts, "rows": rows})


if __name__ == "__main__":
    main()
