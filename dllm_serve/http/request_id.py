"""Every HTTP request gets an id: the client's `x-request-id` header if it is a short plain
token, else a fresh one. The answer carries it in `x-request-id`; 5xx messages name it and the
log records the details under it (errors.py)."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TOKEN = re.compile(rb"[A-Za-z0-9._:-]{1,64}")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _given(scope) or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _given(scope: Scope) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"x-request-id" and _TOKEN.fullmatch(value):
            return value.decode()
    return None
