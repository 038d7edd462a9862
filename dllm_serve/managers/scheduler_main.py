"""The scheduler process: wait for the worker, then recv -> schedule -> run -> send, forever."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

import zmq

from dllm_serve.dllm.config import DllmConfig, arch_defaults
from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.ipc import Addresses, Receiver, Sender
from dllm_serve.managers.messages import (
    BatchOutput,
    Fatal,
    Ready,
    ReqOutput,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)
from dllm_serve.managers.procs import die_with_parent, setup_logging
from dllm_serve.managers.scheduler import Result, Scheduler, SchedulerConfig, Work
from dllm_serve.model.config import ModelConfig
from dllm_serve.server_args import ServerArgs
from dllm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STRICT_MEM_CHECK = os.environ.get("DLLM_SERVE_STRICT_MEM_CHECK", "0") == "1"


class WorkerCrashed(RuntimeError):
    pass


class WorkerClient:
    """The scheduler's handle on the worker process: send work, wait for its result."""

    def __init__(self, ctx: zmq.Context, addrs: Addresses) -> None:
        self.tx = Sender(ctx, addrs.to_worker)
        self.rx = Receiver(ctx, addrs.from_worker)

    def recv(self) -> Any:
        msg = self.rx.recv()
        if isinstance(msg, WorkerFailed):
            raise WorkerCrashed(f"worker failed:\n{msg.message}")
        return msg

    def run(self, work: Work) -> Result:
        self.tx.send(work)
        return self.recv()


def run_scheduler_process(args: ServerArgs, addrs: Addresses) -> None:
    setup_logging(args.log_level)
    die_with_parent()
    ctx = zmq.Context()
    front_in, front_out = Receiver(ctx, addrs.to_scheduler), Sender(ctx, addrs.to_front)
    worker = WorkerClient(ctx, addrs)
    try:
        scheduler = build_scheduler(args, worker, worker.recv())
        front_out.send(Ready(scheduler.server_info()))
        event_loop(scheduler, front_in, front_out)
        worker.tx.send(Shutdown())
    except Exception:
        logger.exception("scheduler failed")
        front_out.send(Fatal(traceback.format_exc()))
        sys.exit(1)


def event_loop(scheduler: Scheduler, front_in: Receiver, front_out: Sender) -> None:
    was_idle = False
    while True:
        for msg in receive(front_in, wait_ms=200 if scheduler.idle else 0):
            if isinstance(msg, Shutdown):
                return
            scheduler.handle(msg)
        scheduler.step()
        send_outputs(front_out, scheduler.take_outputs())
        if scheduler.idle and not was_idle:
            idle_check(scheduler)
        was_idle = scheduler.idle


def receive(rx: Receiver, wait_ms: int) -> list[Any]:
    first = rx.recv(timeout_ms=wait_ms)
    return [] if first is None else [first, *rx.drain()]


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


def build_scheduler(args: ServerArgs, worker: WorkerClient, ready: WorkerReady) -> Scheduler:
    model_config = ModelConfig.load(args.model_path)  # type: ignore[arg-type]
    dllm = DllmConfig.build(model_config, args.dllm_algorithm, args.dllm_algorithm_config,
                            args.dllm_fdfo)
    tokenizer = Tokenizer.load(args.tokenizer_path or args.model_path)
    config = SchedulerConfig(
        block_size=dllm.block_size, mask_id=dllm.mask_id, fdfo=dllm.fdfo,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        chunked_prefill_size=args.chunked_prefill_size, num_pages=ready.num_pages,
        page_size=ready.page_size, random_seed=args.random_seed,
        wavefront_size=args.dllm_wavefront_size)
    eos = stop_token_ids(model_config, tokenizer)
    return Scheduler(config, worker, FinishChecker(eos, tokenizer.decode))


def stop_token_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """EOS ids: config.json / generation_config.json, else the architecture's; plus the
    tokenizer's end-of-turn tokens."""
    ids = set(model_config.eos_token_ids())
    if not ids:
        ids.add(arch_defaults(model_config.architecture).eos_id)
    return ids | set(tokenizer.extra_stop_token_ids)
