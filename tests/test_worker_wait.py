"""The idle worker's wait (managers/worker_main.wait): with a round trace, the trace is written
out (settled) only when no message comes within SETTLE_AFTER_MS, so a request that arrives at
once is taken without the trace's encoding in front of it."""

from __future__ import annotations

from types import SimpleNamespace

from dllm_serve.managers import worker_main


class FakeRx:
    def __init__(self, queued: list[object], late: object) -> None:
        self.queued, self.late = queued, late
        self.calls: list[int | None] = []

    def recv(self, timeout_ms: int | None = None) -> object | None:
        self.calls.append(timeout_ms)
        if self.queued:
            return self.queued.pop(0)
        return None if timeout_ms is not None else self.late


class FakeTracer:
    def __init__(self) -> None:
        self.settled = 0

    def settle(self) -> None:
        self.settled += 1


def test_a_message_within_the_window_is_taken_without_settling() -> None:
    tracer = FakeTracer()
    rx = FakeRx(["batch"], late="never")
    assert worker_main.wait(SimpleNamespace(tracer=tracer), rx) == "batch"  # type: ignore[arg-type]
    assert tracer.settled == 0 and rx.calls == [worker_main.SETTLE_AFTER_MS]


def test_a_quiet_window_settles_the_trace_then_waits() -> None:
    tracer = FakeTracer()
    rx = FakeRx([], late="batch")
    assert worker_main.wait(SimpleNamespace(tracer=tracer), rx) == "batch"  # type: ignore[arg-type]
    assert tracer.settled == 1 and rx.calls == [worker_main.SETTLE_AFTER_MS, None]


def test_without_a_trace_the_worker_just_waits() -> None:
    rx = FakeRx([], late="batch")
    assert worker_main.wait(SimpleNamespace(tracer=None), rx) == "batch"  # type: ignore[arg-type]
    assert rx.calls == [None]
