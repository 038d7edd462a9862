"""The routes around generation: models, health, server / model info, load, cache, tokenizer,
metrics (SGLang's names, with its older `get_` forms kept)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from dllm_serve.http import health, tokenize
from dllm_serve.http.body import read_json
from dllm_serve.http.context import ServerContext
from dllm_serve.http.errors import APIError, unavailable
from dllm_serve.http.metrics import held_pages
from dllm_serve.http.openapi import Doc
from dllm_serve.http.protocol import DetokenizeRequest, TokenizeRequest
from dllm_serve.http.responses import (
    DetokenizeResponse,
    Load,
    ModelCard,
    ModelInfo,
    ModelList,
    ServerInfo,
    Status,
    TokenizeResponse,
    TokenizerInfo,
)

ENGINE = (500, 503)  # routes that ask the scheduler: dead (500) or no answer in time (503)


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    _models(app, ctx)
    _health(app, ctx)
    _info(app, ctx)
    _tokenizer(app, ctx)
    if ctx.metrics is not None:
        metrics = ctx.metrics

        @app.get("/metrics", response_class=PlainTextResponse, **Doc(text=True).route_kwargs())
        async def get_metrics() -> Response:
            text = await asyncio.to_thread(metrics.render)
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _models(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(ctx)]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             **Doc(errors=(404,)).route_kwargs())
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card(ctx) | {"id": model_id}


def model_card(ctx: ServerContext) -> dict[str, Any]:
    """SGLang's ModelCard: `root` is the served name."""
    return {"id": ctx.model_name, "object": "model", "created": int(ctx.life.started_at),
            "owned_by": "dllm-serve", "root": ctx.model_name, "parent": None,
            "max_model_len": ctx.context_length}


def _health(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health", response_model=Status, **Doc(errors=(503,)).route_kwargs())
    async def health_route() -> Response:
        if not ctx.life.ready:
            raise unavailable(f"The server is {ctx.life.phase}.")
        return JSONResponse({"status": "ok"})

    @app.get("/ready", response_model=Status, **Doc(errors=(503,)).route_kwargs())
    async def ready() -> Response:
        if not ctx.life.ready:
            raise unavailable(f"The server is {ctx.life.phase}.")
        return JSONResponse({"status": "ready"})

    @app.get("/health_generate", response_model=Status, **Doc(errors=(503,)).route_kwargs())
    async def health_generate() -> Response:
        await health.check_progress(ctx)
        return JSONResponse({"status": "ok"})


def _info(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/server_info", response_model=ServerInfo, **Doc(errors=ENGINE).route_kwargs())
    @app.get("/get_server_info", response_model=ServerInfo,
             **Doc(errors=ENGINE).route_kwargs())
    async def server_info() -> dict[str, Any]:
        return await asyncio.to_thread(ctx.server_info)

    @app.get("/model_info", response_model=ModelInfo)
    @app.get("/get_model_info", response_model=ModelInfo)
    async def model_info() -> dict[str, Any]:
        return ctx.model_info()

    @app.get("/get_load", response_model=list[Load], **Doc(errors=ENGINE).route_kwargs())
    async def get_load() -> list[dict[str, Any]]:
        return [load(await asyncio.to_thread(ctx.scheduler_info))]

    flush_doc = Doc(text=True, errors=(400, *ENGINE)).route_kwargs()

    @app.get("/flush_cache", response_class=PlainTextResponse, **flush_doc)
    @app.post("/flush_cache", response_class=PlainTextResponse, **flush_doc)  # (a route of
    async def flush_cache() -> Response:  # its own per method: an operationId each)
        """Empty the radix prefix cache (SGLang's route): 200 and a line of text, or a 400
        while requests are running or waiting (nothing is flushed then)."""
        result = await asyncio.to_thread(ctx.flush_cache)
        if not result.success:
            raise APIError(400, result.message)
        return PlainTextResponse(result.message + "\n")


def load(info: dict[str, Any]) -> dict[str, Any]:
    """SGLang's /get_load entry for the one engine (data-parallel rank 0)."""
    running, waiting = info["num_running_reqs"], info["num_waiting_reqs"]
    used = held_pages(info) * info["kv_pool"]["page_size"]  # a warm prefix cache is no load
    return {"dp_rank": 0, "num_reqs": running + waiting, "num_running_reqs": running,
            "num_waiting_reqs": waiting, "num_tokens": used}


def _tokenizer(app: FastAPI, ctx: ServerContext) -> None:
    limit = ctx.args.max_payload_size
    body_errors = Doc(TokenizeRequest, (400, 404, 503)).route_kwargs()

    @app.post("/tokenize", response_model=TokenizeResponse, **body_errors)
    @app.post("/v1/tokenize", response_model=TokenizeResponse, **body_errors)
    async def tokenize_route(request: Request) -> JSONResponse:
        return await tokenize.tokenize_route(ctx, await read_json(request, limit))

    detok_errors = Doc(DetokenizeRequest, (400, 404, 503)).route_kwargs()

    @app.post("/detokenize", response_model=DetokenizeResponse, **detok_errors)
    @app.post("/v1/detokenize", response_model=DetokenizeResponse, **detok_errors)
    async def detokenize_route(request: Request) -> JSONResponse:
        return await tokenize.detokenize_route(ctx, await read_json(request, limit))

    @app.get("/tokenizer_info", response_model=TokenizerInfo,
             **Doc(errors=(503,)).route_kwargs())
    async def tokenizer_info() -> dict[str, Any]:
        return tokenize.tokenizer_info(ctx)
