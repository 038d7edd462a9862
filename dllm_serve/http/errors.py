"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every non-2xx answer of the server has this body, whatever raised it: our `APIError`, the
engine's `RequestError` (400) and `EngineDeadError` (500), FastAPI's validation errors (400,
never 422), Starlette's 404/405, and any other exception (500).
A 5xx never carries a traceback, a file path or an engine's internal message: the client gets
a short message and the request id (also in the `x-request-id` header), and the log gets the
details under the same id.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from dllm_serve.errors import EngineDeadError, RequestError

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               408: "timeout_error", 413: "invalid_request_error", 500: "server_error",
               503: "service_unavailable_error"}
# The openai client retries 5xx by default; a 503 means "busy or going away", so say no.
NO_RETRY = {"x-should-retry": "false"}
ENGINE_DEAD = "The engine has died; the server cannot serve requests."
REQUEST_FAILED = "The engine failed while serving this request; other requests go on."


class APIError(Exception):
    """An answer other than 2xx; `headers` are added to the response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; nothing is sent back."""


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unavailable(message: str) -> APIError:
    return APIError(503, message, headers=NO_RETRY)


def from_finish_reason(reason: Mapping[str, Any]) -> APIError | None:
    """The error carried by an engine abort with a status (queue full: 503, too big: 400; a
    failed engine: 500, whose internal message stays in the log)."""
    status = reason.get("status_code")
    if reason.get("type") == "error":  # this request failed alone in the engine
        return EngineFailed(str(reason.get("message", "")), REQUEST_FAILED)
    if reason.get("type") != "abort" or status is None:
        return None
    if int(status) == 500:
        return EngineFailed(str(reason.get("message", "")))
    headers = NO_RETRY if status == 503 else None
    return APIError(int(status), str(reason.get("message", "aborted")), headers=headers)


class EngineFailed(APIError):
    """A request the engine failed (it died, or this request failed alone); `detail` is for
    the log only."""

    def __init__(self, detail: str, message: str | None = None) -> None:
        super().__init__(500, message or ENGINE_DEAD)
        self.detail = detail


def raise_if_failed(finish_reason: Mapping[str, Any] | None) -> None:
    """Raise the APIError of a request the engine rejected or failed; else do nothing."""
    if (err := from_finish_reason(finish_reason or {})) is not None:
        raise err




def as_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Map any exception to the APIError it is answered with; a 5xx is logged with the
    request id and answered with a short message naming that id."""
    if isinstance(exc, RequestError):
        return APIError(exc.status, str(exc), param=exc.param)
    if isinstance(exc, APIError) and exc.status < 500:
        return exc
    if isinstance(exc, EngineFailed):
        logger.error("request %s failed: %s (%s)", request_id, exc.message, exc.detail)
        return _with_id(APIError(500, exc.message), request_id)
    if isinstance(exc, EngineDeadError):
        logger.error("request %s failed, the engine died: %s", request_id, exc)
        return _with_id(APIError(500, ENGINE_DEAD), request_id)
    if isinstance(exc, APIError):
        return _with_id(exc, request_id)
    logger.error("internal error in request %s", request_id, exc_info=exc)
    return _with_id(APIError(500, "Internal server error."), request_id)


def _with_id(err: APIError, request_id: str | None) -> APIError:
    if request_id is None:
        return err
    return APIError(err.status, f"{err.message} (request id {request_id})", err.param,
                    err.code, err.headers)


def request_id(conn: HTTPConnection) -> str | None:
    """The id the request-id middleware gave this request."""
    return conn.scope.get("state", {}).get("request_id")


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """A pydantic error list -> (one readable message, the first offending field)."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        msg = _BIG_NUMBER.sub(lambda m: f"{float(m.group(0)):.8g}", str(err.get("msg")))
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts), param


_BIG_NUMBER = re.compile(r"\d{16,}")  # pydantic writes float32's max with all 39 digits


def install_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI can see to an OpenAI-shaped error response."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc, request_id(request)).response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(list(exc.errors()))
        return APIError(400, message, param=param).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def on_disconnect(_: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    app.add_exception_handler(ClientDisconnected, on_disconnect)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_api_error)


def raw_error(status: int, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and body of an error answered below FastAPI (the ASGI auth middleware)."""
    body = json.dumps(error_body(status, message)).encode()
    return [(b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())], body
