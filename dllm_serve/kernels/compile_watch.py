"""Triton compiles after startup: counted, timed and logged, never silent.

The worker's warm-up compiles every kernel specialization the scheduler can ask for
(model/buckets.py, model/cuda_graph.py); a compile after "ready" stalls every request of the
batch for seconds. `CompileWatch`, started by the worker just before it reports ready, hooks
Triton's JIT (`triton.knobs.runtime`: `jit_cache_hook` runs before a compile,
`jit_post_compile_hook` after it) and calls `on_compile(kernel, seconds)` for each later compile:
the worker logs it and counts it in /metrics (`dllm:kernel_compiles_after_ready`), so a gap in
the warm-up shows by name instead of as an unexplained stall. Hooks installed before the watch
still run (the watch calls them first and passes their answer on); `stop` puts them back.

Nothing compiles under the interpreter (TRITON_INTERPRET=1) or without Triton: the watch then
never fires. A Triton without `knobs` (older releases) cannot be watched: `start` logs so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

OnCompile = Callable[[str, float], None]  # (the kernel's signature as Triton prints it, seconds)


class CompileWatch:
    """Invariant while started: Triton's two JIT hooks are this watch's, each calling the hook
    it replaced first; `compiles` counts the compiles finished since `start`."""

    def __init__(self, on_compile: OnCompile) -> None:
        self.on_compile = on_compile
        self.compiles = 0
        self._runtime: Any = None  # triton.knobs.runtime while started
        self._before: tuple[Any, Any] = (None, None)  # the hooks replaced
        self._started_at: dict[str, float] = {}  # compile key -> time.monotonic() at its start

    def start(self) -> bool:
        """Hook Triton's JIT; False (and a log line) when this Triton cannot be watched."""
        try:
            from triton import knobs
        except ImportError:
            logger.info("this Triton has no knobs: compiles after ready are not watched")
            return False
        runtime = knobs.runtime
        self._before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._starting, self._finished
        self._runtime = runtime
        return True

    def stop(self) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._before
            self._runtime = None

    def _starting(self, **kwargs: Any) -> Any:
        """Before a compile: its start time. Returns the replaced hook's answer (a true
        answer makes Triton skip the compile, and then no post-compile hook runs)."""
        answer = self._before[0](**kwargs) if self._before[0] is not None else None
        if not answer:
            self._started_at[str(kwargs.get("key"))] = time.monotonic()
        return answer

    def _finished(self, **kwargs: Any) -> Any:
        answer = self._before[1](**kwargs) if self._before[1] is not None else None
        start = self._started_at.pop(str(kwargs.get("key")), None)
        seconds = 0.0 if start is None else time.monotonic() - start
        self.compiles += 1
        self.on_compile(str(kwargs.get("repr", "a Triton kernel")), seconds)
        return answer
