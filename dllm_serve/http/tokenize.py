"""/tokenize, /detokenize and /tokenizer_info: the served model's tokenizer over HTTP (SGLang's
and vLLM's shapes; lm-eval's remote tokenizer reads them). The routes (`tokenize_route`,
`detokenize_route`) run off the event loop, in the tokenizing threads (`bridge.tokenized`): a
long text or id list (3M ids took 0.4 s to decode) never holds the other clients up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from dllm_serve.http.body import parse_body
from dllm_serve.http.bridge import tokenized
from dllm_serve.http.context import ServerContext
from dllm_serve.http.protocol import DetokenizeRequest, TokenizeRequest


async def tokenize_route(ctx: ServerContext, body: bytes) -> JSONResponse:
    return await tokenized(len(body), _encoded, tokenize, ctx, body)


async def detokenize_route(ctx: ServerContext, body: bytes) -> JSONResponse:
    return await tokenized(len(body), _encoded, detokenize, ctx, body)


def _encoded(fn: Callable[[ServerContext, bytes], dict[str, Any]], ctx: ServerContext,
             body: bytes) -> JSONResponse:
    """fn's answer, JSON-encoded in the calling thread (14 MB of text is tens of milliseconds
    of encoding: not the event loop's)."""
    return JSONResponse(fn(ctx, body))


def tokenize(ctx: ServerContext, body: bytes) -> dict[str, Any]:
    req = parse_body(TokenizeRequest, body)
    ctx.check_model(req.model)
    tok = ctx.require_front().tokenizer
    if isinstance(req.prompt, str):
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.context_length}
    lists = [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt]
    return {"tokens": lists, "count": [len(i) for i in lists],
            "max_model_len": ctx.context_length}


def detokenize(ctx: ServerContext, body: bytes) -> dict[str, Any]:
    req = parse_body(DetokenizeRequest, body)
    ctx.check_model(req.model)
    front = ctx.require_front()
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    lists: list[list[int]] = req.tokens if batch else [req.tokens]  # type: ignore[assignment]
    for ids in lists:
        front.check_ids(ids, "tokens")
    texts = front.tokenizer.decode_batch(lists, req.skip_special_tokens)
    text: str | list[str] = texts if batch else texts[0]
    return {"text": text, "prompt": text}


def tokenizer_info(ctx: ServerContext) -> dict[str, Any]:
    tok = ctx.require_front().tokenizer
    return {"tokenizer_class": str(tok.config.get("tokenizer_class") or "Tokenizer"),
            "model_max_length": ctx.context_length, "vocab_size": tok.vocab_size,
            "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": _token(tok.config.get("pad_token")), "mask_token": tok.mask_token,
            "add_bos_token": tok.add_bos_token, "chat_template": tok.chat_template}


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
