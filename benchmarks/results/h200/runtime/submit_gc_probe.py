"""Probe (session 24): the front's submission of N prompts (`front.submit` in a loop, as
Engine.generate does), three bursts: the submission's span, the longest gaps between two
submissions and this process's full collections inside it; "paused" submits each burst with
the collector off (`managers.procs.collector_paused`). Each burst is aborted after it.

    python benchmarks/results/h200/runtime/submit_gc_probe.py 4096 plain   # or paused
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.common import gsm8k_questions  # noqa: E402
from dllm_serve.engine import Engine  # noqa: E402
from dllm_serve.managers.procs import collector_paused  # noqa: E402
from dllm_serve.sampling_params import SamplingParams  # noqa: E402

PAUSES: list[tuple[int, float]] = []
_started = [0.0]


def hook(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        PAUSES.append((info["generation"], 1e3 * (time.perf_counter() - _started[0])))


def burst(engine: Engine, ids: list[list[int]], paused: bool) -> str:
    PAUSES.clear()
    stamps, rids = [], []
    params = SamplingParams(max_new_tokens=1)
    with collector_paused() if paused else contextlib.nullcontext():
        for i in ids:
            stamps.append(time.perf_counter())
            rids.append(engine.front.submit(i, params, lambda out: None, None))
    gaps = sorted((b - a for a, b in zip(stamps, stamps[1:], strict=False)), reverse=True)
    for r in rids:
        engine.front.abort(r)
    return (f"submit span {1e3 * (stamps[-1] - stamps[0]):.1f} ms, longest gaps ms "
            f"{[round(1e3 * g, 1) for g in gaps[:3]]}, full collections ms "
            f"{[round(ms, 1) for gen, ms in PAUSES if gen == 2]}")


if __name__ == "__main__":
    gc.callbacks.append(hook)
    with Engine(device="cpu", log_level="error", max_running_requests=16) as engine:
        ids = engine.front.tokenize_all(gsm8k_questions(int(sys.argv[1])))
        for n in range(3):
            print(f"burst {n} ({sys.argv[2]}): {burst(engine, ids, sys.argv[2] == 'paused')}",
                  flush=True)
            time.sleep(3)
