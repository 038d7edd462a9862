"""Start the scheduler and worker processes and wait until they are ready."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from dllm_serve.engine_config import EngineConfig
from dllm_serve.errors import EngineDeadError
from dllm_serve.managers.ipc import Addresses, Receiver
from dllm_serve.managers.messages import Fatal, Ready
from dllm_serve.managers.procs import ProcessSet, spawn

logger = logging.getLogger(__name__)
DEAD_GRACE_MS = 1000  # a child found dead: how long its Fatal may take to arrive


def launch(config: EngineConfig, ctx: zmq.Context, cancel: threading.Event | None = None,
           ) -> tuple[ProcessSet, Receiver, dict[str, Any]]:
    """Spawn both children; return them, the front's receiving channel and the ready info.

    Raises EngineDeadError (with the failing child's reason when there is one) if a child dies
    or fails during startup, if startup takes longer than args.startup_timeout, or once
    `cancel` is set (Ctrl-C while the model loads); the children are stopped first.
    """
    addrs = Addresses.fresh()
    rx = Receiver(ctx, addrs.to_front)
    procs: ProcessSet | None = None
    try:
        procs = ProcessSet(addrs, spawn({
            "scheduler": ("dllm_serve.managers.scheduler_main:run_scheduler_process",
                          (config.scheduler(), addrs)),
            "worker": ("dllm_serve.managers.worker_main:run_worker_process", (config, addrs)),
        }))
        return procs, rx, wait_ready(procs, rx, config.args.startup_timeout, cancel)
    except BaseException:  # a spawn that failed too (e.g. a script without a __main__ guard)
        if procs is not None:
            procs.kill()  # which removes the sockets' folder
        else:
            addrs.remove()
        rx.sock.close()
        raise


def wait_ready(procs: ProcessSet, rx: Receiver, timeout: float,
               cancel: threading.Event | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cancel is not None and cancel.is_set():
            raise EngineDeadError("engine startup cancelled")
        msg = rx.recv(timeout_ms=100)
        if isinstance(msg, Ready):
            return msg.info
        if isinstance(msg, Fatal):
            raise EngineDeadError(f"engine failed to start: {msg.reason or msg.message}")
        if (dead := procs.dead()) is not None:  # its Fatal may still be on its way: the reason
            late = rx.recv(timeout_ms=DEAD_GRACE_MS)
            reason = late.reason or late.message if isinstance(late, Fatal) else dead
            raise EngineDeadError(f"engine failed to start: {reason}")
    raise EngineDeadError(f"engine did not start within {timeout:g} s")
