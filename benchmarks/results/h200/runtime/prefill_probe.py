"""Probe (run 41): test_no_compile_after_ready's workload (five sets of twelve fresh prompts, 64
new tokens, 8 running, the tiny model) served with --dllm-multi-step $MS (default auto); prints
every prefill item of the worker's trace (tokens, device ms, host ms of its launch), slowest
first, and the medians.

    MS=auto python3 benchmarks/results/h200/runtime/prefill_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.trace_summary import read_trace, stalls  # noqa: E402
from dllm_serve import Engine  # noqa: E402
from dllm_serve.managers.round_trace import TRACE_ENV  # noqa: E402
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint  # noqa: E402


def main() -> None:
    ms = os.environ.get("MS", "auto")
    model = Path("/tmp/tiny_probe")
    if not model.exists():
        build_tiny_checkpoint(model)
    trace = Path(f"/tmp/probe_trace_{ms}_{os.getpid()}.jsonl")
    os.environ[TRACE_ENV] = str(trace)
    rng = np.random.default_rng(15)
    lengths = rng.permutation(np.arange(1, 2000))[:60].reshape(5, 12)
    params = {"max_new_tokens": 64, "ignore_eos": True}
    with Engine(model_path=str(model), log_level="warning", max_running_requests=8,
                dllm_multi_step=ms) as engine:
        ready = time.monotonic()
        for lens in lengths.tolist():
            engine.generate(input_ids=[rng.integers(3, 300, n).tolist() for n in lens],
                            sampling_params=params)
        time.sleep(0.5)  # the worker writes its last records once idle
    recs = read_trace(str(trace), ready, float("inf"), kinds=("prefill", "denoise"))
    pre = [(r["rows"], round(r["gpu_ms"], 3), round(1e3 * (r["t1"] - r["t0"]), 3))
           for r in recs if r["kind"] == "prefill"]
    found = stalls(recs, factor=3.0, per_kind=True)
    slow = [(r["kind"], r["rows"], round(r["gpu_ms"], 3)) for r in found["slow"]]
    print(f"MS={ms} median round {found['median_round_ms']:.3f} prefills {len(pre)} median "
          f"prefill {statistics.median(p[1] for p in pre):.3f} slow {slow}")
    print("prefills (tokens, gpu ms, host ms) by gpu ms:", sorted(pre, key=lambda p: -p[1])[:12])


if __name__ == "__main__":
    main()
