"""Native /generate, server info, health and metrics on the real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from http_helpers import Server, pools_whole, shared_server, sse_events, start_server
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    return shared_server(tiny_model_dir)


def test_generate_single_batch_and_ids(server: Server) -> None:
    one = server.post("/generate", {"text": "Hello", "rid": "native-1", "sampling_params": {
        "max_new_tokens": 40, "ignore_eos": True}}).json()
    meta = one["meta_info"]
    assert meta["id"] == "native-1" and meta["completion_tokens"] == 40 == len(one["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert meta["blocks"] == 2 and len(meta["block_forwards"]) == 2
    many = server.post("/generate", {"text": ["a", "bb"], "sampling_params": [
        {"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": 5, "ignore_eos": True}]})
    assert [m["meta_info"]["completion_tokens"] for m in many.json()] == [3, 5]
    ids = server.post("/generate", {"input_ids": [[5, 6, 7]], "sampling_params": {
        "max_new_tokens": 2}}).json()
    assert ids[0]["meta_info"]["prompt_tokens"] == 3


def test_sampling_seed_is_sglangs_name_for_seed(server: Server) -> None:
    """SGLang's native clients seed with sampling_params.sampling_seed: the same text as seed;
    both at different values, or one out of int64, is a 400 naming it."""
    def text(**seed: int) -> str:
        r = server.post("/generate", {"text": "x", "sampling_params": {
            "max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True, **seed}})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    assert text(sampling_seed=7) == text(seed=7) == text(seed=7, sampling_seed=7)
    assert text(sampling_seed=-1) == text(seed=-1) != text(seed=7)
    for bad in ({"seed": 7, "sampling_seed": 8}, {"sampling_seed": 2**63}):
        r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4,
                                                                       **bad}})
        assert r.status_code == 400 and "sampling_seed" in r.text, r.text


def test_generate_stream_is_cumulative_and_matches(server: Server) -> None:
    body = {"text": "stream me", "sampling_params": {"max_new_tokens": 70, "ignore_eos": True}}
    full = server.post("/generate", body).json()
    with httpx.stream("POST", server.url("/generate"), json={**body, "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 3 and chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_incremental_streaming_output_sends_each_blocks_new_text_and_ids(
        tiny_model_dir: Path) -> None:
    """With --incremental-streaming-output (SGLang's flag) a /generate stream's events carry
    only their new text and output_ids, the final event's included: joined, they are the
    non-stream answer, with a stop string cut as there; the OpenAI stream is unchanged."""
    inc = start_server(tiny_model_dir, "--incremental-streaming-output")

    def stream(body: dict) -> list[dict]:  # type: ignore[type-arg]
        with httpx.stream("POST", inc.url("/generate"), json={**body, "stream": True},
                          timeout=60) as r:
            return sse_events(r.iter_lines())[:-1]

    try:
        assert inc.get("/get_server_info").json()["incremental_streaming_output"] is True
        body = {"text": "stream me", "sampling_params": {"max_new_tokens": 70,
                                                         "ignore_eos": True}}
        full = inc.post("/generate", body).json()
        chunks = stream(body)
        assert len(chunks) == 3 and all(len(c["output_ids"]) <= 32 for c in chunks)
        assert "".join(c["text"] for c in chunks) == full["text"]
        assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
        text = full["text"]  # the last stop string that first occurs where it stands
        at = next(i for i in reversed(range(1, len(text) - 3))
                  if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
        stopped = {**body, "sampling_params": {**body["sampling_params"],
                                               "stop": [text[at:at + 3]]}}
        want = inc.post("/generate", stopped).json()
        assert want["text"] == text[:at]
        assert "".join(c["text"] for c in stream(stopped)) == text[:at]
        assert pools_whole(inc)
    finally:
        inc.stop()


def test_server_and_model_info(server: Server) -> None:
    info = pools_whole(server)
    assert info["served_model_name"] == "tiny" and info["context_length"] == 4096
    # slots: 8 running and 8 admitted ahead (--dllm-admit-ahead's default: as many)
    assert info["kv_pool"]["total_pages"] > 0 and info["req_pool"]["total_slots"] == 8 + 8
    assert {"num_running_reqs", "num_waiting_reqs", "stats", "version"} <= set(info)
    model = server.get("/get_model_info").json()
    assert model["is_generation"] and model["served_model_name"] == "tiny"


def test_health_routes(server: Server) -> None:
    assert server.get("/health").json() == {"status": "ok"}
    assert server.get("/health_generate").status_code == 200


def test_startup_logged_the_url(server: Server) -> None:
    assert f"dllm-serve is ready at {server.base}" in server.log_text()


def test_metrics(server: Server) -> None:
    server.post("/v1/completions", {"prompt": "metrics", "max_tokens": 40, "ignore_eos": True,
                                    "stream": True})
    text = server.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dllm:num_running_reqs", "dllm:num_queue_reqs", "dllm:kv_pages_used",
                 "dllm:time_to_first_block_seconds", "dllm:e2e_request_latency_seconds",
                 "dllm:inter_block_latency_seconds", "dllm:inter_token_latency_seconds",
                 "dllm:forwards_per_block", "dllm:prompt_tokens", "dllm:generation_tokens",
                 "dllm:denoise_rounds", "dllm:inplace_reloops",
                 "dllm:kernel_compiles_after_ready"):
        assert name in families, name
    assert 'model_name="tiny"' in text and "_bucket{" in text and "_sum{" in text

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert value("dllm:generation_tokens", "dllm:generation_tokens_total") >= 40
    assert value("dllm:forwards_per_block", "dllm:forwards_per_block_count") >= 2
    assert value("dllm:kv_pages_used", "dllm:kv_pages_used") == 0
    # the CPU server runs no Triton kernel: nothing compiles after ready
    assert value("dllm:kernel_compiles_after_ready",
                 "dllm:kernel_compiles_after_ready_total") == 0
    # 40 tokens in 2 blocks: 1 inter-block gap, observed once per token of the second block.
    gaps = value("dllm:inter_block_latency_seconds", "dllm:inter_block_latency_seconds_count")
    per_token = value("dllm:inter_token_latency_seconds", "dllm:inter_token_latency_seconds_count")
    assert gaps >= 1 and per_token >= 8
