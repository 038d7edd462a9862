"""Experiment (session 25, run 100): benchmarks/runtime_bench.py with each engine's scheduler and
worker main threads pinned to cores of their own (PIN=1), the benchmark process to cores 0-1;
the gap probe's per-window summaries (../gap_probe.py, PROBE_OUT). Run from the repository root:

    PIN=1 PROBE_OUT=gaps.json python3 \
        benchmarks/results/h200/runtime/run100_pinning_h100/pin_probe.py \
        --suite default-heldout --clients engine --concurrency 16 --w2-concurrency 16 \
        --mini-concurrency 16 --prompts-per-slot 256 --interleave --repeats 4 \
        --settings fdfo fdfo-w2 --out R.json
"""
import os
import sys

sys.path.insert(0, os.getcwd())
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gap_probe.py")
sys.argv[0] = PROBE
import runpy  # noqa: E402

import benchmarks.runtime_bench as rb  # noqa: E402

NEXT = [2]
orig_open = rb.open_engine


def pinned_open(stack, kw, trace):
    o = orig_open(stack, kw, trace)
    if os.environ.get("PIN") == "1":
        os.sched_setaffinity(0, {0, 1})
        for name, p in o.engine.front.procs.procs.items():
            core = NEXT[0] % os.cpu_count()
            NEXT[0] += 1
            os.sched_setaffinity(p.pid, {core})
            print(f"pinned {name} pid {p.pid} to core {core}", flush=True)
    return o


rb.open_engine = pinned_open
runpy.run_path(PROBE, run_name="__main__")
