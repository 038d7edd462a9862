"""The worker's round trace (managers/round_trace.py): device items are timed off the busy
loop, in order, every one of them, and read back by benchmarks/trace_summary.py."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch

from benchmarks.trace_summary import read_trace, summarize
from dllm_serve.managers import round_trace
from dllm_serve.managers.round_trace import Tracer


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_items_are_timed_in_batches_and_all_written_on_settle(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """With PENDING = 3 the tracer times items three at a time while busy (none in between),
    and settle() writes the rest; every item keeps its kind, rows and order, its device time
    covers its work and no gap is negative."""
    monkeypatch.setattr(round_trace, "PENDING", 3)
    path = tmp_path / "trace.jsonl"
    tracer = Tracer(str(path), torch.device("cpu"), {"cuda_graphs": False})
    # the header is on disk before any settle (benchmarks read it once the engine is up)
    assert records(path) == [{"kind": "worker", "t0": records(path)[0]["t0"],
                              "t1": records(path)[0]["t0"], "cuda_graphs": False}]
    pending = []
    for i in range(8):
        assert tracer.run("denoise" if i % 4 else "prefill", lambda: time.sleep(0.002),
                          rows=i) is None
        pending.append(len(tracer.pending))
    assert pending == [1, 2, 0, 1, 2, 0, 1, 2]  # timed when three wait, not per item
    tracer.host(0.0, 1.0, 0.1, [0.2, 0.3, 0.4])
    tracer.settle()
    out = records(path)
    assert out[0]["kind"] == "worker"
    items = [r for r in out if r["kind"] in ("prefill", "denoise")]
    assert [r["rows"] for r in items] == list(range(8))
    assert [r["kind"] for r in items] == ["prefill", "denoise", "denoise", "denoise"] * 2
    assert all(r["gpu_ms"] >= 2.0 and r["gap_ms"] >= 0.0 for r in items)
    assert items[0]["gap_ms"] == 0.0
    host = [r for r in out if r["kind"] == "host"]
    assert host == [{"kind": "host", "t0": 0.0, "t1": 1.0, "wait_ms": 100.0,
                     "phases_ms": [200.0, 300.0, 400.0]}]
    summary = summarize(read_trace(str(path), 0.0, time.monotonic()))
    assert (summary["forwards"], summary["prefills"]) == (6, 2)
    assert summary["busy_fraction"] + summary["idle_fraction"] == pytest.approx(1.0)
    assert summary["rows_mean"] == pytest.approx(sum(r["rows"] for r in items
                                                     if r["kind"] == "denoise") / 6)


def test_an_item_records_the_threads_cpu_time_of_its_launch(tmp_path: Path) -> None:
    """cpu_ms is the worker thread's CPU time over the launch: a launch that sleeps has next
    to none of its host time as CPU time, one that computes has all of it (3 ms of CPU time
    spent at least, and never more than the launch's wall time)."""
    path = tmp_path / "trace.jsonl"
    tracer = Tracer(str(path), torch.device("cpu"), {})

    def compute() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.003:
            pass

    tracer.run("prefill", lambda: time.sleep(0.02), rows=1)
    tracer.run("denoise", compute, rows=2)
    tracer.settle()
    sleeping, computing = read_trace(str(path), 0.0, time.monotonic())
    assert 1e3 * (sleeping["t1"] - sleeping["t0"]) >= 20.0
    assert 0.0 <= sleeping["cpu_ms"] < 10.0
    assert 3.0 <= computing["cpu_ms"] <= 1e3 * (computing["t1"] - computing["t0"]) + 0.01


def test_collections_are_traced_while_the_tracer_lives(tmp_path: Path) -> None:
    """A collection of the cyclic GC is one "gc" record (generation, interval, objects
    collected) that summarize counts; a tracer that is gone records nothing (its hook holds
    it weakly)."""
    path = tmp_path / "trace.jsonl"
    tracer = Tracer(str(path), torch.device("cpu"), {})
    tracer.run("denoise", lambda: None, rows=1)
    t0 = time.monotonic()
    gc.collect()
    tracer.settle()
    pauses = read_trace(str(path), t0, time.monotonic(), kinds=("gc",))
    assert [r["gen"] for r in pauses] == [2]
    assert pauses[0]["t1"] >= pauses[0]["t0"] >= t0 and pauses[0]["collected"] >= 0
    summary = summarize(read_trace(str(path), 0.0, time.monotonic()))
    assert summary["gc_collections"] == 1
    assert summary["gc_pause_ms_max"] == pytest.approx(
        1e3 * (pauses[0]["t1"] - pauses[0]["t0"]))
    del tracer
    gc.collect()  # the tracer itself is gone before this collection
    assert sum(r["kind"] == "gc" for r in records(path)) == 1



class ClockEvent:
    """A timing CUDA event on a fake device clock (each record reads the next tick)."""

    made = 0
    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        ClockEvent.made += 1
        self.t: float | None = None

    def record(self, stream: object = None) -> None:
        ClockEvent.clock += 1.0
        self.t = ClockEvent.clock

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: ClockEvent) -> float:
        assert self.t is not None and end.t is not None
        return end.t - self.t


def test_timing_events_are_recorded_again_once_their_items_are_timed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the tracer takes its events from a pool: 100 items timed three at a time make
    a handful of events, not two per item, and every item's device time and gap are still
    read from its own two events (a fake device clock: one tick per record)."""
    monkeypatch.setattr(round_trace, "PENDING", 3)
    monkeypatch.setattr(torch.cuda, "Event", ClockEvent)
    ClockEvent.made, ClockEvent.clock = 0, 0.0
    path = tmp_path / "trace.jsonl"
    tracer = Tracer(str(path), torch.device("cpu"), {})
    tracer.cuda = True  # the CUDA path, on the fake events
    for i in range(100):
        tracer.run("denoise", lambda: None, rows=i)
    tracer._flush()
    tracer._encode()
    tracer.out.flush()
    items = [r for r in records(path) if r["kind"] == "denoise"]
    assert [r["rows"] for r in items] == list(range(100))
    # item i's events are ticks 2i + 1 and 2i + 2: 1 tick of work, 1 tick after the last item
    assert all(r["gpu_ms"] == 1.0 for r in items)
    assert [r["gap_ms"] for r in items] == [0.0] + [1.0] * 99
    assert ClockEvent.made <= 2 * 3 + 2
