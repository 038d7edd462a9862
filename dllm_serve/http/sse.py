"""Server-sent events: `data: {json}\\n\\n` frames, ending with `data: [DONE]\\n\\n`.

A stream is kick-started: its first chunk is awaited before the 200 status line goes out, so
every error up to then (validation, queue full, engine dead) is a normal JSON error answer. An
error after that is one `data: {"error": {...}}` frame, then `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dllm_serve.http.bridge import until_disconnected
from dllm_serve.http.errors import as_api_error, request_id

DONE = "data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def frame(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_response(request: Request, chunks: AsyncIterator[dict[str, Any]],
                       ) -> StreamingResponse:
    """Await the first chunk (errors raise here), then stream the rest."""
    try:
        first: dict[str, Any] | None = await until_disconnected(request, anext(chunks))
    except StopAsyncIteration:
        first = None
    frames = _frames(first, chunks, request_id(request))
    return _SSEResponse(frames, media_type="text/event-stream", headers=HEADERS)


class _SSEResponse(StreamingResponse):
    """Closes its frames however the response ends (done, client gone, or cancelled by the
    request timeout), which aborts the engine requests still running."""

    body_iterator: AsyncGenerator[str, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _frames(first: dict[str, Any] | None, chunks: AsyncIterator[dict[str, Any]],
                  rid: str | None) -> AsyncGenerator[str, None]:
    try:
        if first is not None:
            yield frame(first)
            async for chunk in chunks:
                yield frame(chunk)
    except Exception as e:  # noqa: BLE001 - any failure mid-stream becomes an error event
        yield frame(as_api_error(e, rid).body())
    finally:
        await _close(chunks)
    yield DONE


async def _close(chunks: AsyncIterator[dict[str, Any]]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
