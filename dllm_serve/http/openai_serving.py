"""/v1/completions and /v1/chat/completions over the front.

Each prompt is submitted n times (choice index = prompt index * n + copy; with a seed, copy i
uses seed + i). Usage counts prompt tokens once per prompt and completion tokens over every
choice. A stream sends one chunk per committed block and choice (empty blocks, whose text is
held back for a possible stop string or an unfinished UTF-8 character, are skipped), exactly
one finish_reason per choice, the same id/created on every chunk, the role on a chat choice's
first chunk, and a last `choices: []` usage chunk only with stream_options.include_usage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError as JinjaError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dllm_serve.errors import RequestError, params_named
from dllm_serve.http.body import parse_request
from dllm_serve.http.bridge import Choice, Generation, Update, tokenized, until_disconnected
from dllm_serve.http.context import ServerContext
from dllm_serve.http.errors import raise_if_failed
from dllm_serve.http.protocol import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
    message_dicts,
    prompt_batch,
    unused_and_overrides,
)
from dllm_serve.http.sse import sse_response
from dllm_serve.managers.tokenizer_manager import GenOutput, TokenizerManager
from dllm_serve.request_fields import CHAT, OPENAI
from dllm_serve.sampling_params import SamplingParams, copy_seed


@dataclass(frozen=True)
class Head:
    """What every response or chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str
    chat: bool

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}


async def create_completion(ctx: ServerContext, request: Request, body: bytes) -> Response:
    req = await parse_request(CompletionRequest, body)
    ctx.check_model(req.model)
    overrides = unused_and_overrides(req, OPENAI)
    front = ctx.require_front()
    prompts = await tokenized(len(body), front.tokenize_all, prompt_batch(req.prompt))
    default = None if "max_tokens" in req.model_fields_set else COMPLETION_MAX_TOKENS
    return await _serve(ctx, request, req, prompts, (req.max_tokens, default), overrides,
                        chat=False)


async def create_chat_completion(ctx: ServerContext, request: Request, body: bytes) -> Response:
    req = await parse_request(ChatCompletionRequest, body)
    ctx.check_model(req.model)
    overrides = unused_and_overrides(req, CHAT)
    front = ctx.require_front()
    max_tokens = req.max_completion_tokens or req.max_tokens
    asked = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    with params_named({"prompt": "messages", "max_tokens": asked}):
        ids = await tokenized(len(body), _render_and_tokenize, front,
                              message_dicts(req.messages))
        return await _serve(ctx, request, req, [ids], (max_tokens, None), overrides, chat=True)


