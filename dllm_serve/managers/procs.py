"""Process plumbing: spawn the scheduler and worker, watch the parent, tear everything down.

The engine's stop: the front sends Shutdown (the scheduler forwards it to the worker, which
writes out what it holds), waits up to a grace period for the children to exit by themselves,
then SIGTERMs and at last SIGKILLs those still running (`ProcessSet.kill`). A child leaves with
os._exit once its loop is over (`_child_main`): no interpreter teardown of its frozen startup
objects."""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dllm_serve.managers.ipc import Addresses

logger = logging.getLogger(__name__)


@dataclass
class ProcessSet:
    addrs: Addresses
    procs: dict[str, mp.process.BaseProcess]

    def dead(self) -> str | None:
        """Name and exit code of the first child that exited, or None."""
        for name, p in self.procs.items():
            if p.exitcode is not None:
                return f"the {name} process exited with code {p.exitcode}"
        return None

    def _join(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.pid is not None]

    def kill(self, timeout: float = 5.0, grace: float = 0.0) -> None:
        """Stop every child and remove the ipc folder: first `grace` s for the children to exit
        by themselves (the engine's stop sends them Shutdown first: the worker then writes out
        what it holds, a trace among it), then SIGTERM, then SIGKILL after `timeout` s.
        SIGTERM alone is not enough: a child turns it into SystemExit, which Python swallows
        when it lands in a __del__ or a gc callback, and that child then runs on until killed."""
        self._join(grace)
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
        self._join(timeout)
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        self.addrs.remove()


def spawn(targets: dict[str, tuple[str, tuple[Any, ...]]]) -> dict[str, mp.process.BaseProcess]:
    """One child per `name: ("package.module:function", args)`. The entry point is named, not
    passed: the child imports its module, the parent never does (the front stays without
    torch and Triton, which the scheduler and the worker import)."""
    ctx = mp.get_context("spawn")
    procs = {}
    for name, (entry, args) in targets.items():
        p = ctx.Process(target=_child_main, args=(entry, args), name=f"dllm-serve-{name}",
                        daemon=True)
        p.start()
        procs[name] = p
    return procs


def _child_main(entry: str, args: tuple[Any, ...]) -> None:
    """Run `entry` ("package.module:function") with args. A child ignores SIGINT: Ctrl-C in a
    terminal reaches the whole process group, and it is the parent that decides how to stop
    (drain, then shut the children down). When it is over
    (returned, SystemExit, or failed: its traceback printed) the child flushes its logs and
    leaves with os._exit, without the interpreter's teardown: the children's loops write out
    what they hold before they return (the worker's trace), and tearing down the startup's
    objects (frozen: `freeze_startup_objects`) cost ~0.5 s a stop or, left frozen, had nanobind
    print its "leaked" warnings for Triton's objects."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 1
    try:
        module, function = entry.split(":")
        getattr(importlib.import_module(module), function)(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def die_with_parent(on_orphan: Callable[[], None] | None = None, poll_s: float = 0.5) -> None:
    """In a child: exit at once when the parent process is gone (no orphans), after
    `on_orphan` (removing what the parent would have: the sockets' folder)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if on_orphan is not None:
            on_orphan()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def profiled(env: str, fn: Callable[..., None], *args: Any) -> None:
    """fn(*args), under cProfile when $env names a path prefix: the stats go to PREFIX.<pid>
    when fn returns or raises (SIGTERM included, where the process turns it into SystemExit).
    A developer's view of a process loop's host time."""
    prefix = os.environ.get(env)
    if not prefix:
        fn(*args)
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(fn, *args)
    finally:
        prof.dump_stats(f"{prefix}.{os.getpid()}")


def freeze_startup_objects() -> int:
    """Collect once, then move every object made while starting (modules, torch, the model,
    the tokenizer: 170-310k objects) out of the cyclic collector's reach (`gc.freeze`); returns
    how many. A full collection otherwise scans them all, and serving triggers one whenever
    enough new objects survive (a burst of queued requests): a pause of 70-160 ms of the
    scheduler or the worker on a 2-core CPU (the device idles once the worker's blocks run
    out). Frozen objects are never collected while serving: call it once, when startup is
    over. At exit they are handed back (`gc.unfreeze`), so the interpreter's shutdown frees
    them as usual: left frozen, Triton's native objects among them outlive it, and nanobind
    then prints ~30 lines of "leaked" warnings at every stop of a process that imported Triton
    (the engine's children leave without the teardown: `_child_main`)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # (registering again is harmless: unfreeze is idempotent)
    return gc.get_freeze_count()


def warn_long_gc(threshold_s: float) -> None:
    """Log a warning for every cyclic garbage collection that pauses this process longer than
    threshold_s seconds (0: do nothing): --gc-warning-threshold-secs."""
    if threshold_s <= 0:
        return
    started = [0.0]

    def hook(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (paused := time.perf_counter() - started[0]) > threshold_s:
            logger.warning("a garbage collection paused this process %.3f s (generation %d, "
                           "%d objects collected)", paused, info["generation"],
                           info["collected"])

    gc.callbacks.append(hook)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the front submits a batch (Engine.generate,
    async_generate, an HTTP request's prompts and choices), back on (if it was on) after.
    Submitting thousands of prompts in one call allocates enough to start a full collection of
    the front's process (torch imported: 150-200 ms on a 2-core CPU, in 1-2 of 3 submissions
    of 4,096 prompts), while the scheduler has only the requests sent so far and the device
    may run out of blocks. Deferred, the collection runs once every request is queued."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s")
