"""Encode and decode time of the worker's busiest wire messages (issue 12: host time per
forward), on this machine's CPU.

    python benchmarks/wire_codec.py [--retired 3] [--iters 20000] [--out R.json]

Messages: a WorkerReport with R retired blocks of 32 tokens (the worker sends one after most
FDFO forwards), a WorkerBatch admitting one request (its pages, its first block, its settings),
a WorkerBatch of one Release, a WorkerBatch admitting 8 requests and releasing 8 (a busy FDFO
round's), one prefilling 8 prompts of 96 tokens, the scheduler's BatchOutput of 8 requests'
outputs (one per committed block) and a front's GenerateReq. Reported per message:
microseconds to encode and to decode (best of 3 passes of --iters each) and the encoded size.
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
from dllm_serve.managers import messages as m
from dllm_serve.sampling_params import SamplingParams

K = 32


def examples(retired: int) -> dict[str, object]:
    r = np.arange(retired, dtype=np.int64)
    report = m.WorkerReport(m.Retired(r, r * K, np.arange(retired * K).reshape(retired, K), r + 3,
                                      r * 0, r + 20), forwards=1, block_steps=64)
    settings = m.ReqSettings(prompt_len=90, max_end=218, stop_ids=np.array([1, 2]))
    admit = m.WorkerBatch([m.AddPages(7, 0, np.arange(7, dtype=np.int64)),
                           m.Admit(12, 7, 96, np.full((1, K), 5, np.int64), [None], [0],
                                   settings)])
    outputs = m.BatchOutput([m.ReqOutput(f"req-{i}", np.arange(K, dtype=np.int64), i % 2 == 0,
                                         {"type": "length", "length": 64} if i % 2 == 0 else None,
                                         90, 64, 3, 2, 2, [2, 1] if i % 2 == 0 else [],
                                         [0, 0] if i % 2 == 0 else []) for i in range(8)])
    request = m.GenerateReq("req-0", np.arange(90, dtype=np.int64),
                            SamplingParams(max_new_tokens=64), 1.0)
    admit8 = m.WorkerBatch([item for i in range(8) for item in (
        m.AddPages(i, 0, np.arange(7 * i, 7 * i + 7, dtype=np.int64)),
        m.Admit(12 + i, i, 96, np.full((1, K), 5, np.int64), [None], [0], settings))]
        + [m.Release(4 + i) for i in range(8)])
    return {f"report, {retired} retired": report, "batch: admit one request": admit,
            "batch: admit 8, release 8": admit8,
            "batch: prefill of 8 prompts": m.WorkerBatch([m.Prefill(
                list(range(8)), [0] * 8, [np.arange(96 * i, 96 * i + 96, dtype=np.int64)
                                          for i in range(8)])]),
            "batch: one release": m.WorkerBatch([m.Release(12)]),
            "outputs of 8 requests": outputs, "a request (90 prompt tokens)": request}


def best_us(fn: Any, iters: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return 1e6 * best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--retired", type=int, default=3)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--out", help="JSON results")
    ns = p.parse_args(argv)
    rows = []
    for name, msg in examples(ns.retired).items():
        data = m.encode(msg)
        rows.append({"message": name, "encode_us": best_us(lambda msg=msg: m.encode(msg),
                                                           ns.iters),
                     "decode_us": best_us(lambda data=data: m.decode(data), ns.iters),
                     "bytes": len(data)})
        r = rows[-1]
        print(f"{name:28s} encode {r['encode_us']:6.1f} us  decode {r['decode_us']:6.1f} us  "
              f"{r['bytes']:5d} bytes")
    result = {"benchmark": "wire_codec", "rows": rows}
    if ns.out:
        write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
