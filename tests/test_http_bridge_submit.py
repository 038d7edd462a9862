"""The HTTP front submits an HTTP request's choices with Python's cyclic collector paused (a
full collection of the front's process midway through a batch left the scheduler without the
rest), back on after, also when a submission fails (then every submitted choice is aborted)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dllm_serve.http.bridge import Choice, Generation
from dllm_serve.sampling_params import SamplingParams


class FakeFront:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.collector_on, self.aborted = fail_at, [], []

    def validate(self, ids, params) -> None:  # noqa: ANN001
        pass

    def submit(self, ids, params, callback, rid) -> str:  # noqa: ANN001
        if len(self.collector_on) == self.fail_at:
            raise RuntimeError("engine gone")
        self.collector_on.append(gc.isenabled())
        return rid

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def choices(n: int) -> list[Choice]:
    return [Choice([1, 2, 3], SamplingParams(max_new_tokens=4), f"r{i}") for i in range(n)]


def test_choices_are_submitted_with_the_collector_paused() -> None:
    front = FakeFront()

    async def run() -> None:
        Generation(front, choices(5))  # type: ignore[arg-type]

    asyncio.run(run())
    assert front.collector_on == [False] * 5 and gc.isenabled() and front.aborted == []


def test_a_failed_submission_turns_the_collector_back_on_and_aborts_the_rest() -> None:
    front = FakeFront(fail_at=3)

    async def run() -> None:
        Generation(front, choices(5))  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(run())
    assert front.collector_on == [False] * 3 and gc.isenabled()
    assert front.aborted == ["r0", "r1", "r2"]
