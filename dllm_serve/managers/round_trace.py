"""Worker-side timing of every device item and every loop iteration, for benchmarks.

With DLLM_SERVE_ROUND_TRACE=FILE in its environment the worker appends JSON lines to FILE:
- first {"kind": "worker", "cuda_graphs": bool, "graph_buckets": [...]};
- per device item ("prefill" | "denoise": one forward, with the step for denoise): rows (active
  blocks; a prefill's: its tokens), t0 / t1 (time.monotonic() around the host's launch), cpu_ms
  (the worker thread's CPU time over that launch, time.thread_time(): a launch slower than its
  CPU time waited, one as slow in CPU time ran slowly), gpu_ms (device time, from CUDA events
  around the item; wall time on the CPU) and gap_ms (device idle between the previous item's
  end and this one's start: CUDA events, so exact; 0 for the first item);
- per collection of the cyclic garbage collector ("gc"): gen, t0 / t1, collected (a pause
  of the host inside whatever it was doing);
- per Triton compile after ready ("compile"): t0 / t1, kernel (its signature; a compile is a
  stall the warm-up should have prevented: kernels/compile_watch.py);
- per loop iteration with work ("host"): t0 / t1 and wait_ms, the part of it the host spent
  blocked on the device (reading a step back), so t1 - t0 - wait_ms is host work; phases_ms
  splits it: applying the scheduler's changes (prefill launches among them), join + launch,
  collect (wait_ms included) + report; the rest is receiving and sending messages.
Items are timed when the worker goes idle (`settle`) or once PENDING of them wait, never in
the busy loop one by one (reading two events' times per forward cost tens of microseconds of
the very host time the trace measures), and never waiting for the device while busy. Their
timing events come from a pool: an item's are recorded again for a later item once it is
timed (making and destroying two CUDA events per item was host time the trace added to what
it measures). The readers are in benchmarks/trace_summary.py.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref
from collections.abc import Callable
from typing import IO, Any, TypeVar

import torch

TRACE_ENV = "DLLM_SERVE_ROUND_TRACE"
KEEP = 1 << 16  # records held before encoding
PENDING = 1 << 12  # device items held before the done ones are timed
T = TypeVar("T")


class Tracer:
    def __init__(self, path: str, device: torch.device, header: dict[str, Any]) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        # records are kept as they are and encoded in settle() (the worker going idle) or every
        # KEEP records: JSON encoding in the busy loop would count as the host's work
        self.out: IO[str] = open(path, "a")  # noqa: SIM115 (lives with the worker)
        self.records: list[dict[str, Any]] = []
        self.pending: list[tuple[dict[str, Any], Any, Any]] = []
        self.prev_end: Any = None
        self.free: list[Any] = []  # timing events whose items are timed (CUDA)
        now = time.monotonic()
        self._write({"kind": "worker", "t0": now, "t1": now, **header})
        # on disk at once: the worker is built before it reports ready, so a reader that
        # starts once the engine is up finds the header (the loop's first settle may come later)
        self._encode()
        self.out.flush()
        self.gc_t0 = 0.0
        gc.callbacks.append(_gc_hook(weakref.ref(self)))

    @staticmethod
    def from_env(device: torch.device, header: dict[str, Any]) -> Tracer | None:
        path = os.environ.get(TRACE_ENV)
        return Tracer(path, device, header) if path else None

    def run(self, kind: str, fn: Callable[[], T], rows: int = 0) -> T:
        """Run fn (which queues one device item) between two timestamps."""
        start, t0, c0 = self._mark(), time.monotonic(), time.thread_time()
        out = fn()
        end, t1, c1 = self._mark(), time.monotonic(), time.thread_time()
        self.pending.append(({"kind": kind, "rows": rows, "t0": t0, "t1": t1,
                              "cpu_ms": 1e3 * (c1 - c0)}, start, end))
        if len(self.pending) >= PENDING:
            self._flush()
        return out

    def settle(self) -> None:
        """Write every pending item and flush the file (the worker is going idle: waiting costs
        nothing; readers see every record of a run once the worker is idle)."""
        if self.cuda:
            torch.cuda.synchronize()
        self._flush()
        self._encode()
        self.out.flush()

    def host(self, t0: float, t1: float, wait_s: float, phases_s: list[float]) -> None:
        """One loop iteration: [t0, t1], wait_s of it blocked on readouts, phases_s the
        worker's split of it (Worker.phase_s: changes, launch, collect incl. the wait)."""
        self._write({"kind": "host", "t0": t0, "t1": t1, "wait_ms": 1e3 * wait_s,
                     "phases_ms": [1e3 * p for p in phases_s]})

    def compile(self, kernel: str, seconds: float) -> None:
        """A Triton compile after ready (kernels/compile_watch.py), ending now."""
        now = time.monotonic()
        self._write({"kind": "compile", "t0": now - seconds, "t1": now, "kernel": kernel})

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.gc_t0 = time.monotonic()
        else:
            self._write({"kind": "gc", "gen": info["generation"], "t0": self.gc_t0,
                         "t1": time.monotonic(), "collected": info["collected"]})

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def _flush(self) -> None:
        """Time and write the pending items whose end has run, oldest first."""
        done = 0
        while done < len(self.pending) and self._done(self.pending[done][2]):
            record, start, end = self.pending[done]
            record["gpu_ms"] = self._ms(start, end)
            record["gap_ms"] = 0.0 if self.prev_end is None else max(
                0.0, self._ms(self.prev_end, start))
            if self.cuda:  # both have run (start precedes end): free to be recorded again
                self.free += [start] if self.prev_end is None else [start, self.prev_end]
            self.prev_end = end
            self._write(record)
            done += 1
        del self.pending[:done]

    def _done(self, mark: Any) -> bool:
        return not self.cuda or mark.query()

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if len(self.records) >= KEEP:
            self._encode()

    def _encode(self) -> None:
        self.out.write("".join(json.dumps(r) + "\n" for r in self.records))
        self.records = []


def _gc_hook(tracer: weakref.ref[Tracer]) -> Callable[[str, dict[str, int]], None]:
    """A gc callback that times collections into the tracer while it lives (a weak reference:
    the hook alone never keeps a tracer and its file alive)."""

    def hook(phase: str, info: dict[str, int]) -> None:
        t = tracer()
        if t is not None:
            t._on_gc(phase, info)

    return hook
