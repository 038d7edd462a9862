"""`RequestTimeoutMiddleware` on stub ASGI apps: 408 before an answer, an error event inside a
stream, the route cancelled (so its cleanup runs), and a client that reads nothing cut off."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from dllm_serve.http.timeout import WRITE_GRACE_S, RequestTimeoutMiddleware

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
SSE = [(b"content-type", b"text/event-stream")]


async def receive() -> Message:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


class Route:
    """A stub route: optionally starts a stream, then waits forever; records its cleanup."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.cleaned_up = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.stream:
                await send({"type": "http.response.start", "status": 200, "headers": SSE})
                await send({"type": "http.response.body", "body": b"data: {}\n\n",
                            "more_body": True})
            await asyncio.sleep(3600)
        finally:
            self.cleaned_up = True


def run(app: Any, send: Send | None = None) -> tuple[list[Message], float]:
    sent: list[Message] = []

    async def record(message: Message) -> None:
        sent.append(message)

    async def main() -> float:
        start = time.monotonic()
        await RequestTimeoutMiddleware(app, 0.2)(SCOPE, receive, send or record)
        return time.monotonic() - start

    return sent, asyncio.run(main())


def test_no_answer_yet_is_408_and_the_route_is_cancelled() -> None:
    route = Route(stream=False)
    sent, elapsed = run(route)
    assert route.cleaned_up and elapsed >= 0.2
    start, body = sent
    assert start["status"] == 408
    assert (b"x-should-retry", b"false") in start["headers"]
    error = json.loads(body["body"])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert "request timeout (0.2 s)" in error["message"]


def test_started_stream_ends_with_an_error_event_then_done() -> None:
    route = Route(stream=True)
    sent, _ = run(route)
    assert route.cleaned_up
    last = sent[-1]
    assert not last.get("more_body", False)
    frames = last["body"].decode().split("\n\n")
    assert json.loads(frames[0][len("data: "):])["error"]["code"] == "request_timeout"
    assert frames[1:] == ["data: [DONE]", ""]


def test_a_client_that_reads_nothing_is_cut_off() -> None:
    """The error event cannot be written either: give up after WRITE_GRACE_S (uvicorn then
    closes the connection) rather than wait on the client (an hour here)."""
    started = []

    async def blocked_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            started.append(message)
            return
        await asyncio.sleep(3600)  # a full socket buffer: the client does not read

    route = Route(stream=True)
    _, elapsed = run(route, blocked_send)
    assert route.cleaned_up and started
    assert 0.2 + WRITE_GRACE_S <= elapsed < 60


def test_a_quick_route_is_untouched() -> None:
    async def quick(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent, _ = run(quick)
    assert [m.get("status") for m in sent] == [200, None]
