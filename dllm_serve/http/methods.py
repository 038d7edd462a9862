"""HTTP methods as RFC 9110 asks them of every route: HEAD wherever GET is served (the GET
answer's status and headers, no body), and a 405 whose `Allow` lists every method its path
serves. FastAPI registers one route per method and adds no HEAD; Starlette's 405 names only
the first route that matched the path (`/flush_cache`: POST alone, though GET serves too)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class MethodsMiddleware:
    def __init__(self, app: ASGIApp, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self.routes = list(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = scope["method"] == "HEAD" and "GET" in self.allowed(scope["path"])
        if head:
            scope = {**scope, "method": "GET"}

        async def send_allowed(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods = ", ".join(sorted(self.allowed(scope["path"])))
                headers = [h for h in message.get("headers", []) if h[0] != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", methods.encode())]}
            elif head and message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # HEAD: the body is not sent; its last (empty) message ends it
                message = {**message, "body": b""}
            await send(message)

        await self.app(scope, receive, send_allowed)

    def allowed(self, path: str) -> set[str]:
        """The methods the routes serve at `path` (with HEAD where GET is)."""
        methods: set[str] = set()
        for route in self.routes:
            regex, served = getattr(route, "path_regex", None), getattr(route, "methods", None)
            if regex is not None and served and regex.match(path):
                methods |= set(served)
        return methods | ({"HEAD"} if "GET" in methods else set())
