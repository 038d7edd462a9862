"""Talking to a running OpenAI-compatible server: its URLs, model id, and dLLM block statistics.

`--base-url` may be given with or without the trailing `/v1`. The dLLM numbers (tokens per forward,
forwards per block) cannot be seen on the OpenAI wire; they come from the scheduler counters that
dllm-serve publishes at `/get_server_info` (`stats`), read before and after a run. Where a server
has no such counters they are reported as unavailable, never estimated.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

INFO_ROUTES = ("/get_server_info", "/server_info")


def api_root(base_url: str) -> str:
    """`http://host:port` from `http://host:port`, `.../` or `.../v1`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def api_key(explicit: str | None) -> str | None:
    return explicit or os.environ.get("OPENAI_API_KEY")


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def model_id(root: str, key: str | None, timeout: float = 30.0) -> str:
    """The first model the server lists at /v1/models."""
    r = httpx.get(f"{root}/v1/models", headers=headers(key), timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def server_info(root: str, key: str | None, timeout: float = 30.0) -> dict[str, Any] | None:
    """The server's /get_server_info JSON, or None if it has no such route."""
    for route in INFO_ROUTES:
        try:
            r = httpx.get(root + route, headers=headers(key), timeout=timeout)
        except httpx.HTTPError:
            return None
        if r.status_code == 200:
            return r.json()
    return None


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None,
                ) -> dict[str, int] | None:
    """after["stats"] - before["stats"], or None when either has no stats."""
    if not before or not after or "stats" not in before or "stats" not in after:
        return None
    b, a = before["stats"], after["stats"]
    return {k: a[k] - b[k] for k in a if k in b}


def prompt_cache_stats(before: dict[str, Any] | None, after: dict[str, Any] | None,
                       ) -> dict[str, Any]:
    """Prompt tokens taken from the radix prefix cache vs computed during a run, from the
    server's `radix_cache` counters read before and after it (server-wide: the run must be
    the only traffic); None values for a server without them."""
    if not before or not after or "radix_cache" not in before or "radix_cache" not in after:
        return {"prompt_tokens_cached": None, "prompt_tokens_computed": None,
                "prompt_recomputed_share": None}
    b, a = before["radix_cache"], after["radix_cache"]
    hit, miss = a["hit_tokens"] - b["hit_tokens"], a["miss_tokens"] - b["miss_tokens"]
    return {"prompt_tokens_cached": hit, "prompt_tokens_computed": miss,
            "prompt_recomputed_share": miss / (hit + miss) if hit + miss else None}


def block_stats(delta: dict[str, int] | None, completion_tokens: int) -> dict[str, Any]:
    """Tokens per forward and forwards per committed block from a stats delta.

    The forwards the committed blocks took are the request-steps minus those spent on blocks that
    were already done (sync's waste); counters are server-wide, so the run must be the server's
    only traffic.
    """
    keys = ("request_steps", "wasted_request_steps", "committed_blocks")
    if delta is None or not all(k in delta for k in keys):
        return {"tokens_per_forward": None, "forwards_per_block_mean": None,
                "source": "unavailable: the server publishes no dLLM step counters"}
    forwards = delta["request_steps"] - delta["wasted_request_steps"]
    return {"tokens_per_forward": completion_tokens / forwards if forwards else None,
            "forwards_per_block_mean": (forwards / delta["committed_blocks"]
                                        if delta["committed_blocks"] else None),
            "source": "server /get_server_info stats (server-wide counters)"}
