"""Per-request round trip on the held-out problems (runs 26-27): where a request's time goes
between the client's call and its answer. An ad hoc probe, not a benchmark of the project.

    git apply benchmarks/results/h200/runtime/run26_probe/instrument.patch
    python benchmarks/results/h200/runtime/run26_probe/latency_probe.py threads 1 16 2> ts.txt
    python benchmarks/results/h200/runtime/run26_probe/timeline.py ts.txt
    git checkout dllm_serve

instrument.patch makes the front, the scheduler and the worker write a timestamped line to
stderr at each hop of a request (TS <stage> <key> ... <time.monotonic()>); this script adds
the client's call and return. Clients: `threads` (C threads calling Engine.generate, as
runtime_bench did before run 28) or `driver` (one thread submitting through the front with
callbacks). Arguments: clients, W (wavefront size), C (concurrency); 16 prompts per client.
"""

from __future__ import annotations

import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from benchmarks.common import gsm8k_questions  # noqa: E402

HELDOUT = "benchmarks/results/default_model/heldout_seed7_256.jsonl"
PARAMS = {"max_new_tokens": 128, "temperature": 0.0}


def stamp(*fields: object) -> None:
    os.write(2, ("TS " + " ".join(str(f) for f in fields) + "\n").encode())


def threads(engine: Any, prompts: list[str], c: int) -> list[tuple[str, float, float, int]]:
    def one(p: str) -> tuple[str, float, float, int]:
        t0 = time.monotonic()
        o = engine.generate(p, PARAMS)
        return o["meta_info"]["id"], t0, time.monotonic(), o["meta_info"]["completion_tokens"]

    with ThreadPoolExecutor(c) as pool:
        return list(pool.map(one, prompts))


def driver(engine: Any, prompts: list[str], c: int) -> list[tuple[str, float, float, int]]:
    from dllm_serve.engine import per_prompt_params

    done: queue.Queue = queue.Queue()
    out: list[tuple[str, float, float, int]] = []

    def submit(i: int) -> None:
        ids = engine.front.tokenize(prompts[i])
        params = per_prompt_params(PARAMS, 1)[0]
        t0 = time.monotonic()
        engine.front.submit(ids, params,
                            lambda o, t0=t0: done.put((t0, o)) if o.finished else None)

    sent = min(c, len(prompts))
    for i in range(sent):
        submit(i)
    while len(out) < len(prompts):
        t0, o = done.get()
        out.append((o.rid, t0, time.monotonic(), len(o.output_ids)))
        if sent < len(prompts):
            submit(sent)
            sent += 1
    return out


def main() -> None:
    from dllm_serve import Engine

    clients, w, c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    run = {"threads": threads, "driver": driver}[clients]
    with Engine(device=os.environ.get("PROBE_DEVICE", "cuda"), dllm_algorithm="JointThreshold",
                dllm_wavefront_size=w, max_running_requests=c, log_level="warning") as engine:
        prompts = gsm8k_questions(c * 16, HELDOUT, seed=c)
        run(engine, prompts, c)  # warm-up
        stamp("warm_done", 0, time.monotonic())
        t0 = time.monotonic()
        res = run(engine, prompts, c)
        wall = time.monotonic() - t0
        print(f"{clients} W={w} C={c}: {sum(r[3] for r in res) / wall:.0f} tok/s", flush=True)
        for rid, a, b, _ in res:
            stamp("c_call", rid, a)
            stamp("c_ret", rid, b)


if __name__ == "__main__":
    main()
