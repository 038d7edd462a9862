"""The FastAPI app: the generation routes, the middleware stack and the OpenAPI document.

Request bodies are read and parsed by body.py, not by FastAPI, so that every malformed body is a
400 in OpenAI's error shape; /openapi.json still documents each body's pydantic model
(openapi.py). Middleware order (outermost first): request id, API key, request timeout
(--request-timeout: 408 and an abort past it), lifecycle gate (503 unless ready; counts
in-flight generation requests), methods (HEAD as GET, a 405's full Allow: methods.py), FastAPI.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp

from dllm_serve import __version__
from dllm_serve.http import info_routes, native, openai_serving
from dllm_serve.http.auth import ApiKeyMiddleware
from dllm_serve.http.body import read_json
from dllm_serve.http.context import ServerContext
from dllm_serve.http.errors import install_handlers
from dllm_serve.http.methods import MethodsMiddleware
from dllm_serve.http.openapi import Doc, install_openapi
from dllm_serve.http.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from dllm_serve.http.request_id import RequestIdMiddleware
from dllm_serve.http.responses import (
    AbortResponse,
    ChatCompletionResponse,
    CompletionResponse,
    GenerateResponse,
)
from dllm_serve.http.timeout import RequestTimeoutMiddleware

BODIES = [CompletionRequest, ChatCompletionRequest, GenerateRequest, AbortRequest,
          TokenizeRequest, DetokenizeRequest]
GENERATION_ERRORS = (400, 404, 500)


def build_app(ctx: ServerContext) -> ASGIApp:
    """The ASGI app of the server (FastAPI wrapped in its middleware)."""
    app = FastAPI(title="dllm-serve", version=__version__)
    install_handlers(app)
    _add_generation_routes(app, ctx)
    info_routes.add_routes(app, ctx)
    install_openapi(app, BODIES, api_key=bool(ctx.args.api_key),
                    timeout=ctx.args.request_timeout is not None)
    asgi: ASGIApp = ctx.life.middleware(MethodsMiddleware(app, app.routes))
    if ctx.args.request_timeout is not None:
        asgi = RequestTimeoutMiddleware(asgi, ctx.args.request_timeout)
    if ctx.args.api_key:
        asgi = ApiKeyMiddleware(asgi, ctx.args.api_key)
    return RequestIdMiddleware(asgi)


def _add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    limit = ctx.args.max_payload_size

    @app.post("/v1/completions", response_model=CompletionResponse,
              **Doc(CompletionRequest, GENERATION_ERRORS, stream=True).route_kwargs())
    async def completions(request: Request) -> Response:
        return await openai_serving.create_completion(ctx, request, await read_json(request, limit))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              **Doc(ChatCompletionRequest, GENERATION_ERRORS, stream=True).route_kwargs())
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, limit)
        return await openai_serving.create_chat_completion(ctx, request, body)

    @app.post("/generate", response_model=GenerateResponse | list[GenerateResponse],
              **Doc(GenerateRequest, (400, 500), stream=True).route_kwargs())
    async def generate(request: Request) -> Response:
        return await native.generate(ctx, request, await read_json(request, limit))

    @app.post("/abort_request", response_model=AbortResponse,
              **Doc(AbortRequest, (400, 503)).route_kwargs())
    async def abort_request(request: Request) -> Response:
        return await native.abort_request(ctx, await read_json(request, limit))
