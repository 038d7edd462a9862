"""Serving metrics from streamed request records, in the manner of SGLang's bench_serving.

Latencies are reported in milliseconds as mean / median / std / p90 / p99 / max:
- TTFT: time to the first chunk with text (a whole block for a dLLM);
- inter-block latency (ITL per block): the gap between consecutive chunks with text;
- inter-token latency (ITL per token): each gap divided by the tokens that chunk brought,
  counted once per token, so a 32-token block arriving 64 ms after the last adds 32 gaps of 2 ms;
- TPOT: (latency - TTFT) / (output tokens - 1); E2E: the whole request.
Output tokens come from the usage chunk. Tokens per chunk come from per-chunk usage when the
server sends it, else from re-tokenising the growing text, scaled to the usage total (never from
counting chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.common import summary
from benchmarks.stream_client import StreamRecord

Encode = Callable[[str], list[int]]


def chunk_tokens(rec: StreamRecord, encode: Encode | None) -> tuple[list[int] | None, str]:
    """Tokens each chunk brought, and where the counts come from.

    Re-tokenised counts are scaled to the usage total when there is one (decoded text does not
    always re-encode to as many tokens as were generated), so they always add up to it."""
    if rec.chunk_usage and len(rec.chunk_usage) == len(rec.chunk_texts):
        return _diffs(rec.chunk_usage), "per-chunk usage"
    if encode is None:
        return None, "unavailable: no per-chunk usage and no tokenizer to re-tokenise with"
    text, totals = "", []
    for piece in rec.chunk_texts:
        text += piece
        totals.append(len(encode(text)))
    counts = _diffs(totals)
    if rec.completion_tokens is not None:
        counts = apportion(counts, rec.completion_tokens)
    return counts, "re-tokenised text"


def _diffs(cumulative: list[int]) -> list[int]:
    return [max(1, b - a) for a, b in zip([0, *cumulative], cumulative, strict=False)]


def apportion(weights: list[int], total: int) -> list[int]:
    """Integers proportional to `weights` that sum to `total` (largest remainders)."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def request_metrics(rec: StreamRecord, encode: Encode | None) -> dict[str, Any]:
    """Per-request numbers (seconds) for one successful record."""
    gaps = [b - a for a, b in zip(rec.chunk_times, rec.chunk_times[1:], strict=False)]
    per_chunk, source = chunk_tokens(rec, encode)
    out_len = rec.completion_tokens
    if out_len is None and per_chunk is not None:
        out_len = sum(per_chunk)
    per_token = None
    if per_chunk is not None:  # a chunk that brought no token adds no per-token gap
        per_token = [g / n for g, n in zip(gaps, per_chunk[1:], strict=True) for _ in range(n)]
    ttft = rec.ttft if rec.ttft is not None else rec.latency
    tpot = (rec.latency - ttft) / (out_len - 1) if out_len and out_len > 1 else None
    return {"prompt_tokens": rec.prompt_tokens if rec.prompt_tokens is not None
            else rec.prompt_len, "output_tokens": out_len, "ttft": ttft, "e2e": rec.latency,
            "block_gaps": gaps, "token_gaps": per_token, "tpot": tpot,
            "chunk_tokens": per_chunk, "chunk_tokens_source": source}


def aggregate(records: list[StreamRecord], duration: float, encode: Encode | None,
              ) -> dict[str, Any]:
    """The run's metrics: counts, throughputs, latency summaries in ms, failures."""
    done = [request_metrics(r, encode) for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    ins = sum(m["prompt_tokens"] for m in done)
    outs = [m["output_tokens"] for m in done]
    total_out = sum(outs) if all(o is not None for o in outs) else None
    token_gaps = [g for m in done for g in m["token_gaps"] or []]
    per_token_known = all(m["token_gaps"] is not None for m in done)
    return {
        "completed": len(done), "failed": len(failed), "duration_s": duration,
        "total_input_tokens": ins, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "input_throughput": ins / duration,
        "output_throughput": total_out / duration if total_out is not None else None,
        "total_token_throughput": (ins + total_out) / duration if total_out is not None else None,
        "concurrency": sum(m["e2e"] for m in done) / duration,
        "ttft_ms": _ms([m["ttft"] for m in done]),
        "itl_block_ms": _ms([g for m in done for g in m["block_gaps"]]),
        "itl_token_ms": _ms(token_gaps) if per_token_known else None,
        "tpot_ms": _ms([m["tpot"] for m in done if m["tpot"] is not None]),
        "e2e_latency_ms": _ms([m["e2e"] for m in done]),
        "tokens_per_chunk": summary([float(n) for m in done for n in m["chunk_tokens"] or []]),
        "chunk_tokens_source": sorted({m["chunk_tokens_source"] for m in done}),
        "errors": sorted({r.error or "" for r in failed})[:10],
    }


def _ms(seconds: list[float]) -> dict[str, float | None]:
    return summary([s * 1000.0 for s in seconds])
