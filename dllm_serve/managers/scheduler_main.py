"""The scheduler process: wait for the worker, then loop without ever blocking on it.

    loop: recv (front: up to FRONT_BATCH messages; worker) -> handle requests / reports ->
          admit -> send changes to the worker and outputs to the front
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import traceback
from typing import Any

import zmq

from dllm_serve.engine_config import SchedulerProcConfig
from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.ipc import Addresses, Receiver, Sender
from dllm_serve.managers.messages import (
    BatchOutput,
    Fatal,
    Ready,
    ReqOutput,
    Shutdown,
    WorkerBatch,
    WorkerFailed,
    WorkerReady,
    WorkerReport,
    one_line,
)
from dllm_serve.managers.procs import (
    die_with_parent,
    freeze_startup_objects,
    profiled,
    setup_logging,
    warn_long_gc,
)
from dllm_serve.managers.scheduler import Scheduler
from dllm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PROFILE_ENV = "DLLM_SERVE_PROFILE_SCHEDULER"  # a cProfile of the event loop (procs.profiled)
STRICT_MEM_CHECK = os.environ.get("DLLM_SERVE_STRICT_MEM_CHECK", "0") == "1"
IDLE_WAIT_MS = 200
BUSY_WAIT_MS = 20
# on the engine's Shutdown the scheduler forwards it to the worker and waits at most this long
# for it to leave (the sockets drop what is unsent at exit otherwise: LINGER 0)
SHUTDOWN_LINGER_MS = 1000
# front messages handled per loop iteration: a burst of requests (thousands submitted at once,
# each tens of microseconds to decode and queue) is taken in turns with the worker's reports,
# so the device is not left without blocks while the scheduler reads the burst (on an H200
# the built-in model's held-out run stalled 100-170 ms at its start)
FRONT_BATCH = 32


class WorkerCrashed(RuntimeError):
    """The worker failed; `reason` one line (the worker logged its traceback)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def run_scheduler_process(cfg: SchedulerProcConfig, addrs: Addresses) -> None:
    setup_logging(cfg.log_level)
    warn_long_gc(cfg.gc_warning_s)
    die_with_parent(addrs.remove)  # a parent killed outright leaves no sockets behind
    ctx = zmq.Context()
    front_in, front_out = Receiver(ctx, addrs.to_scheduler), Sender(ctx, addrs.to_front)
    worker_in, worker_out = Receiver(ctx, addrs.from_worker), Sender(ctx, addrs.to_worker)
    try:
        ready = check_worker(worker_in.recv())
        scheduler = build_scheduler(cfg, ready)
        # no full collection scans the startup's objects; torch is never imported here (the
        # scheduler's modules and configs are torch-free: its memory and startup are its own)
        startup = {**ready.info.get("startup", {}), "scheduler_gc_frozen": freeze_startup_objects(),
                   "scheduler_torch_loaded": "torch" in sys.modules}
        front_out.send(Ready({**scheduler.server_info(), **ready.info, "startup": startup}))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the engine's stop: unwind
        profiled(PROFILE_ENV, event_loop, scheduler, front_in, worker_in, front_out, worker_out)
        worker_out.send(Shutdown())
        ctx.destroy(linger=SHUTDOWN_LINGER_MS)  # the worker's Shutdown leaves before we exit
    except WorkerCrashed as e:  # its traceback is in the worker's log: not twice
        logger.error("the worker failed: %s", e.reason)
        front_out.send(Fatal(str(e), e.reason))
        sys.exit(1)
    except Exception as e:
        logger.exception("scheduler failed")
        front_out.send(Fatal(traceback.format_exc(), one_line(e)))
        sys.exit(1)


def event_loop(scheduler: Scheduler, front_in: Receiver, worker_in: Receiver,
               front_out: Sender, worker_out: Sender) -> None:
    poller = zmq.Poller()
    poller.register(front_in.sock, zmq.POLLIN)
    poller.register(worker_in.sock, zmq.POLLIN)
    was_idle = False
    while True:
        poller.poll(IDLE_WAIT_MS if scheduler.idle else BUSY_WAIT_MS)
        for msg in front_in.drain(FRONT_BATCH):
            if isinstance(msg, Shutdown):
                return
            scheduler.handle(msg)
        for msg in worker_in.drain():
            scheduler.on_report(check_worker(msg))
        scheduler.schedule()
        if items := scheduler.take_worker_items():
            worker_out.send(WorkerBatch(items))
        send_outputs(front_out, scheduler.take_outputs())
        if scheduler.idle and not was_idle:
            idle_check(scheduler)
        was_idle = scheduler.idle


def check_worker(msg: Any) -> Any:
    if isinstance(msg, WorkerFailed):
        raise WorkerCrashed(f"worker failed:\n{msg.message}", msg.reason or "the worker failed")
    if not isinstance(msg, WorkerReady | WorkerReport):
        raise TypeError(f"scheduler got an unexpected worker message {type(msg).__name__}")
    return msg


def send_outputs(tx: Sender, outputs: list[Any]) -> None:
    reqs = [o for o in outputs if isinstance(o, ReqOutput)]
    if reqs:
        tx.send(BatchOutput(reqs))
    for other in outputs:
        if not isinstance(other, ReqOutput):
            tx.send(other)


def idle_check(scheduler: Scheduler) -> None:
    try:
        scheduler.check_integrity()
    except RuntimeError:
        logger.exception("KV pool memory leak detected")
        if STRICT_MEM_CHECK:
            raise


def build_scheduler(cfg: SchedulerProcConfig, ready: WorkerReady) -> Scheduler:
    config = dataclasses.replace(cfg.scheduler, num_pages=ready.num_pages,
                                 page_size=ready.page_size)
    tokenizer = Tokenizer.load(cfg.tokenizer_path)
    return Scheduler(config, FinishChecker(set(cfg.eos_ids), tokenizer.decode))
