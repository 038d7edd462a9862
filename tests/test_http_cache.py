"""The radix prefix cache over HTTP: /get_server_info's radix_cache, the cache metrics, and
/flush_cache (refused while a request runs, then really empties the cache)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from http_helpers import Server, pools_whole, shared_server
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "A long shared instruction that every request repeats before its question. " * 4


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    return shared_server(tiny_model_dir)


def cache_info(server: Server) -> dict[str, int]:
    return server.get("/get_server_info").json()["radix_cache"]


def metric(server: Server, name: str) -> float:
    families = text_string_to_metric_families(server.get("/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == name)


def test_a_repeated_prompt_hits_and_shows_in_info_and_metrics(server: Server) -> None:
    pools_whole(server)
    before = cache_info(server)
    hits = metric(server, "dllm:cache_hit_tokens_total")
    body = {"prompt": PROMPT + "Q1", "max_tokens": 8, "ignore_eos": True}
    first = server.post("/v1/completions", body).json()
    second = server.post("/v1/completions", body).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # OpenAI's field
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        first["usage"]["prompt_tokens"] // 32 * 32
    after = cache_info(server)
    prompt_tokens = first["usage"]["prompt_tokens"]
    cached = prompt_tokens // 32 * 32
    assert after["hit_tokens"] - before["hit_tokens"] == cached
    assert after["miss_tokens"] - before["miss_tokens"] == 2 * prompt_tokens - cached
    assert after["cached_pages"] >= cached // 32
    assert metric(server, "dllm:cache_hit_tokens_total") - hits == cached
    assert metric(server, "dllm:cache_miss_tokens_total") >= after["miss_tokens"] - 1
    assert metric(server, "dllm:cached_pages") == after["cached_pages"]
    assert metric(server, "dllm:kv_pages_used") == 0  # cached but unused: evictable
    load = server.get("/get_load").json()[0]  # and no load for sglang-router's policies
    assert load["num_reqs"] == 0 and load["num_tokens"] == 0
    native = server.post("/generate", {"text": PROMPT + "Q1", "sampling_params": {
        "max_new_tokens": 8, "ignore_eos": True}}).json()["meta_info"]
    assert native["cached_tokens"] == native["prompt_tokens"] // 32 * 32 > 0  # bench_serving's


def test_flush_cache_is_refused_while_a_request_runs(server: Server) -> None:
    body = {"text": PROMPT, "rid": "flush-blocker",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    done = threading.Thread(target=server.post, args=("/generate", body))
    done.start()
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = server.post("/flush_cache")
    server.post("/abort_request", {"rid": "flush-blocker"})
    done.join()
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and "running or waiting" in error["message"]
    info = pools_whole(server)
    assert info["radix_cache"]["cached_pages"] > 0
    flushed = server.get("/flush_cache")
    assert flushed.status_code == 200 and "Cache flushed" in flushed.text
    info = server.get("/get_server_info").json()
    assert info["radix_cache"]["cached_pages"] == 0 == info["radix_cache"]["evictable_pages"]
    assert info["kv_pool"]["free_pages"] == info["kv_pool"]["total_pages"]


def test_max_new_tokens_0_prefills_and_warms_the_cache(server: Server) -> None:
    """SGLang's prefill-only request (max_new_tokens 0): an empty answer, and the prompt's
    whole blocks are in the prefix cache for the next request."""
    text = PROMPT + "warm me"
    warm = server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})
    out = warm.json()
    assert out["text"] == "" and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 0
    after = server.post("/generate", {"text": text, "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True}}).json()["meta_info"]
    assert after["cached_tokens"] == after["prompt_tokens"] // 32 * 32 > 0
    pools_whole(server)

