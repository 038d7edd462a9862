"""Session 33: does the first prefill's stall follow the worker's idle time, with no compile?

    python3 benchmarks/results/h200/gpupath/first_prefill_idle.py IDLE_S

Starts an Engine on the tiny model (default flags on CUDA: Triton kernels, CUDA graphs; run it
with a Triton cache the warm-up already filled, so nothing compiles), sleeps IDLE_S seconds after
ready, then serves two sets of 12 fresh prompts (1-2000 tokens, as
tests/test_no_compile_after_ready.py draws them) and prints, for the first prefills after ready,
the trace's device time, host launch time and the worker thread's CPU time over the launch.
Session 32 found prefill #0 2-4 ms of thread CPU after a cold-cache start (0.2-0.6 after a warm
one); the spins of first_prefill_site's DLLM_PROBE_SPIN ran at full speed just before it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.trace_summary import read_trace  # noqa: E402
from dllm_serve import Engine  # noqa: E402
from dllm_serve.managers.round_trace import TRACE_ENV  # noqa: E402
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint  # noqa: E402


def main() -> None:
    idle = float(sys.argv[1])
    tmp = Path(tempfile.mkdtemp())
    model = build_tiny_checkpoint(tmp / "tiny")
    trace = tmp / "trace.jsonl"
    os.environ[TRACE_ENV] = str(trace)
    rng = np.random.default_rng(15)
    with Engine(model_path=str(model), max_running_requests=8) as engine:
        ready = time.monotonic()
        time.sleep(idle)
        for _ in range(2):
            prompts = [rng.integers(3, 300, int(n)).tolist() for n in rng.integers(1, 2000, 12)]
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 64,
                                                                "ignore_eos": True})
        time.sleep(0.5)
    prefills = read_trace(str(trace), ready, float("inf"), kinds=("prefill",))
    print(f"idle {idle:.0f} s: first prefills (device ms, host launch ms, thread CPU ms): "
          + ", ".join(f"#{i} {r['gpu_ms']:.3f}/{1e3 * (r['t1'] - r['t0']):.3f}/{r['cpu_ms']:.3f}"
                      for i, r in enumerate(prefills[:6]))
          + f"; median of {len(prefills)} {np.median([r['gpu_ms'] for r in prefills]):.3f}",
          flush=True)


if __name__ == "__main__":
    main()
