"""One streamed `/v1/completions` request, timed chunk by chunk (OpenAI's SSE wire format).

A dLLM server sends one chunk per committed block, so a chunk carries many tokens. The record
keeps each content chunk's arrival time and text; token counts come from the usage chunk
(`stream_options.include_usage`) and, where the server sends usage on every chunk, per chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.common import now


@dataclass
class StreamRecord:
    """Times are seconds; chunk_times are offsets from `start`, one per chunk with text."""

    prompt_len: int  # the dataset's count; usage.prompt_tokens replaces it when sent
    max_tokens: int
    start: float = 0.0
    ok: bool = False
    error: str | None = None
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    chunk_usage: list[int] = field(default_factory=list)  # cumulative, when sent per chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def text(self) -> str:
        return "".join(self.chunk_texts)


async def stream_completion(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                            payload: dict[str, Any], record: StreamRecord) -> StreamRecord:
    """POST with stream=True and fill `record`; errors end up in record.error, never raised."""
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    record.start = now()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                async for line in resp.aiter_lines():
                    if _on_line(line, record):
                        break
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    record.latency = now() - record.start
    record.ok = record.error is None and record.finish_reason is not None
    if record.error is None and not record.ok:
        record.error = "the stream ended without a finish_reason"
    return record


def _on_line(line: str, record: StreamRecord) -> bool:
    """Consume one SSE line; True at the end of the stream."""
    if not line.startswith("data:"):
        return False
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return True
    msg = json.loads(data)
    if "error" in msg:
        record.error = f"stream error: {json.dumps(msg['error'])[:300]}"
        return False
    t = now() - record.start
    usage = msg.get("usage") or {}
    for choice in msg.get("choices") or []:
        if choice.get("text"):
            record.chunk_times.append(t)
            record.chunk_texts.append(choice["text"])
            if "completion_tokens" in usage:
                record.chunk_usage.append(usage["completion_tokens"])
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
    return False
