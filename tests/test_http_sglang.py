"""SGLang's surface on the real server (tiny model): the fields its clients send, its info,
load, cache and tokenizer routes, /health_generate under load, numeric limits, the OpenAPI
document, request ids."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import Server, pools_whole, shared_server

from dllm_serve.tokenizer import Tokenizer

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
EXTREMES = [1e308, -1e308, 5e-324, 3.5e38, -0.0]
# What SGLang 0.5.23's own tools put in a request, at the values they send by default.
FRONTEND_PARAMS = {  # sglang.lang's RuntimeEndpoint.generate
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
    "min_new_tokens": 0, "n": 1, "stop": ["Question"], "stop_token_ids": [], "stop_regex": None,
    "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}
BENCH_GENERATE = {  # sglang.bench_serving --backend sglang
    "lora_path": None, "return_logprob": False, "return_routed_experts": False,
    "logprob_start_len": -1}
ROUTER_OPENAI = {"no_stop_trim": False, "return_hidden_states": False,
                 "skip_special_tokens": True}
ROUTER_CHAT = {**ROUTER_OPENAI, "continue_final_message": False, "separate_reasoning": True,
               "stream_reasoning": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    return shared_server(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def test_sglang_clients_fields_are_accepted(server: Server) -> None:
    body = {"text": "Question: 1 + 1 =", "sampling_params": FRONTEND_PARAMS, **BENCH_GENERATE,
            "model": "tiny"}
    assert ok(server.post("/generate", body))["meta_info"]["completion_tokens"] <= 16
    ok(server.post(CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 2, **ROUTER_OPENAI,
                          "best_of": 1, "top_k": -1, "min_p": 0.0, "min_tokens": 0,
                          "repetition_penalty": 1.0, "regex": None, "lora_path": None}))
    ok(server.post(CHAT, {"model": "tiny", "messages": USER, "max_completion_tokens": 2,
                          **ROUTER_CHAT}))


def test_prefill_only_request_is_empty_with_length(server: Server) -> None:
    out = ok(server.post("/generate", {"text": "a prefix", "sampling_params": {
        "max_new_tokens": 0}}))
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["prompt_tokens"] > 0


def test_native_n_and_min_new_tokens(server: Server) -> None:
    outs = ok(server.post("/generate", {"text": ["a", "b"], "sampling_params": {
        "max_new_tokens": 3, "n": 2, "ignore_eos": True}}))
    assert len(outs) == 4 and outs[0]["output_ids"] == outs[1]["output_ids"]
    one = ok(server.post("/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 5, "min_new_tokens": 5, "stop_token_ids": list(range(448))}}))
    assert one["meta_info"]["completion_tokens"] == 5  # every token is a stop token
    r = server.post("/generate", {"text": "a", "stream": True, "sampling_params": {"n": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_top_k_min_p_sampling_and_tiny_temperature(server: Server) -> None:
    base = {"model": "tiny", "prompt": "The", "max_tokens": 20, "ignore_eos": True}
    greedy = ok(server.post(CMPL, base))["choices"][0]["text"]
    assert ok(server.post(CMPL, {**base, "temperature": 5e-324}))["choices"][0]["text"] == greedy
    one = ok(server.post(CMPL, {**base, "temperature": 1.5, "top_k": 1, "seed": 3}))
    assert one["choices"][0]["text"] == greedy  # top_k 1 keeps only the greedy token
    ok(server.post(CMPL, {**base, "temperature": 3.4e38, "min_p": 0.5, "seed": 1}))


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("route,field", [
    (CMPL, "temperature"), (CMPL, "top_p"), (CMPL, "min_p"), (CHAT, "temperature"),
    (CMPL, "dllm_threshold"), ("/generate", "temperature"), ("/generate", "top_p"),
    ("/generate", "dllm_threshold")])
def test_extreme_floats_are_served_or_named(server: Server, route: str, field: str,
                                            value: float) -> None:
    if route == "/generate":
        body: dict[str, Any] = {"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                 field: value}}
    else:
        body = {"model": "tiny", "max_tokens": 2, field: value,
                **({"messages": USER} if route == CHAT else {"prompt": "x"})}
    r = server.post(route, body)
    valid = abs(value) <= 3.4028234663852886e38 and {
        "temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
        "dllm_threshold": 0 <= value <= 1}[field]
    if valid:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_info_routes(server: Server) -> None:
    info = ok(server.get("/server_info"))
    assert info["internal_states"][0]["kv_pool"] == info["kv_pool"]
    # what sglang-router --dp-aware and bench_one_batch_server read
    assert info["dp_size"] == 1 and info["tokenizer_path"] == info["model_path"]
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == info[
        "max_running_requests"]
    assert ok(server.get("/get_server_info"))["served_model_name"] == "tiny"
    model = ok(server.get("/model_info"))
    assert model == ok(server.get("/get_model_info")) and model["is_generation"]
    assert model["architectures"] == ["LLaDA2MoeModelLM"]
    assert ok(server.get("/ready")) == {"status": "ready"}
    load = ok(server.get("/get_load"))
    assert load[0]["dp_rank"] == 0 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(
        load[0])
    assert ok(server.get("/v1/models"))["data"][0]["root"] == "tiny"
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url("/flush_cache"), timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


def test_tokenizer_routes(server: Server, tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    for prefix in ("", "/v1"):
        one = ok(server.post(f"{prefix}/tokenize", {"prompt": "Hello world"}))
        assert one == {"tokens": ids, "count": len(ids), "max_model_len": 4096}
        two = ok(server.post(f"{prefix}/tokenize", {"prompt": ["a", "b"],
                                                    "add_special_tokens": False}))
        assert two["count"] == [len(tok.encode("a")), len(tok.encode("b"))]
        text = ok(server.post(f"{prefix}/detokenize", {"tokens": ids}))
        assert text == {"text": "Hello world", "prompt": "Hello world"}
    assert ok(server.post("/detokenize", {"tokens": [ids, ids]}))["text"] == ["Hello world"] * 2
    for bad, tokens in ((10**6, [10**6]), (-1, [ids, [1, -1]])):
        r = server.post("/detokenize", {"tokens": tokens})
        assert r.status_code == 400
        error = r.json()["error"]
        assert f"Token id {bad} is out of vocabulary" in error["message"]
        assert error["param"] == "tokens"
    info = ok(server.get("/tokenizer_info"))
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_health_generate_answers_fast_while_busy(server: Server) -> None:
    body = {"prompt": "busy", "max_tokens": 400, "ignore_eos": True}
    threads = [threading.Thread(target=server.post, args=(CMPL, body)) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while ok(server.get("/get_load"))[0]["num_reqs"] < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    assert server.get("/health_generate").status_code == 200
    took = time.monotonic() - start
    server.post("/abort_request", {"abort_all": True})
    for t in threads:
        t.join(120)
    assert took < 2.0, took
    pools_whole(server)


def test_openapi_documents_every_route_truthfully(server: Server) -> None:
    schema = ok(server.get("/openapi.json"))
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), "operationIds must be unique (OpenAPI)"
    assert {"get", "post"} <= set(schema["paths"]["/flush_cache"])
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            for code, response in op["responses"].items():  # errors are JSON everywhere
                assert int(code) < 400 or list(response["content"]) == ["application/json"]
            if method == "post" and path != "/flush_cache":
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.split("/")[-1] in schema["components"]["schemas"], path
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    stream = schema["paths"][CMPL]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/event-stream"} <= set(stream)
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "temperature", "top_k", "min_tokens", "lora_path"} <= set(completion)
    assert "HTTPValidationError" not in schema["components"]["schemas"]


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 40}}),
    (CMPL, {"prompt": "a", "stream": True, "max_tokens": 40}),
    (CHAT, {"messages": USER, "stream": True, "max_tokens": 40}),
])
def test_every_streamed_event_matches_the_documented_event_schema(
        server: Server, path: str, body: dict[str, Any]) -> None:
    """A stream's events, read as an SSE parser reads them (`data`, and `event` "message" by
    default), each match the route's text/event-stream schema in /openapi.json (before OpenAPI
    3.2 that schema describes one event: schemathesis validates each event against it)."""
    import jsonschema_rs

    schema = ok(server.get("/openapi.json"))
    event_schema = schema["paths"][path]["post"]["responses"]["200"]["content"][
        "text/event-stream"]["schema"]
    with httpx.stream("POST", server.url(path), json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert len(data) >= 3 and data[-1] == "[DONE]"  # two blocks of 32 tokens, then [DONE]
    validator = jsonschema_rs.validator_for(event_schema)
    for d in data:
        validator.validate({"data": d, "event": "message"})
    assert not validator.is_valid("data: [DONE]")  # an event is an object, not a raw line


def test_request_id_header(server: Server) -> None:
    r = server.get("/health")
    assert r.headers["x-request-id"].startswith("req-")
    r = httpx.get(server.url("/health"), headers={"x-request-id": "abc-123"}, timeout=30)
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.post(server.url(CMPL), content=json.dumps({"prompt": 1}), timeout=30,
                   headers={"content-type": "application/json", "x-request-id": "bad id!"})
    assert r.status_code == 400 and r.headers["x-request-id"].startswith("req-")
