"""The scheduler's time to take a burst of aborts of queued requests: a load generator stopped
mid-run, every queued request's client disconnecting at once.

    python benchmarks/abort_burst.py [--queued 1000 4000 8000] [--repeats 3] [--out R.json]

N requests are queued (none admitted yet), then aborted one by one, newest first, each by an
AbortReq naming its rid (what the front sends for a client that left). Reported per N (best of
--repeats): seconds for the whole burst and microseconds an abort, on this machine's CPU. The
scheduler answers nothing else while it takes them (no /metrics, no admission, no work for the
device), so the time an abort must stay flat as N grows (managers/wait_queue.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json
from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.messages import AbortReq, GenerateReq
from dllm_serve.managers.scheduler import Scheduler
from dllm_serve.managers.scheduler_config import SchedulerConfig
from dllm_serve.sampling_params import SamplingParams


def burst(queued: int) -> float:
    """Seconds for the scheduler to take `queued` aborts of as many queued requests."""
    cfg = SchedulerConfig(block_size=32, mask_id=0, fdfo=True, max_running_requests=16,
                          max_queued_requests=None, chunked_prefill_size=4096,
                          num_pages=1024, page_size=32)
    sched = Scheduler(cfg, FinishChecker({1}, None))
    prompt = np.arange(2, 66, dtype=np.int64)
    for i in range(queued):
        sched.add_request(GenerateReq(f"req-{i}", prompt, SamplingParams(max_new_tokens=64),
                                      0.0))
    t0 = time.perf_counter()
    for i in reversed(range(queued)):
        sched.abort(AbortReq(f"req-{i}"))
    seconds = time.perf_counter() - t0
    assert not sched.waiting and len(sched.take_outputs()) == queued
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queued", type=int, nargs="+", default=[1000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for n in args.queued:
        best = min(burst(n) for _ in range(args.repeats))
        rows.append({"queued": n, "burst_s": best, "us_per_abort": 1e6 * best / n})
        print(f"{n:6d} queued: {best:.3f} s for the burst, {1e6 * best / n:.1f} us an abort")
    write_json(args.out, {"benchmark": "abort_burst", "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
