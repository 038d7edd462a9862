"""Probe (run 48): the worker's host time per scheduler item type (Worker.apply), timed in
every engine process that imports it; each process writes $APPLY_PROBE.<pid>.json at exit.

    APPLY_PROBE=/tmp/apply PYTHONPATH=benchmarks/results/h200/runtime/probes/apply:. \
        python3 benchmarks/runtime_bench.py --suite default-model --settings fdfo sync ...
"""

import os

if os.environ.get("APPLY_PROBE"):
    import atexit
    import collections
    import json
    import time

    from dllm_serve.managers import worker as _w

    _acc: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    _orig = _w.Worker.apply

    def _apply(self, item):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        _orig(self, item)
        d = time.perf_counter() - t
        a = _acc[type(item).__name__]
        a[0] += 1
        a[1] += d
        a[2] = max(a[2], d)

    _w.Worker.apply = _apply  # type: ignore[method-assign]

    def _dump() -> None:
        if _acc:
            with open(f"{os.environ['APPLY_PROBE']}.{os.getpid()}.json", "w") as f:
                json.dump({k: {"n": n, "us_mean": 1e6 * s / n, "us_max": 1e6 * m}
                           for k, (n, s, m) in _acc.items()}, f)

    atexit.register(_dump)
