"""SGLang's native API: POST /generate and POST /abort_request.

/generate takes `text` or `input_ids` (one prompt or a batch), `sampling_params` (SGLang's
names, e.g. max_new_tokens, plus dllm_* settings; one dict or one per prompt), `stream` and
`rid`, plus SGLang's other fields at their off values (request_fields.py). It answers
`{"text", "output_ids", "meta_info"}` (a list for a batch or n > 1, prompt-major). A stream (one
prompt, n = 1) sends one event per committed block whose `text` and `output_ids` are
cumulative, as SGLang's HTTP stream is by default (with --incremental-streaming-output: each
event's new text and ids only, the final one's included), and ends with `[DONE]`. An aborted request
answers 200 with `finish_reason.type == "abort"`; a request the scheduler rejected answers its
status. `max_new_tokens: 0` answers at once with an empty output (finish reason length).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dllm_serve.engine import (
    expand_n,
    normalize_prompts,
    per_prompt_params,
    result_dict,
    rids_per_prompt,
)
from dllm_serve.errors import RequestError, params_named
from dllm_serve.http.body import parse_request
from dllm_serve.http.bridge import Choice, Generation, tokenized, until_disconnected
from dllm_serve.http.context import ServerContext
from dllm_serve.http.errors import raise_if_failed
from dllm_serve.http.protocol import AbortRequest, GenerateRequest, native_params
from dllm_serve.http.protocol import unused_and_overrides as check_fields
from dllm_serve.http.sse import sse_response
from dllm_serve.request_fields import GENERATE


async def generate(ctx: ServerContext, request: Request, body: bytes) -> Response:
    req = await parse_request(GenerateRequest, body)
    check_fields(req, GENERATE)
    front = ctx.require_front()
    batch, prompts = normalize_prompts(req.text, req.input_ids, "text")
    if not prompts:
        raise RequestError("Give at least one prompt.", param="text")
    with params_named({"prompt": "text" if req.text is not None else "input_ids",
                       "max_tokens": "max_new_tokens"}):
        ids = await tokenized(len(body), front.tokenize_all, prompts)
        params = per_prompt_params(_sampling(req.sampling_params), len(ids))
        requests = expand_n(ids, params, rids_per_prompt(req.rid, len(ids)))
        if req.stream and len(requests) > 1:
            raise RequestError("stream=true takes a single prompt and n=1", param="stream")
        choices = [Choice(i, p, r or uuid.uuid4().hex) for i, p, r in requests]
        observer = ctx.metrics.observer() if ctx.metrics is not None else None
        gen = Generation(front, choices, observer)
    if req.stream:
        return await sse_response(request,
                                  _chunks(gen, ctx.args.incremental_streaming_output))
    finals = await until_disconnected(request, gen.finals())
    results = [result_dict(out) for out in finals]
    return JSONResponse(results if batch or len(results) > 1 else results[0])


def _sampling(p: Any) -> dict[str, Any] | list[dict[str, Any] | None] | None:
    if isinstance(p, list):
        return [native_params(x) for x in p]  # type: ignore[misc]
    return native_params(p)


async def _chunks(gen: Generation, incremental: bool) -> AsyncIterator[dict[str, Any]]:
    """The stream's events: cumulative text and output_ids, one for each block whose text
    grew and the final one; incremental (--incremental-streaming-output), each block's new
    text and ids only, one for every block that adds ids (even where its text is held back:
    joined, the events give the whole output)."""
    try:
        async for update in gen.updates():
            out = update.out
            if out.finished:
                raise_if_failed(out.finish_reason)
            if incremental and (out.finished or out.delta or out.new_ids):
                yield {"text": out.delta, "output_ids": out.new_ids, "meta_info": out.meta}
            elif not incremental and (out.finished or out.delta):
                yield result_dict(out)
    finally:
        gen.close()  # closed early (client gone, error): abort what is still running


async def abort_request(ctx: ServerContext, body: bytes) -> Response:
    """Abort one request by rid, or all; 200 either way (an unknown rid is a no-op)."""
    req = await parse_request(AbortRequest, body)
    if req.rid is None and not req.abort_all:
        raise RequestError("Give rid or abort_all=true.", param="rid")
    ctx.require_front().abort(req.rid, req.abort_all, copies=True)
    return JSONResponse({"success": True})
