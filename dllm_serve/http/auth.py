"""`--api-key`: every route needs `Authorization: Bearer KEY`, except health, readiness and
metrics.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would hide client
disconnects from the routes). Keys are compared as SHA-256 digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from dllm_serve.http.errors import raw_error

OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.rstrip("/") in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        headers, body = raw_error(401, "Unauthorized: a valid API key is required "
                                  "('Authorization: Bearer KEY').")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [*headers, (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        ok = hmac.compare_digest(_digest(token.strip()), self.digest)
        return scheme.lower() == b"bearer" and ok


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
