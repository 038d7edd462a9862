"""The worker process: load the model, report the KV capacity, then run the forward loop.

    loop: take the scheduler's changes (waiting only when the device has nothing) -> one
          iteration (launch, read back, retire / open) -> send the report, if any
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import traceback
from typing import Any

import torch
import zmq

from dllm_serve.dllm.algorithms import build_algorithm
from dllm_serve.engine_config import EngineConfig, WorkerConfig
from dllm_serve.kernels.compile_watch import CompileWatch
from dllm_serve.managers.ipc import Addresses, Receiver, Sender
from dllm_serve.managers.messages import (
    Shutdown,
    WorkerBatch,
    WorkerFailed,
    WorkerReady,
    WorkItem,
    one_line,
)
from dllm_serve.managers.procs import (
    die_with_parent,
    freeze_startup_objects,
    profiled,
    setup_logging,
    warn_long_gc,
)
from dllm_serve.managers.round_trace import Tracer
from dllm_serve.managers.worker import Worker
from dllm_serve.model.runner import ModelRunner

logger = logging.getLogger(__name__)
PROFILE_ENV = "DLLM_SERVE_PROFILE_WORKER"  # a cProfile of the loop (procs.profiled)
# an idle worker with a trace writes it out (Tracer.settle: JSON encoding, ~0.7 ms on an H200's
# host) only once no message came for this long: a closed-loop client's next request, a few
# hundred microseconds after the last answer, finds the worker listening instead of encoding
SETTLE_AFTER_MS = 5


def run_worker_process(config: EngineConfig, addrs: Addresses) -> None:
    """The worker's entry (managers/launch.py). Its config is resolved here, not in the front:
    the device ("auto": torch.cuda.is_available()) and what follows from it need torch, which
    only the scheduler and the worker import."""
    cfg = config.worker()
    setup_logging(cfg.log_level)
    warn_long_gc(cfg.gc_warning_s)
    die_with_parent(addrs.remove)  # a parent killed outright leaves no sockets behind
    ctx = zmq.Context()
    rx, tx = Receiver(ctx, addrs.to_worker), Sender(ctx, addrs.from_worker)
    try:
        start = time.monotonic()
        worker = build_worker(cfg)
        frozen = freeze_startup_objects()  # no full collection scans the startup's objects
        info = {**startup_info(worker, time.monotonic() - start), "worker_gc_frozen": frozen}
        logger.info("worker ready in %.1f s (warm-up and capture %.1f s of it)",
                    info["worker_s"], info["warmup_s"])
        CompileWatch(worker.compiled).start()  # from here on a compile is a stall: named
        tx.send(WorkerReady(worker.runner.num_pages, worker.runner.page_size,
                            {"startup": info}))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the engine's stop: unwind
        try:
            with torch.inference_mode():  # once, not per iteration (Worker.iterate)
                profiled(PROFILE_ENV, loop, worker, rx, tx)
        finally:  # a shutdown or the engine's stop: whatever the trace holds goes to its file
            if worker.tracer is not None:
                worker.tracer.settle()
    except Exception as e:
        logger.exception("worker failed")
        tx.send(WorkerFailed(traceback.format_exc(), one_line(e)))
        sys.exit(1)


def loop(worker: Worker, rx: Receiver, tx: Sender) -> None:
    while True:
        msgs = [wait(worker, rx)] if worker.idle else []
        t0 = time.monotonic()
        items = unpack([*msgs, *rx.drain()])
        if items is None:
            return
        report = worker.iterate(items)
        if report is not None:
            tx.send(report)
        t1 = time.monotonic()
        wait_s, phase_s = worker.take_host_split()
        if worker.tracer is not None and not worker.idle:
            worker.tracer.host(t0, t1, wait_s, phase_s)


def wait(worker: Worker, rx: Receiver) -> object:
    """The next message for an idle worker; with a trace, the trace is settled (written out)
    first if none comes within SETTLE_AFTER_MS."""
    if worker.tracer is None:
        return rx.recv()
    msg = rx.recv(SETTLE_AFTER_MS)
    if msg is None:
        worker.tracer.settle()
        msg = rx.recv()
    return msg


def unpack(msgs: list[object]) -> list[WorkItem] | None:
    """The items of the scheduler's batches, in order; None on Shutdown."""
    items: list[WorkItem] = []
    for msg in msgs:
        if isinstance(msg, Shutdown):
            return None
        if not isinstance(msg, WorkerBatch):
            raise TypeError(f"worker got an unexpected message {type(msg).__name__}")
        items.extend(msg.items)
    return items


def build_worker(cfg: WorkerConfig) -> Worker:
    runner = ModelRunner(cfg.runner)
    worker = Worker(runner, build_algorithm(cfg.dllm), cfg.mode,  # warms up, captures
                    max_prefill_tokens=cfg.runner.chunked_prefill_size, depth=cfg.depth,
                    multi_step=cfg.multi_step)
    graphs = runner.graphs
    captured = [] if graphs is None else [b for b in graphs.buckets
                                          if graphs.forwards[b].graph is not None]
    worker.tracer = Tracer.from_env(runner.device, {"cuda_graphs": bool(captured),
                                                    "graph_buckets": captured})
    return worker


def startup_info(worker: Worker, seconds: float) -> dict[str, Any]:
    """How long the worker took to start, and the buckets its warm-up compiled."""
    runner = worker.runner
    pre, den = runner.prefill_graphs, runner.graphs
    return {"worker_s": seconds, "warmup_s": runner.warmup_s,
            "prefill_buckets": [] if pre is None else [b * runner.block_size
                                                       for b in pre.buckets],
            "denoise_buckets": [] if den is None else den.buckets,
            "cuda_graphs": den is not None and den.captured}
