"""The asyncio side of the front: engine requests whose updates arrive in the event loop.

The TokenizerManager calls each request's callback on its receiver thread; the callback only
stamps the time and hops into the loop with `call_soon_threadsafe`, onto the queue of the
`Generation` that owns the request. Texts are tokenized off the loop (`tokenized`), in threads
of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from starlette.requests import Request

from dllm_serve.http.errors import ClientDisconnected, raise_if_failed
from dllm_serve.managers.procs import collector_paused
from dllm_serve.managers.tokenizer_manager import GenOutput, TokenizerManager
from dllm_serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Tokenizing runs in threads of its own, not the loop's default executor, which the info and
# health routes use: long texts waiting for a thread never delay /metrics or /health_generate.
# Requests whose body is past LONG_BODY_BYTES tokenize in a pool of their own: a few long
# texts (seconds each) never make a short prompt wait for a thread.
TOKENIZE_THREADS = 4
LONG_TOKENIZE_THREADS = 2
LONG_BODY_BYTES = 1 << 20
_tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
_long_pool = ThreadPoolExecutor(LONG_TOKENIZE_THREADS, thread_name_prefix="tokenize-long")


async def tokenized(body_bytes: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args), a tokenizing call (the front's `tokenize`, `tokenize_all`), in the tokenizing
    threads (a request of body_bytes past LONG_BODY_BYTES: the long-text threads): the tokenizer
    lets go of the GIL while it encodes (`Tokenizer.encode`), so the event loop serves other
    clients meanwhile (30 MB of text took 31 s to encode on a 2-core CPU)."""
    pool = _long_pool if body_bytes > LONG_BODY_BYTES else _tokenize_pool
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


@dataclass(frozen=True)
class Choice:
    """One engine request: its prompt ids, settings and request id."""

    input_ids: list[int]
    params: SamplingParams
    rid: str


@dataclass(frozen=True)
class Update:
    index: int  # the choice it belongs to
    out: GenOutput
    at: float  # time.monotonic() when the front delivered it


class Observer(Protocol):
    def on_update(self, update: Update) -> None: ...


class Generation:
    """The engine requests behind one HTTP request, their updates merged in arrival order.

    Invariants: every choice is validated before any is submitted, so a rejected request leaves
    nothing running; `close()` (end of stream, error, client gone, cancellation) aborts every
    choice that has not finished, so the engine frees its KV pages and request slot. The
    observer sees every update as it arrives, also after the HTTP side stopped reading, so a
    request whose client left is still counted (with the abort that ends it).
    """

    def __init__(self, front: TokenizerManager, choices: list[Choice],
                 observer: Observer | None = None) -> None:
        self.front = front
        self.choices = choices
        self.observer = observer
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.unfinished = set(range(len(choices)))
        for c in choices:
            front.validate(c.input_ids, c.params)
        self._submit_all()

    def _submit_all(self) -> None:
        submitted: list[str] = []
        try:
            with collector_paused():
                for i, c in enumerate(self.choices):
                    self.front.submit(c.input_ids, c.params, self._callback(i), c.rid)
                    submitted.append(c.rid)
        except BaseException:
            for rid in submitted:
                self.front.abort(rid)
            self.unfinished.clear()
            raise

    def _callback(self, index: int) -> Callable[[GenOutput], None]:
        def deliver(out: GenOutput) -> None:  # on the front's receiver thread
            update = Update(index, out, time.monotonic())
            try:
                self.loop.call_soon_threadsafe(self._arrived, update)
            except RuntimeError:  # the loop is closed: the server is exiting
                pass

        return deliver

    def _arrived(self, update: Update) -> None:  # in the event loop
        if self.observer is not None:
            self.observer.on_update(update)
        self.queue.put_nowait(update)

    async def updates(self) -> AsyncIterator[Update]:
        """Every update of every choice until all have finished; closes itself at the end."""
        try:
            while self.unfinished:
                update = await self.queue.get()
                if update.out.finished:
                    self.unfinished.discard(update.index)
                yield update
        finally:
            self.close()

    async def finals(self) -> list[GenOutput]:
        """The last update of each choice, in choice order. A choice the engine rejected or
        failed (an abort with a status) raises its APIError at once, aborting the others."""
        last: dict[int, GenOutput] = {}
        try:
            async for update in self.updates():
                if update.out.finished:
                    raise_if_failed(update.out.finish_reason)
                    last[update.index] = update.out
        finally:
            self.close()
        return [last[i] for i in range(len(self.choices))]

    def close(self) -> None:
        for i in sorted(self.unfinished):
            self.front.abort(self.choices[i].rid)
        if self.unfinished:
            logger.info("aborted %d unfinished request(s) of %s", len(self.unfinished),
                        self.choices[0].rid)
        self.unfinished.clear()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which closes its Generation) if the client disconnects.

    The body must have been read already: the next ASGI message is then the disconnect.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let its finally blocks abort the engine requests
    raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
