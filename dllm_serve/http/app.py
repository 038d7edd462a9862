"""The FastAPI app: routes, body reading, and the middleware stack.

Request bodies are read and parsed here, not by FastAPI, so that every malformed body is a
400 in OpenAI's error shape: wrong Content-Type, bad JSON, a non-object, too large (413).
Middleware order (outermost first): API key, request timeout (--request-timeout: 408 and an
abort past it), lifecycle gate (503 unless ready; counts in-flight generation requests), FastAPI.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp

from dllm_serve import __version__
from dllm_serve.http import native, openai_serving
from dllm_serve.http.auth import ApiKeyMiddleware
from dllm_serve.http.bridge import Choice, Generation
from dllm_serve.http.context import ServerContext
from dllm_serve.http.errors import APIError, install_handlers, unavailable
from dllm_serve.http.timeout import RequestTimeoutMiddleware
from dllm_serve.sampling_params import SamplingParams

HEALTH_GENERATE_TIMEOUT_S = 20.0
JSON_TYPES = ("application/json",)


def build_app(ctx: ServerContext) -> ASGIApp:
    """The ASGI app of the server (FastAPI wrapped in its middleware)."""
    app = FastAPI(title="dllm-serve", version=__version__)
    install_handlers(app)
    _add_routes(app, ctx)
    asgi: ASGIApp = ctx.life.middleware(app)
    if ctx.args.request_timeout is not None:
        asgi = RequestTimeoutMiddleware(asgi, ctx.args.request_timeout)
    if ctx.args.api_key:
        asgi = ApiKeyMiddleware(asgi, ctx.args.api_key)
    return asgi


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    limit = ctx.args.max_payload_size

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_serving.create_completion(ctx, request, await read_json(request, limit))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, limit)
        return await openai_serving.create_chat_completion(ctx, request, body)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await native.generate(ctx, request, await read_json(request, limit))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        return await native.abort_request(ctx, await read_json(request, limit))

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx)]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return _model_card(ctx) | {"id": model_id}

    @app.get("/health")
    async def health() -> Response:
        if not ctx.life.ready:
            raise unavailable(f"The server is {ctx.life.phase}.")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await _health_generate(ctx)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return await asyncio.to_thread(ctx.server_info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """Empty the radix prefix cache (SGLang's route): 200 and a line of text, or a 400
        error while requests are running or waiting (nothing is flushed)."""
        result = await asyncio.to_thread(ctx.flush_cache)
        if not result.success:
            raise APIError(400, result.message)
        return PlainTextResponse(result.message + "\n")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": ctx.args.model_path, "served_model_name": ctx.model_name,
                "tokenizer_path": ctx.args.tokenizer_path or ctx.args.model_path,
                "is_generation": True, "context_length": ctx.context_length}

    if ctx.metrics is not None:
        metrics = ctx.metrics

        @app.get("/metrics")
        async def get_metrics() -> Response:
            text = await asyncio.to_thread(metrics.render)
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def read_json(request: Request, limit: int) -> bytes:
    """The body of a JSON request: 400 for another Content-Type, 413 past `limit` bytes."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in JSON_TYPES:
        raise APIError(400, f"Unsupported Content-Type {kind or '(none)'!r}: send "
                       f"'Content-Type: application/json'.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Payload Too Large: the body exceeds {limit} bytes "
                    f"(--max-payload-size).")


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": int(ctx.life.started_at),
            "owned_by": "dllm-serve", "root": ctx.args.model_path, "parent": None,
            "max_model_len": ctx.context_length}


async def _health_generate(ctx: ServerContext) -> Response:
    """Run a one-token generation; 200 once the engine answers (even "queue full" proves the
    scheduler alive), 503 if it does not within the timeout or has died."""
    front = ctx.require_front()
    choice = Choice([0], SamplingParams(max_new_tokens=1), f"HEALTH_CHECK_{time.time_ns()}")
    gen = Generation(front, [choice])
    try:
        await asyncio.wait_for(gen.finals(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise unavailable("The engine did not answer a health check in time.") from None
    except APIError as e:
        if e.status == 500:
            raise unavailable(f"The engine is dead: {e.message}") from None
    return JSONResponse({"status": "ok"})
