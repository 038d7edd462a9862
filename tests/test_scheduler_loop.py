"""The scheduler process's event loop over real ZMQ channels, with a stand-in scheduler."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq

from dllm_serve.managers.ipc import Addresses, Receiver, Sender
from dllm_serve.managers.messages import InfoReq, Shutdown, WorkerReport
from dllm_serve.managers.scheduler_main import FRONT_BATCH, event_loop


class Recorder:
    """A scheduler that records what the loop hands it, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.idle = False

    def handle(self, msg: Any) -> None:
        self.events.append("front")

    def on_report(self, report: WorkerReport) -> None:
        self.events.append("report")

    def schedule(self) -> None:
        pass

    def take_worker_items(self) -> list[Any]:
        return []

    def take_outputs(self) -> list[Any]:
        return []

    def check_integrity(self) -> None:
        pass


def test_drain_takes_at_most_its_limit_in_order() -> None:
    ctx = zmq.Context()
    addrs = Addresses.fresh()
    rx, tx = Receiver(ctx, addrs.to_scheduler), Sender(ctx, addrs.to_scheduler)
    for i in range(10):
        tx.send(InfoReq(req_id=i))
    assert rx.recv(timeout_ms=5000) is not None  # the channel is up (InfoReq 0)
    got = rx.drain(4)
    assert [m.req_id for m in got] == [1, 2, 3, 4]
    while len(got) < 9:
        got += rx.drain()
    assert [m.req_id for m in got] == list(range(1, 10))
    ctx.destroy(linger=0)
    folder = Path(addrs.to_scheduler[len("ipc://"):]).parent
    assert folder.is_dir()
    addrs.remove()
    assert not folder.exists()  # the sockets' folder goes with them


def test_a_burst_of_requests_does_not_hold_back_the_workers_report() -> None:
    """Thousands of requests submitted at once are read FRONT_BATCH at a time, between which
    the worker's reports are taken: the device is not left waiting for the whole burst."""
    ctx = zmq.Context()
    addrs = Addresses.fresh()
    front_in, worker_in = Receiver(ctx, addrs.to_scheduler), Receiver(ctx, addrs.from_worker)
    front_out, worker_out = Sender(ctx, addrs.to_front), Sender(ctx, addrs.to_worker)
    to_sched, from_worker = Sender(ctx, addrs.to_scheduler), Sender(ctx, addrs.from_worker)
    front_rx, worker_rx = Receiver(ctx, addrs.to_front), Receiver(ctx, addrs.to_worker)
    burst = 10 * FRONT_BATCH
    for i in range(burst):
        to_sched.send(InfoReq(req_id=i))
    from_worker.send(WorkerReport(forwards=1))
    to_sched.send(Shutdown())
    for rx in (front_in, worker_in):  # everything queued before the loop starts
        assert rx.sock.poll(5000)
    time.sleep(0.2)
    scheduler = Recorder()
    event_loop(scheduler, front_in, worker_in, front_out, worker_out)  # type: ignore[arg-type]
    assert scheduler.events.count("front") == burst
    assert scheduler.events.index("report") <= FRONT_BATCH
    del front_rx, worker_rx
    ctx.destroy(linger=0)
    addrs.remove()
