"""`run_server`: the HTTP process. Bind the port, load the engine, serve, shut down cleanly.

Order: uvicorn binds first (a busy port fails fast, before a model loads), /health answers 503
while the engine (scheduler and worker processes) starts in a thread, then the server logs its
URL and serves. It stops on a signal (after draining) or when a child process dies, and always
shuts the engine down, so no child outlives it. Exit code: 0 after a signal, 1 if the engine
failed to start or died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator

import uvicorn

from dllm_serve.engine_config import EngineConfig
from dllm_serve.http.app import build_app
from dllm_serve.http.context import ServerContext
from dllm_serve.managers.procs import freeze_startup_objects, setup_logging, warn_long_gc
from dllm_serve.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5  # for connections still open once the drain is over


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the Lifecycle decides when to stop.

    (uvicorn >= 0.29 installs its handlers in capture_signals, older ones in
    install_signal_handlers; both are switched off.)
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        pass


def run_server(config: EngineConfig) -> int:
    """Serve until stopped (config: resolved once, `cli.preflight`); returns the process exit
    code."""
    setup_logging(config.args.log_level)
    warn_long_gc(config.args.gc_warning_threshold_secs)
    return asyncio.run(_serve(ServerContext.create(config)))


async def _serve(ctx: ServerContext) -> int:
    args = ctx.args
    server = _Uvicorn(uvicorn.Config(
        build_app(ctx), host=args.host, port=args.port, log_config=None,
        log_level=args.log_level, timeout_keep_alive=5,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    ctx.life.stop_server = lambda: setattr(server, "should_exit", True)
    ctx.life.install_signal_handlers(asyncio.get_running_loop())
    serving = asyncio.create_task(_run_uvicorn(server))
    if not await _bound(server, serving):
        return await serving  # it could not bind; uvicorn logged why
    cancel = threading.Event()  # set by a stop while the engine loads
    loading = asyncio.create_task(asyncio.to_thread(TokenizerManager, ctx.config, cancel))
    await asyncio.wait({loading, serving}, return_when=asyncio.FIRST_COMPLETED)
    watch = _start(ctx, loading) if loading.done() else None
    await serving
    if watch is not None:
        watch.cancel()
    await _shutdown_engine(loading, cancel)
    return ctx.life.exit_code


async def _run_uvicorn(server: uvicorn.Server) -> int:
    """uvicorn's serve(); a startup failure (uvicorn calls sys.exit) becomes exit code 1."""
    try:
        await server.serve()
    except SystemExit:
        return 1
    return 0


async def _bound(server: uvicorn.Server, serving: asyncio.Task[int]) -> bool:
    while not server.started:
        if serving.done():
            return False
        await asyncio.sleep(0.02)
    return True


def _start(ctx: ServerContext, loading: asyncio.Task[TokenizerManager],
           ) -> asyncio.Task[None] | None:
    """Engine loaded (or failed): go ready and start the watchdog, or stop with code 1."""
    if (error := loading.exception()) is not None:
        logger.error("startup failed, the server exits: %s", error)
        ctx.life.exit_code = 1
        ctx.life.stop_server()
        return None
    front = loading.result()
    ctx.front = front
    freeze_startup_objects()  # the front's too: a full collection would stall every request
    ctx.life.mark_ready(front)
    host = f"[{ctx.args.host}]" if ":" in ctx.args.host else ctx.args.host  # IPv6
    url = f"http://{host}:{ctx.args.port}"
    startup = front.ready_info.get("startup", {})
    logger.info("dllm-serve is ready at %s (model %r; OpenAI API at %s/v1); worker started "
                "in %.1f s, %.1f s of it warm-up and CUDA graph capture", url, ctx.model_name,
                url, startup.get("worker_s", 0.0), startup.get("warmup_s", 0.0))
    return asyncio.create_task(ctx.life.watch(front))


async def _shutdown_engine(loading: asyncio.Task[TokenizerManager],
                           cancel: threading.Event) -> None:
    """Stop the engine; one still starting (Ctrl-C while the model loads) is stopped at once,
    not after its load."""
    if not loading.done():
        logger.info("stopping the engine's startup")
        cancel.set()
    try:
        front = await loading
    except Exception:  # noqa: BLE001 - reported by _start, or the startup we cancelled
        return
    await asyncio.to_thread(front.shutdown)
    logger.info("the engine is shut down")
