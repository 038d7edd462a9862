"""Device time of denoise forwards, for the round trace (managers/round_trace.py).

`wrap` puts a pair of CUDA events around each call of a forward (wall clock on the CPU, where
a forward is synchronous); `drain`, called after the round's final host sync, sums them without
waiting for anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_ms = 0.0
        self._count = 0

    def wrap(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def timed() -> torch.Tensor:
            self._count += 1
            if not self.cuda:
                start = time.perf_counter()
                out = run()
                self._cpu_ms += 1e3 * (time.perf_counter() - start)
                return out
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = run()
            end.record()
            self._events.append((begin, end))
            return out

        return timed

    def drain(self) -> tuple[int, float]:
        """(forwards, their total milliseconds) since the last drain."""
        ms = self._cpu_ms + sum(b.elapsed_time(e) for b, e in self._events)
        count = self._count
        self._events, self._cpu_ms, self._count = [], 0.0, 0
        return count, ms
