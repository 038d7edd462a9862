"""What /openapi.json says about each route: its request body (a pydantic model from
protocol.py), its answers (response models from responses.py, SSE for streams, text for
/metrics) and every status it can send, no other (FastAPI's 422 is never sent: validation
errors are 400).

Statuses added by the middleware go on every route they can reach: 401 with --api-key (not on
the open routes), 408 with --request-timeout, 413 on routes with a body, 503 on the generation
routes (starting, draining, dead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from dllm_serve.http.auth import OPEN_PATHS
from dllm_serve.http.lifecycle import GENERATION_PATHS
from dllm_serve.http.responses import ErrorResponse

REF = "#/components/schemas/{model}"
DESCRIPTIONS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Not found",
                408: "Past --request-timeout", 413: "Body past --max-payload-size",
                500: "The engine died or a bug (the message names the request id)",
                503: "Starting, draining, dead, queue full, or the engine did not answer"}
SSE_DOC = ("Server-sent events when `stream` is true: `data: {json}` frames (one chunk per "
           "committed block), an error as `data: {\"error\": {...}}`, then `data: [DONE]`.")
# one event of such a stream, as an SSE parser reads it (the WHATWG fields; `event` is
# "message" by default): before OpenAPI 3.2 a text/event-stream schema describes each event
SSE_EVENT = {"type": "object", "description": SSE_DOC, "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk, an error object or [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


@dataclass(frozen=True)
class Doc:
    """A route's documentation: its body model, the error statuses it sends itself, and
    whether it can stream."""

    body: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    stream: bool = False
    text: bool = False  # answers text/plain
    extra: dict[str, Any] = field(default_factory=dict)

    def route_kwargs(self) -> dict[str, Any]:
        """responses= and openapi_extra= for FastAPI's route decorator."""
        responses: dict[int | str, dict[str, Any]] = {
            code: {"model": ErrorResponse, "description": DESCRIPTIONS[code]}
            for code in self.errors}
        if self.stream:
            responses[200] = {"content": {"text/event-stream": {"schema": SSE_EVENT}}}
        if self.text:
            responses[200] = {"content": {"text/plain": {"schema": {"type": "string"}}}}
        extra: dict[str, Any] = dict(self.extra)
        if self.body is not None:
            extra["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(model=self.body.__name__)}}}}
        return {"responses": responses, "openapi_extra": extra}


def install_openapi(app: FastAPI, bodies: list[type[BaseModel]], api_key: bool,
                    timeout: bool) -> None:
    """Replace app.openapi with one that documents the bodies and the middleware's statuses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            _add_bodies(schema, bodies)
            for path, ops in schema["paths"].items():
                for method, op in ops.items():
                    _statuses(op, path, method, api_key, timeout)
                    _json_errors(op)
            _drop_422(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_bodies(schema: dict[str, Any], bodies: list[type[BaseModel]]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in bodies:
        body = model.model_json_schema(ref_template=REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body


def _statuses(op: dict[str, Any], path: str, method: str, api_key: bool,
              timeout: bool) -> None:
    codes = [401] if api_key and path not in OPEN_PATHS else []
    codes += [408] if timeout else []
    codes += [413] if "requestBody" in op else []
    codes += [503] if path in GENERATION_PATHS else []
    responses = op.setdefault("responses", {})
    for code in codes:
        responses.setdefault(str(code), {"description": DESCRIPTIONS[code], "content": {
            "application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}})


def _json_errors(op: dict[str, Any]) -> None:
    """Errors are JSON on every route: a text/plain route's (e.g. /flush_cache) error entries
    take FastAPI's media type for that route otherwise."""
    for code, response in op.get("responses", {}).items():
        content = response.get("content", {})
        if int(code) >= 400 and "text/plain" in content:
            response["content"] = {"application/json": content["text/plain"]}


def _drop_422(schema: dict[str, Any]) -> None:
    for ops in schema["paths"].values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
