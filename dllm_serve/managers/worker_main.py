"""The worker process: load the model, report the KV capacity, then run work until told to stop."""

from __future__ import annotations

import logging
import sys
import traceback

import zmq

from dllm_serve.dllm.algorithms import RoundMode, build_algorithm
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.dllm.wavefront import WavefrontConfig
from dllm_serve.managers.ipc import Addresses, Receiver, Sender
from dllm_serve.managers.messages import Shutdown, WorkerFailed, WorkerReady
from dllm_serve.managers.procs import die_with_parent, setup_logging
from dllm_serve.managers.round_trace import traced
from dllm_serve.managers.worker import Worker
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.runner import ModelRunner
from dllm_serve.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_worker_process(args: ServerArgs, addrs: Addresses) -> None:
    setup_logging(args.log_level)
    die_with_parent()
    ctx = zmq.Context()
    rx, tx = Receiver(ctx, addrs.to_worker), Sender(ctx, addrs.from_worker)
    try:
        worker = build_worker(args)
        run = traced(worker.run, worker.runner)  # timed when DLLM_SERVE_ROUND_TRACE is set
        tx.send(WorkerReady(worker.runner.num_pages, worker.runner.page_size))
        while not isinstance(work := rx.recv(), Shutdown):
            tx.send(run(work))
    except Exception:
        logger.exception("worker failed")
        tx.send(WorkerFailed(traceback.format_exc()))
        sys.exit(1)


def build_worker(args: ServerArgs) -> Worker:
    model_config = ModelConfig.load(args.model_path)  # type: ignore[arg-type]
    dllm = DllmConfig.build(model_config, args.dllm_algorithm, args.dllm_algorithm_config,
                            args.dllm_fdfo)
    return Worker(ModelRunner(model_config, dllm, args), build_algorithm(dllm), round_mode(args))


def round_mode(args: ServerArgs) -> RoundMode:
    wavefront = WavefrontConfig(args.dllm_wavefront_size, args.dllm_spawn_threshold,
                                args.dllm_spawn_token_threshold, args.dllm_wavefront_lockstep)
    return RoundMode(fdfo=args.dllm_fdfo, wavefront=wavefront)