def _render_and_tokenize(front: TokenizerManager, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template rendered, then tokenized (both in a tokenizing thread: a long
    conversation renders for a while too)."""
    try:
        text = front.tokenizer.apply_chat_template(messages)
    except (ValueError, JinjaError) as e:
        raise RequestError(f"Cannot apply the chat template: {e}", param="messages") from None
    except Exception as e:  # noqa: BLE001 - the template's own code failed on these messages
        raise RequestError(f"Cannot apply the chat template: {type(e).__name__}: {e}",
                           param="messages") from None
    return front.tokenize(text)


async def _serve(ctx: ServerContext, request: Request, req: SamplingFields,
                 prompts: list[list[int]], lengths: tuple[int | None, int | None],
                 overrides: dict[str, Any], chat: bool) -> Response:
    """lengths: (max_tokens as asked, the route's default). When max_tokens is None the
    default (None: no limit) is cut to what fits, so that leaving it out never fails; an
    explicit value that cannot fit is a 400."""
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed with stream=true",
                           param="stream_options")
    max_tokens, default = lengths
    prefix = "chatcmpl" if chat else "cmpl"
    head = Head(f"{prefix}-{uuid.uuid4().hex}", "chat.completion" if chat else "text_completion",
                int(time.time()), ctx.model_name, chat)
    front = ctx.require_front()
    choices = [Choice(ids, _params(req, _max_new_tokens(max_tokens, default, front.room(len(ids))),
                                   overrides, i), f"{head.id}-{p * req.n + i}")
               for p, ids in enumerate(prompts) for i in range(req.n)]
    observer = ctx.metrics.observer() if ctx.metrics is not None else None
    gen = Generation(front, choices, observer)
    prompt_tokens = sum(len(ids) for ids in prompts)
    if req.stream:
        return await sse_response(request, _chunks(gen, head, Tally(prompt_tokens, req.n),
                                                   _usage_mode(req.stream_options)))
    return JSONResponse(await until_disconnected(request, _collect(gen, head,
                                                                   Tally(prompt_tokens, req.n))))


def _max_new_tokens(asked: int | None, default: int | None, room: int) -> int:
    if asked is not None:
        return asked
    return room if default is None else min(default, room)


def _params(req: SamplingFields, max_new_tokens: int, overrides: dict[str, Any],
            copy: int) -> SamplingParams:
    """OpenAI fields -> SamplingParams (choice `copy` of its prompt)."""
    fields = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens,
        "temperature": 0.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "stop": req.stop or [], "stop_regex": req.stop_regex or [],
        "stop_token_ids": req.stop_token_ids or [], "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim, "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "seed": None if req.seed is None else copy_seed(req.seed, copy),
    }
    try:
        return SamplingParams.from_dict({**fields, **overrides})
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None


@dataclass
class Tally:
    """One response's usage: prompt tokens once per prompt, completion tokens over every
    choice, and the prompt tokens the prefix cache held (each prompt's first copy's count:
    OpenAI's usage.prompt_tokens_details.cached_tokens, SGLang's meta_info cached_tokens)."""

    prompt_tokens: int
    copies: int  # n: choices per prompt, prompt-major
    completion: dict[int, int] = field(default_factory=dict)  # choice -> tokens so far
    cached: dict[int, int] = field(default_factory=dict)  # first copies -> cached tokens

    def add(self, index: int, out: GenOutput) -> None:
        self.completion[index] = out.meta["completion_tokens"]
        if index % self.copies == 0:
            self.cached[index] = out.meta.get("cached_tokens", 0)

    def usage(self) -> dict[str, Any]:
        completion = sum(self.completion.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


async def _collect(gen: Generation, head: Head, tally: Tally) -> dict[str, Any]:
    finals = await gen.finals()
    choices = [_choice(head, i, out) for i, out in enumerate(finals)]
    for i, out in enumerate(finals):
        tally.add(i, out)
    return head.wrap(choices, usage=tally.usage())


def _usage_mode(options: StreamOptions | None) -> str:
    """The stream's usage: "" none; "final" (include_usage) a last chunk with it, usage null
    on the others; "every" (and continuous_usage_stats, as vLLM) the usage so far on each
    chunk too."""
    if options is None or not options.include_usage:
        return ""
    return "every" if options.continuous_usage_stats else "final"


async def _chunks(gen: Generation, head: Head, tally: Tally,
                  usage_mode: str) -> AsyncIterator[dict[str, Any]]:
    chunk_head = Head(head.id, f"{head.object}.chunk" if head.chat else head.object,
                      head.created, head.model, head.chat)
    started: set[int] = set()
    try:
        async for update in gen.updates():
            out = update.out
            tally.add(update.index, out)
            if out.finished:
                raise_if_failed(out.finish_reason)
            elif not out.delta:
                continue
            first = update.index not in started
            started.add(update.index)
            extra = ({"usage": tally.usage()}
                     if usage_mode == "every" else {"usage": None} if usage_mode else {})
            yield chunk_head.wrap([_delta(chunk_head, update, first)], **extra)
    finally:
        gen.close()  # closed early (client gone, error): abort what is still running
    if usage_mode:
        yield chunk_head.wrap([], usage=tally.usage())


def _choice(head: Head, index: int, out: GenOutput) -> dict[str, Any]:
    reason = out.finish_reason or {}
    body: dict[str, Any] = ({"message": {"role": "assistant", "content": out.text}}
                            if head.chat else {"text": out.text})
    return {"index": index, **body, "logprobs": None, "finish_reason": finish_reason(reason),
            "matched_stop": reason.get("matched")}


def _delta(head: Head, update: Update, first: bool) -> dict[str, Any]:
    """One choice's chunk; its last (finish_reason set) also has matched_stop, as SGLang's."""
    out = update.out
    reason = finish_reason(out.finish_reason) if out.finished else None
    last = {"matched_stop": (out.finish_reason or {}).get("matched")} if out.finished else {}
    if not head.chat:
        return {"index": update.index, "text": out.delta, "logprobs": None,
                "finish_reason": reason, **last}
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if out.delta or first:
        delta["content"] = out.delta
    return {"index": update.index, "delta": delta, "logprobs": None, "finish_reason": reason,
            **last}


def finish_reason(reason: dict[str, Any] | None) -> str | None:
    """The engine's finish reason -> OpenAI's: stop, length, or abort (SGLang/vLLM's extra)."""
    return None if reason is None else str(reason.get("type"))

