"""`--request-timeout`: a deadline on every HTTP request, from its arrival to its last byte.

It covers reading the body (a client that sends it slowly), waiting in the queue, generating,
and streaming the answer out (a client that does not read it). When it passes, the route is
cancelled, which closes its Generation: the engine aborts its requests and frees their KV pages
and request slots. Then the client gets, like the router in front of SGLang:
- 408 with OpenAI's error JSON (`code: "request_timeout"`, `x-should-retry: false`: a request
  that ran out of time would run out again) if its answer had not started;
- a `data: {"error": {...}}` event, then `data: [DONE]`, if a stream had started.
A client that does not read even that gets its connection closed after WRITE_GRACE_S.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dllm_serve.http.errors import NO_RETRY, APIError
from dllm_serve.http.sse import DONE, frame

logger = logging.getLogger(__name__)

WRITE_GRACE_S = 1.0


class RequestTimeoutMiddleware:
    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = _Answer(send)
        task = asyncio.ensure_future(self.app(scope, receive, answer.send))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.wait({task})  # its finally blocks abort the engine requests
        if not task.cancelled() and task.exception() is not None:
            logger.debug("request ended with an error after its timeout: %r", task.exception())
        logger.warning("%s %s passed --request-timeout (%g s): aborted", scope["method"],
                       scope["path"], self.timeout)
        try:
            await asyncio.wait_for(answer.timed_out(scope, self.error()), WRITE_GRACE_S)
        except asyncio.TimeoutError:
            pass  # the client reads nothing; returning unfinished closes the connection

    def error(self) -> APIError:
        return APIError(408, f"The request took longer than the server's request timeout "
                        f"({self.timeout:g} s) and was aborted.", code="request_timeout",
                        headers=NO_RETRY)


class _Answer:
    """Follows what was sent, to finish the answer the right way when time is up."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.stream = False
        self.complete = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers: list[Any] = message.get("headers", [])
            self.stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                              for k, v in headers)
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def timed_out(self, scope: Scope, error: APIError) -> None:
        if not self.started:
            await error.response()(scope, _no_receive, self._send)
        elif self.stream and not self.complete:
            body = (frame(error.body()) + DONE).encode()
            await self._send({"type": "http.response.body", "body": body, "more_body": False})


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
