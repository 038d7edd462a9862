"""The server's phases, the drain on SIGTERM/SIGINT, and the dead-child watchdog.

    starting --(engine loaded)--> ready --(signal)--> draining --(in-flight done)--> exit 0
        any phase --(a child process died)--> dead --(in-flight answered)--> exit 1

Generation routes (GENERATION_PATHS) are counted while they run (a stream counts until its
last byte) and answered 503 with `x-should-retry: false` in every phase but ready. /health
is 200 only when ready. The drain waits for the in-flight count to reach 0, at most
shutdown_timeout seconds, then aborts what is left; a second signal aborts at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from dllm_serve.http.errors import NO_RETRY, raw_error
from dllm_serve.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate",
                              "/health_generate"})
STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"
NOT_READY_MESSAGES = {
    STARTING: "The server is starting: the model is still loading.",
    DRAINING: "The server is shutting down and accepts no new requests.",
    DEAD: "The engine has died; the server is exiting.",
}
ABORT_GRACE_S = 5.0  # after aborting, how long in-flight requests get to send their answer
POLL_S = 0.05


class Lifecycle:
    def __init__(self, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.phase = STARTING
        self.started_at = time.time()
        self.inflight = 0
        self.exit_code = 0
        self.front: TokenizerManager | None = None
        self.stop_server: Callable[[], None] = lambda: None
        self.signals = 0
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def ready(self) -> bool:
        return self.phase == READY

    def mark_ready(self, front: TokenizerManager) -> None:
        self.front = front
        if self.phase == STARTING:
            self.phase = READY

    # ---- signals and drain ----------------------------------------------------------------

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("%s again: aborting %d in-flight request(s)",
                           signal.Signals(sig).name, self.inflight)
            self._spawn(self._stop_after_abort())
            return
        logger.info("%s: draining %d in-flight request(s) (up to %.0f s); new requests get "
                    "503. Send the signal again to abort them.", signal.Signals(sig).name,
                    self.inflight, self.shutdown_timeout)
        if self.phase != DEAD:
            self.phase = DRAINING
        self._spawn(self._drain())

    async def _drain(self) -> None:
        if not await self._wait_idle(self.shutdown_timeout):
            logger.warning("shutdown timeout: aborting %d request(s)", self.inflight)
            await self._stop_after_abort()
            return
        self.stop_server()

    async def _stop_after_abort(self) -> None:
        if self.front is not None and not self.front.closed:
            self.front.abort(abort_all=True)
        await self._wait_idle(ABORT_GRACE_S)
        self.stop_server()

    async def _wait_idle(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        return self.inflight == 0

    # ---- dead children --------------------------------------------------------------------

    async def watch(self, front: TokenizerManager, poll_s: float = 0.25) -> None:
        """Once a child process is gone: unhealthy, answer what is in flight, exit 1."""
        while (reason := front.dead or front.procs.dead()) is None:
            await asyncio.sleep(poll_s)
        logger.error("the engine died (%s); the server exits", reason.splitlines()[0])
        self.phase, self.exit_code = DEAD, 1
        await self._wait_idle(ABORT_GRACE_S)
        self.stop_server()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- the gate in front of generation routes --------------------------------------------

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def gate(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
                await app(scope, receive, send)
                return
            if not self.ready:
                await _reject(send, NOT_READY_MESSAGES[self.phase])
                return
            self.inflight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.inflight -= 1

        return gate


async def _reject(send: Send, message: str) -> None:
    headers, body = raw_error(503, message)
    extra = [(k.encode(), v.encode()) for k, v in NO_RETRY.items()]
    await send({"type": "http.response.start", "status": 503, "headers": [*headers, *extra]})
    await send({"type": "http.response.body", "body": body})
